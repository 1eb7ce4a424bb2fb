"""Shared fixtures: tiny random models (qwen3 and llama) built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("MLX_DSPARK_NO_REEXEC", "1")  # tests run in-process; scripts/test.sh preloads BLAS
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_models import build_tiny_model  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FIXTURES = SHARED / "fixtures"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=1)


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """An empty measurement cache (cost curves, crossovers, chunk sizes) for one test."""
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    """The tiny model loaded as the engine loads it (engine.model.target.load_target)."""
    from engine.model.target import load_target

    return load_target(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from engine import Engine

    engine = Engine(str(tiny_model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def safety_engine(tmp_path_factory):
    """A real engine whose tiny model was trained on the MCP safety chats (tests/mcp_cases.py)."""
    from engine import Engine
    from forced_model import train_forced_model
    from mcp_cases import safety_chats

    engine = Engine(str(train_forced_model(tmp_path_factory.mktemp("safety"), safety_chats())), prefix_cache=False)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return FIXTURES


@pytest.fixture
def route_as_found(monkeypatch):
    """The quantised-layer route (engine/kernels/quantized_route.py) off and none of its variables set
    for one test, and left as it was found (on MLX CUDA load_target installed it)."""
    from engine.kernels import quantized_route

    rows, narrow = quantized_route.wide_rows(), quantized_route.narrow_rows
    quantized_route.uninstall()
    for name in ("MLX_DSPARK_WIDE_DEQUANTIZE", "MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", "MLX_DSPARK_NARROW_QMM_ROWS"):
        monkeypatch.delenv(name, raising=False)
    yield
    quantized_route.uninstall()
    if rows is not None:
        monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
        monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", str(rows))
        monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "%d-%d" % narrow if narrow[1] else "0")
        quantized_route.install()
