"""The BLAS the engine reports is the one MLX's matmul binds to, the cost curve is keyed on
it, a cached curve that no longer holds is re-measured, and the CLI warns on a slow BLAS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import CostCurve, curve_for_requests, curve_key, load_target
from engine.tuning.cost_curve import curve_still_holds, save_cost_curve
from engine.base.platform import blas_name, find_openblas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import numpy, mlx.core as mx; from engine.base.platform import mlx_blas_path, loaded_blas; "
         "from engine.base.platform import device_name; "
         "import json; print(json.dumps([mlx_blas_path(), loaded_blas(), device_name()]))")
linux = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and the mlx-cpu wheel are Linux's")


def probe(preload: str) -> tuple[str, str, str]:
    env = {**os.environ, "LD_PRELOAD": preload, "MLX_DSPARK_NO_REEXEC": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


@linux
def test_numpy_openblas_mapped_is_not_mlx_blas():
    """numpy (imported first) maps its own OpenBLAS; MLX still runs on the wheel's reference
    BLAS unless one is preloaded, and the report says so."""
    path, name, device = probe("")
    if "openblas" in os.path.realpath(path).lower():
        pytest.skip("this system's libblas.so.3 is OpenBLAS already")
    assert name.startswith("reference BLAS") and name in device
    assert "numpy" not in path


@linux
@pytest.mark.skipif(find_openblas() is None, reason="needs OpenBLAS installed")
def test_preloaded_openblas_is_reported_and_keys_the_curve():
    path, name, device = probe(find_openblas())
    assert name.startswith("OpenBLAS") and name in device
    other = probe("")
    if not other[1].startswith("OpenBLAS"):
        assert other[2] != device  # another BLAS, another cost-curve key


def test_blas_names():
    assert blas_name("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3").startswith("OpenBLAS")
    assert blas_name("/x/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference BLAS (libblas-bd8a282c.so.3.10.0)"
    assert blas_name(None) == "unknown"


@linux
def test_cli_warns_once_on_a_slow_blas(tiny_model_dir):
    env = {**os.environ, "LD_PRELOAD": "", "MLX_DSPARK_NO_REEXEC": "1"}
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "generate", "--model", str(tiny_model_dir),
                        "--max-tokens", "2", "--prompt", "hi"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "slow" in line and "BLAS" in line]
    if probe("")[1].startswith("reference"):
        assert len(warnings) == 1 and "reference BLAS" in warnings[0]
    else:
        assert not warnings


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    from engine import forget_measurements

    forget_measurements()
    return tmp_path / "cache"


def test_a_cached_curve_that_no_longer_holds_is_remeasured(cache_home, tiny_model_dir):
    """A curve 20x too slow (measured on another BLAS under this key) is replaced at first use."""
    target = load_target(tiny_model_dir)
    key = curve_key(target)
    stale = CostCurve(widths=[1, 16, 64], depths=[64], seconds=[[2.0, 3.0, 6.0]], key=key)
    assert not curve_still_holds(target, stale)
    save_cost_curve(stale)
    curve = curve_for_requests(target)
    assert curve.measured and curve.step_seconds(1, 64) < 1.0
    assert json.loads(next(cache_home.glob("cost-curve-*.json")).read_text())["seconds"] != stale.seconds


def test_better_core_asks_for_the_vector_units_the_cpu_has():
    from engine.base.platform import better_core

    avx512 = {"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"}
    assert better_core("Prescott", avx512) == "SkylakeX"  # a CPU newer than the OpenBLAS release
    assert better_core("Haswell", avx512) == "SkylakeX"
    assert better_core("Prescott", {"avx2", "fma"}) == "Haswell"
    for core, flags in (("SkylakeX", avx512), ("Cooperlake", avx512), ("Zen", {"avx2", "fma"}),
                        ("Prescott", {"sse3"}), (None, avx512)):
        assert better_core(core, flags) is None


@linux
@pytest.mark.skipif(find_openblas() is None, reason="needs OpenBLAS installed")
def test_the_reexec_asks_for_kernels_the_cpu_runs_and_children_do_not_inherit_it(tmp_path):
    """Where OpenBLAS picks kernels older than the CPU (it doesn't know the model), the CLI's
    re-exec sets OPENBLAS_CORETYPE, preloaded by us or by the caller; a user's own is kept."""
    from engine.base.platform import better_core, cpu_flags

    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, subprocess, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from engine.base.platform import ensure_fast_blas, loaded_blas\n"
        "ensure_fast_blas()\n"
        "import mlx.core\n"
        "child = subprocess.run(['sh', '-c', 'echo \"$OPENBLAS_CORETYPE\"'], capture_output=True, text=True)\n"
        "print(json.dumps([loaded_blas(), child.stdout.strip()]))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_DSPARK_NO_REEXEC", "OPENBLAS_CORETYPE")}

    def run(**env):
        out = subprocess.run([sys.executable, str(script)], env={**base, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    own = subprocess.run([sys.executable, "-c", "import ctypes, sys; sys.path.insert(0, sys.argv[1]); "
                          "from engine.base.platform import openblas_core; print(openblas_core(ctypes.CDLL(sys.argv[2])))",
                          REPO, find_openblas()], env=base, capture_output=True, text=True, timeout=60).stdout.strip()
    want = better_core(own, cpu_flags())
    for env in ({}, {"LD_PRELOAD": find_openblas()}):
        blas, child = run(**env)
        assert blas.startswith("OpenBLAS") and f"{want or own} kernels" in blas
        assert child == ""
    blas, child = run(OPENBLAS_CORETYPE="Prescott")
    assert "Prescott kernels" in blas and child == "Prescott"


@linux
@pytest.mark.skipif(find_openblas() is None, reason="needs OpenBLAS installed")
def test_the_reexec_sends_idle_openblas_workers_to_sleep_and_children_do_not_inherit_it(tmp_path):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT as it loads: the re-exec'd process starts with ours
    (platform.BLAS_THREAD_TIMEOUT) unless the user set one, and the programs it starts don't get ours."""
    from engine.base.platform import BLAS_THREAD_TIMEOUT

    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, subprocess, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from engine.base.platform import ensure_fast_blas\n"
        "ensure_fast_blas()\n"
        "at_exec = dict(v.split('=', 1) for v in open('/proc/self/environ').read().split('\\0') if '=' in v)\n"
        "child = subprocess.run(['sh', '-c', 'echo \"$OPENBLAS_THREAD_TIMEOUT\"'], capture_output=True, text=True)\n"
        "print(json.dumps([at_exec.get('OPENBLAS_THREAD_TIMEOUT'), child.stdout.strip()]))\n")
    base = {k: v for k, v in os.environ.items()  # nor the re-exec's own guards, were we run from one
            if k not in ("LD_PRELOAD", "MLX_DSPARK_NO_REEXEC", "OPENBLAS_THREAD_TIMEOUT")
            and not k.startswith("MLX_DSPARK_BLAS_")}

    def run(**env):
        out = subprocess.run([sys.executable, str(script)], env={**base, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run() == [BLAS_THREAD_TIMEOUT, ""]
    assert run(OPENBLAS_THREAD_TIMEOUT="12") == ["12", "12"]
