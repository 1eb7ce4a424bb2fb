"""C kernels compiled at first use (engine/kernels/native.py): built once into the cache folder and
reused; a failing or absent compiler, or MLX_DSPARK_NATIVE=0, gives None (callers use numpy)."""

from __future__ import annotations

import pytest

from engine.kernels import native


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLX_DSPARK_NATIVE", raising=False)  # the suite may run with kernels off
    return tmp_path


def test_built_once_and_reused(cache):
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    lib = native._build("cpu_kernels")
    assert lib is not None and hasattr(lib, "attention_rows") and hasattr(lib, "swiglu")
    (built,) = (cache / "native").glob("cpu_kernels-*.so")
    stamp = built.stat().st_mtime_ns
    assert native._build("cpu_kernels") is not None
    assert built.stat().st_mtime_ns == stamp and not list((cache / "native").glob("*.tmp*"))


def test_a_failing_compiler_falls_back(cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # exits 1, as a broken toolchain would
    assert native._build("cpu_kernels") is None
    assert "compiling cpu_kernels failed" in caplog.text
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("*.tmp*"))


def test_turned_off(cache, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_NATIVE", "0")
    assert native._build("cpu_kernels") is None
