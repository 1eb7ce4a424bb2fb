"""The quantised layer over a few rows on tensor cores (engine/kernels/narrow_qmm.py).

Where MLX CUDA runs: the kernel computes x @ dequantize(W).T, element by element within what rounding
to bf16/fp16 allows, for every layout it takes, row counts from 2 to MAX_ROWS (each tile count,
padded ones too), K splitting into fewer steps than warps and into counts that aren't a multiple of
them, and groups of very different scales (a scale or bias read from the wrong group or row shows);
the same bits whether a warp computes one group of 16 features or two.
Anywhere: which layers and widths it takes, that only the engine's forwards on MLX CUDA take it, by
default from where it was measured faster, the variable that sets the rows, and that a model's
instances are built at load."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.base.errors import EngineError
from engine.base.platform import on_cuda
from engine.kernels import narrow_qmm, quantized_route

pytestmark = pytest.mark.usefixtures("route_as_found")  # tests/conftest.py: the route off, variables unset
cuda_only = pytest.mark.skipif(not on_cuda(), reason="the kernel runs on MLX CUDA")


def layer(n: int, k: int, bits: int, group_size: int, dtype=mx.bfloat16, bias: bool = False, seed: int = 0):
    """A quantised layer whose groups' scales differ by up to 100x (uniform init would make them alike)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-1, 1, (n, k // group_size, 1)).repeat(group_size, 1).reshape(n, k)
    linear = nn.Linear(k, n, bias=bias)
    linear.weight = mx.array(w.astype(np.float32))
    q = nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits)
    q.set_dtype(dtype)  # scales and biases in the activations' dtype, as a converted checkpoint has them
    return q


def check(q: nn.QuantizedLinear, x: mx.array) -> None:
    """narrow_qmm against x @ dequantize(W).T in float32: each output within 2^-7 of the sum of its
    terms' magnitudes (bf16 keeps 8 bits: the weights and the output are rounded once each)."""
    assert narrow_qmm.fits(q, x)
    got = narrow_qmm.linear(q, x)
    w = mx.dequantize(q["weight"], q["scales"], q["biases"], group_size=q.group_size, bits=q.bits)
    xf, wf = np.array(x.astype(mx.float32)), np.array(w.astype(mx.float32))
    want = xf @ wf.T + (np.array(q["bias"].astype(mx.float32)) if "bias" in q else 0)
    scale = np.abs(xf) @ np.abs(wf).T + 1e-3
    assert got.shape == want.shape and got.dtype == x.dtype
    err = np.abs(np.array(got.astype(mx.float32)) - want) / scale
    assert err.max() < 2 ** -7, (x.shape, float(err.max()))


@cuda_only
@pytest.mark.parametrize("bits,group_size,dtype,k", [
    (8, 64, mx.bfloat16, 1024), (8, 64, mx.bfloat16, 448),  # 16 steps; 7, fewer than the warps
    (8, 128, mx.float16, 1152), (8, 32, mx.bfloat16, 576),  # 18 and 9 steps: not a multiple of 8
    (4, 64, mx.bfloat16, 1408), (4, 32, mx.float16, 384), (4, 128, mx.bfloat16, 2048)])
def test_gives_the_dequantized_product(bits, group_size, dtype, k):
    q = layer(288, k, bits, group_size, dtype, seed=bits + group_size + k)  # 9 blocks of 32 features
    rng = np.random.default_rng(k)
    for rows in (2, 7, 8, 9, 17, 31, 40, 57, 64):  # tiles 1, 1, 1, 2, 3, 4, 5 (as 6), 8 (a short 8), 8
        check(q, mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype))


@cuda_only
@pytest.mark.parametrize("bits,group_size,dtype,k", [
    (8, 64, mx.bfloat16, 1024), (8, 128, mx.float16, 1152), (4, 32, mx.float16, 384), (4, 128, mx.bfloat16, 2048)])
def test_the_groups_a_warp_computes_change_no_bit(monkeypatch, bits, group_size, dtype, k):
    """Each output's products, and the order they are summed in, are the same however many groups
    of 16 features a warp computes, so the outputs are the same bits: a block's shape is tuned for
    speed alone."""
    q = layer(288, k, bits, group_size, dtype, seed=k)
    rng = np.random.default_rng(bits)
    xs = [mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype) for rows in (3, 17, 40, 64)]
    tuned = [narrow_qmm.linear(q, x) for x in xs]
    monkeypatch.setattr(narrow_qmm, "FEATURE_GROUPS", 1)
    monkeypatch.setattr(narrow_qmm, "TILE_N", 16)
    for x, y in zip(xs, tuned):
        assert mx.array_equal(narrow_qmm.linear(q, x), y).item(), x.shape


@cuda_only
def test_batched_input_and_bias():
    q = layer(128, 512, 8, 64, bias=True, seed=3)
    check(q, mx.array(np.random.default_rng(3).standard_normal((3, 5, 512)).astype(np.float32)).astype(mx.bfloat16))


def test_takes_only_layouts_it_reads():
    q8 = layer(64, 512, 8, 64)
    x = mx.zeros((4, 512), dtype=mx.bfloat16)
    assert narrow_qmm.fits(q8, x)
    assert not narrow_qmm.fits(q8, x[:1])  # one row: MLX's matrix-vector kernel
    assert not narrow_qmm.fits(q8, mx.zeros((narrow_qmm.MAX_ROWS + 1, 512), dtype=mx.bfloat16))
    assert not narrow_qmm.fits(q8, x.astype(mx.float32))  # activations not in the scales' dtype
    assert not narrow_qmm.fits(layer(64, 512, 8, 64, dtype=mx.float16), x)
    assert not narrow_qmm.fits(layer(48, 512, 8, 64), x)  # features not a multiple of a block's 32
    assert not narrow_qmm.fits(layer(64, 448, 4, 64), mx.zeros((4, 448), dtype=mx.bfloat16))  # 4-bit: k by 128
    assert narrow_qmm.fits(layer(64, 448, 8, 64), mx.zeros((4, 448), dtype=mx.bfloat16))  # 8-bit: k by 64
    assert not narrow_qmm.fits(layer(64, 512, 3, 64), x)


def test_only_engine_forwards_of_few_rows_take_it(monkeypatch):
    monkeypatch.setattr(quantized_route, "on_cuda", lambda: True)  # the route as MLX CUDA sets it up
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "2-8")
    taken = []
    monkeypatch.setattr(narrow_qmm, "linear", lambda layer, x: taken.append(x.shape) or quantized_route._original(layer, x))
    assert quantized_route.install()
    q = layer(64, 512, 8, 64)
    q(mx.zeros((4, 512), dtype=mx.bfloat16))  # not inside an engine forward: mlx-lm's own loop
    assert taken == []
    with quantized_route.engine_forward():
        for rows in (1, 2, 8, 9):
            q(mx.zeros((rows, 512), dtype=mx.bfloat16))
    assert taken == [(2, 512), (8, 512)]
    assert quantized_route.measurement_key()["narrow_qmm_rows"] == "2-8"


def test_on_mlx_cuda_from_where_it_was_measured_faster(monkeypatch):
    monkeypatch.setattr(quantized_route, "on_cuda", lambda: True)
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    assert quantized_route.install() and quantized_route.narrow_rows == (narrow_qmm.FASTER_FROM, narrow_qmm.MAX_ROWS)
    assert quantized_route.measurement_key()["narrow_qmm_rows"] == "4-64"
    assert quantized_route.measurement_key()["narrow_qmm_version"] == narrow_qmm.VERSION  # a new kernel: curves again
    quantized_route.uninstall()
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "0")
    assert quantized_route.install() and quantized_route.narrow_rows == (0, 0)
    assert not any(k.startswith("narrow_qmm") for k in quantized_route.measurement_key())


def test_never_off_mlx_cuda(monkeypatch):
    monkeypatch.setattr(quantized_route, "on_cuda", lambda: False)
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "2-8")
    assert quantized_route.install() and quantized_route.narrow_rows == (0, 0)
    assert not any(k.startswith("narrow_qmm") for k in quantized_route.measurement_key())
    assert quantized_route.build_for(nn.Sequential(layer(64, 512, 8, 64))) == 0


@pytest.mark.parametrize("value", ["-1", "1", "65", "x", "1.5", "8", "1-8", "4-65", "8-4", "4-", "\u00b2-4"])
def test_bad_rows_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", value)
    with pytest.raises(EngineError, match="MLX_DSPARK_NARROW_QMM_ROWS must be FIRST-LAST rows from 2 to 64"):
        quantized_route.install()


def test_a_models_instances_are_built_at_load(monkeypatch):
    """One layout's six tile counts, each once, however many layers share it; layers it can't
    read build nothing."""
    built = []
    monkeypatch.setattr(narrow_qmm, "linear", lambda layer, x: built.append((layer.bits, x.shape)) or mx.zeros((1,)))
    model = nn.Sequential(layer(64, 512, 8, 64), layer(128, 512, 8, 64), layer(64, 1024, 4, 64),
                          layer(60, 512, 8, 64), nn.Linear(512, 64))
    assert narrow_qmm.build_for(model) == 12
    assert sorted(built) == [(bits, (rows, k)) for bits, k in ((4, 1024), (8, 512)) for rows in (8, 16, 24, 32, 48, 64)]


def test_the_default_rows_are_where_the_profile_found_it_faster():
    """scripts/profile_verify_gpu.py's reading of an H100 run (narrow_qmm's docstring, the second
    of each, ms per forward by width) gives the default rows; a kernel that never wins gives none."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_verify_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_verify_gpu", path)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    widths = [1, 2, 4, 8, 16, 32, 64]
    mlx_ms = [9.2, 12.7, 21.3, 21.3, 21.3, 26.2, 30.4]
    narrow_ms = [None, 15.4, 15.6, 15.6, 15.6, 18.8, 22.6]
    assert profile.narrow_wins(widths, mlx_ms, narrow_ms) == (narrow_qmm.FASTER_FROM, narrow_qmm.MAX_ROWS)
    assert profile.narrow_wins(widths, mlx_ms, narrow_ms[:5] + [30.0, 40.0]) == (4, 16)  # the first run only
    assert profile.narrow_wins(widths, mlx_ms, [None] + [50.0] * 6) is None
