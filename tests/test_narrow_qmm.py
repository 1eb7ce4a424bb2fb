"""The quantised layer over a few rows on tensor cores (engine/kernels/narrow_qmm.py).

Where MLX CUDA runs: the kernel gives MLX's quantized matmul's values (to bf16/fp16 rounding) for every
layout it takes, at every row count from 2 to MAX_ROWS. Anywhere: which layers and widths it takes,
that only the engine's forwards take it, and the variable that bounds it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.base.errors import EngineError
from engine.base.platform import on_cuda
from engine.kernels import narrow_qmm, quantized_route
from test_wide_dequantize import route_as_found  # noqa: F401  (autouse: each test starts with the route off)

cuda_only = pytest.mark.skipif(not on_cuda(), reason="the kernel runs on MLX CUDA")


def layer(n: int, k: int, bits: int, group_size: int, dtype=mx.bfloat16, bias: bool = False, seed: int = 0):
    mx.random.seed(seed)
    q = nn.QuantizedLinear.from_linear(nn.Linear(k, n, bias=bias), group_size=group_size, bits=bits)
    q.set_dtype(dtype)  # scales and biases in the activations' dtype, as a converted checkpoint has them
    return q


@cuda_only
@pytest.mark.parametrize("bits,group_size,dtype", [(8, 64, mx.bfloat16), (4, 64, mx.bfloat16), (8, 128, mx.float16),
                                                   (4, 32, mx.float16), (8, 32, mx.bfloat16), (4, 128, mx.bfloat16)])
def test_gives_mlx_quantized_matmul_values(bits, group_size, dtype):
    q = layer(272, 1024, bits, group_size, dtype, seed=bits + group_size)
    for rows in (2, 7, 8, 9, 31, 64):
        x = mx.random.normal((rows, 1024)).astype(dtype)
        assert narrow_qmm.fits(q, x)
        want = np.array(q(x).astype(mx.float32))
        got = narrow_qmm.linear(q, x)
        assert got.shape == (rows, 272) and got.dtype == dtype
        err = np.abs(np.array(got.astype(mx.float32)) - want).max() / np.abs(want).max()
        assert err < 2e-2, (rows, err)  # both round to 8 mantissa bits (bf16); sums in another order


@cuda_only
def test_batched_input_and_bias():
    q = layer(128, 512, 8, 64, bias=True, seed=3)
    x = mx.random.normal((3, 5, 512)).astype(mx.bfloat16)
    want = np.array(q(x).astype(mx.float32))
    got = np.array(narrow_qmm.linear(q, x).astype(mx.float32))
    assert got.shape == want.shape
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2


def test_takes_only_layouts_it_reads():
    q8 = layer(64, 512, 8, 64)
    x = mx.zeros((4, 512), dtype=mx.bfloat16)
    assert narrow_qmm.fits(q8, x)
    assert not narrow_qmm.fits(q8, x[:1])  # one row: MLX's matrix-vector kernel
    assert not narrow_qmm.fits(q8, mx.zeros((narrow_qmm.MAX_ROWS + 1, 512), dtype=mx.bfloat16))
    assert not narrow_qmm.fits(q8, x.astype(mx.float32))  # activations not in the scales' dtype
    assert not narrow_qmm.fits(layer(64, 512, 8, 64, dtype=mx.float16), x)
    assert not narrow_qmm.fits(layer(60, 512, 8, 64), x)  # features not a multiple of 16
    assert not narrow_qmm.fits(layer(64, 448, 4, 64), mx.zeros((4, 448), dtype=mx.bfloat16))  # 4-bit: k by 128
    assert narrow_qmm.fits(layer(64, 448, 8, 64), mx.zeros((4, 448), dtype=mx.bfloat16))  # 8-bit: k by 64
    assert not narrow_qmm.fits(layer(64, 512, 3, 64), x)


def test_only_engine_forwards_of_few_rows_take_it(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "8")
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
    assert quantized_route.measurement_key()["narrow_qmm_rows"] == 8


@pytest.mark.parametrize("value", ["-1", "65", "x", "1.5"])
def test_bad_rows_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", value)
    with pytest.raises(EngineError, match="MLX_DSPARK_NARROW_QMM_ROWS"):
        quantized_route.install()


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    assert quantized_route.install()
    assert "narrow_qmm_rows" not in quantized_route.measurement_key()
    quantized_route.uninstall()
    monkeypatch.setenv("MLX_DSPARK_NARROW_QMM_ROWS", "0")
    assert quantized_route.install() and "narrow_qmm_rows" not in quantized_route.measurement_key()
