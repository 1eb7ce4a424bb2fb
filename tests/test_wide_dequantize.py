"""The engine's wide forwards through dequantized weights (engine/kernels/wide_dequantize.py, taken
through engine/kernels/quantized_route.py), checked on any device: the same values as the quantized
kernel, taken only by the engine's forwards (Target's, not mlx-lm's own loop over the same model) of
`min_rows` rows or more, and a prefill through it filling the cache the quantized kernels fill. On
MLX CUDA it is on by default; here the tests turn it on with MLX_DSPARK_WIDE_DEQUANTIZE=1."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.base.platform import on_cuda
from engine.decoding.verify import prefill
from engine.kernels import quantized_route, wide_dequantize
from engine.model.target import load_target
from test_quantized import quantise
from tiny_models import build_tiny_model


pytestmark = pytest.mark.usefixtures("route_as_found")  # tests/conftest.py: the route off, variables unset


@pytest.fixture
def routed(monkeypatch):
    """wide_dequantize installed, with a count of the forwards it took."""
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    taken = []
    real = wide_dequantize.linear
    monkeypatch.setattr(wide_dequantize, "linear", lambda layer, x: taken.append(x.shape) or real(layer, x))
    assert quantized_route.install()
    yield taken


@pytest.mark.parametrize("bits,mode", [(4, "affine"), (8, "affine"), (4, "mxfp4")])
def test_dequantized_weights_give_the_quantized_kernels_values(bits, mode):
    mx.random.seed(bits)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 96, bias=mode == "affine"), group_size=32, bits=bits,
                                           mode=mode)
    x = mx.random.normal((2, 300, 256))
    want = layer(x)
    got = wide_dequantize.linear(layer, x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_only_wide_engine_forwards_take_it(routed):
    layer = nn.QuantizedLinear(64, 32, bits=8)
    rows = quantized_route.wide_rows()
    layer(mx.zeros((1, rows, 64)))  # not the engine's: mlx-lm's own loop
    assert routed == []
    with quantized_route.engine_forward():
        layer(mx.zeros((1, rows - 1, 64)))  # a short last chunk: quantized kernels
        assert routed == []
        layer(mx.zeros((1, rows, 64)))
        layer(mx.zeros((2, rows // 2, 64)))  # rows over the batch count too
        other = threading.Thread(target=lambda: layer(mx.zeros((1, rows, 64))))  # another thread's forwards
        other.start()
        other.join()
    assert routed == [(1, rows, 64), (2, rows // 2, 64)]
    layer(mx.zeros((1, rows, 64)))
    assert len(routed) == 2


def test_off_unless_on_cuda_or_asked(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "0")
    assert not quantized_route.wanted() and quantized_route.install() is False
    assert nn.QuantizedLinear.__call__ is not quantized_route._routed
    monkeypatch.delenv("MLX_DSPARK_WIDE_DEQUANTIZE")
    assert quantized_route.wanted() == on_cuda()


def test_a_prefill_through_it_fills_the_same_cache(tmp_path, monkeypatch, routed):
    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", "0")  # keep the quantized layers on this CPU
    path = quantise(build_tiny_model(tmp_path / "float"), tmp_path / "q8", bits=8)
    target = load_target(path)
    rows = quantized_route.wide_rows()
    tokens = np.random.default_rng(0).integers(0, target.vocab_size, size=2 * rows + 40).tolist()

    def filled():
        cache = target.make_cache()
        prefill(target, cache, tokens, chunk_size=rows)
        logits = target.forward(tokens[-1:], cache)
        mx.eval(logits)
        return [np.array(a) for c in cache for a in c.state], np.array(logits)

    wide_states, wide_logits = filled()
    assert len(routed) > 0  # the two full chunks went through it, the last 40 tokens did not
    quantized_route.uninstall()
    states, logits = filled()
    for a, b in zip(wide_states, states):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(wide_logits, logits, rtol=1e-4, atol=1e-4)


def test_rows_from_the_variable(tmp_path, monkeypatch, routed):
    """A verify pass of `min_rows` tokens through Target takes it, a narrower one and mlx-lm's
    own call on the same model do not; batched forwards count rows over the batch."""
    quantized_route.uninstall()
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", "8")
    assert quantized_route.install() and quantized_route.wide_rows() == 8
    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", "0")
    target = load_target(quantise(build_tiny_model(tmp_path / "float"), tmp_path / "q8", bits=8))
    layers = sum(isinstance(m, nn.QuantizedLinear) for _, m in target.model.named_modules())
    cache = target.make_cache()
    mx.eval(target.forward(list(range(7)), cache))
    assert routed == []
    mx.eval(target.forward(list(range(8)), cache))
    assert len(routed) == layers and routed[0][-2] == 8
    routed.clear()
    mx.eval(target.model(mx.array([list(range(8))]), cache=target.make_cache()))  # mlx-lm's own call
    assert routed == []
    caches = target.make_cache()
    mx.eval(target.forward_batch(mx.zeros((2, 4), dtype=mx.uint32), caches))  # 2 rows of 4: 8 in all
    assert len(routed) == layers


def test_bad_rows_variable_is_a_clear_error(monkeypatch):
    from engine.base.errors import EngineError

    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    for bad in ("many", "\u00b2", "0", "-3"):
        monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", bad)
        with pytest.raises(EngineError, match="MLX_DSPARK_WIDE_DEQUANTIZE_ROWS must be a whole number"):
            quantized_route.install()
        assert quantized_route.wide_rows() is None


def test_cost_curves_are_kept_apart_by_the_route(tmp_path, monkeypatch):
    """A cost curve or prefill chunk measured with wide forwards dequantized is not reused without
    them, or at another width."""
    from engine.tuning.cost_curve import curve_key
    from engine.tuning.prefill_chunk import chunk_key

    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", "0")
    target = load_target(quantise(build_tiny_model(tmp_path / "float"), tmp_path / "q8", bits=8))
    quantized_route.uninstall()
    plain = curve_key(target)
    plain_chunk = chunk_key(target)
    assert "wide_dequantize_rows" not in plain and "wide_dequantize_rows" not in plain_chunk
    monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE", "1")
    for rows in ("16", "64"):
        monkeypatch.setenv("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", rows)
        quantized_route.install()
        assert curve_key(target) == {**plain, "wide_dequantize_rows": int(rows)}
        assert chunk_key(target) == {**plain_chunk, "wide_dequantize_rows": int(rows)}
        quantized_route.uninstall()
