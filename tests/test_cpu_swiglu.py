"""SwiGLU in the compiled kernel: equal to mlx-lm's to float32 rounding, routed only for the
engine's forwards (prefill chunks, anything on its thread) in float32 on the CPU, installed for a
loaded qwen3 (a tiny random model)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from engine import load_target
from engine.kernels import cpu_attention
from engine.kernels import cpu_swiglu


@pytest.fixture(autouse=True)
def kernel():
    if cpu_swiglu._swiglu_kernel() is None:
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("shape", [(1, 100, 64), (1, 1024, 1000), (2, 77, 13)])
def test_kernel_equals_mlx_lm(shape):
    rng = np.random.default_rng(sum(shape))
    gate = rng.standard_normal(shape, dtype=np.float32) * 8
    gate.flat[:6] = [-120, -89, -30, 30, 89, 120]  # exp's clamps, both ways
    x = rng.standard_normal(shape, dtype=np.float32)
    ref = np.array(activations.swiglu(mx.array(gate), mx.array(x)))
    for threads in (1, 2):
        np.testing.assert_allclose(cpu_swiglu.swiglu(gate, x, threads=threads), ref, rtol=2e-6, atol=1e-6)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The shapes the compiled kernel is called with."""
    calls, real = [], cpu_swiglu.swiglu
    monkeypatch.setattr(cpu_swiglu, "swiglu", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def test_routing_takes_only_prefill_chunks(tiny_model_dir, kernel_calls):
    target = load_target(tiny_model_dir)
    module = importlib.import_module(type(target.model).__module__)
    assert module.swiglu is cpu_swiglu._routed
    rng = np.random.default_rng(0)
    g, x = (mx.array(rng.standard_normal((1, 80, 32), dtype=np.float32)) for _ in range(2))
    ref = np.array(activations.swiglu(g, x))
    mx.eval(module.swiglu(g, x))  # outside a prefill chunk (training, tests): MLX's
    assert kernel_calls == []
    with cpu_attention.last_call_unread(None):  # what verify.prefill opens
        np.testing.assert_allclose(np.array(module.swiglu(g, x)), ref, rtol=2e-6, atol=1e-6)
    assert kernel_calls == [(1, 80, 32)]
    # under autodiff the gradient flows through mlx-lm's own swiglu
    grad = mx.grad(lambda a: module.swiglu(a, x).sum())(g)
    assert mx.allclose(grad, mx.grad(lambda a: activations.swiglu(a, x).sum())(g))
    with cpu_attention.last_call_unread(None):
        mx.eval(module.swiglu(g[:, :64], x[:, :64]))  # a verify-sized pass: MLX's
        mx.eval(module.swiglu(g.astype(mx.bfloat16), x.astype(mx.bfloat16)))  # another dtype
        with cpu_attention.disabled():
            mx.eval(module.swiglu(g, x))
        mx.eval(mx.compile(module.swiglu)(g, x))  # a traced graph
    assert kernel_calls == [(1, 80, 32)]


def test_routing_takes_every_forward_on_the_engine_thread(tiny_model_dir, kernel_calls):
    target = load_target(tiny_model_dir)
    module = importlib.import_module(type(target.model).__module__)
    rng = np.random.default_rng(0)
    g, x = (mx.array(rng.standard_normal((4, 17, 32), dtype=np.float32)) for _ in range(2))
    ref = np.array(activations.swiglu(g, x))
    with cpu_attention.engine_thread():  # a batched verify forward, one row's
        np.testing.assert_allclose(np.array(module.swiglu(g, x)), ref, rtol=2e-6, atol=1e-6)
        mx.eval(module.swiglu(g[:1, :8], x[:1, :8]))
        mx.eval(module.swiglu(g[:1, :1], x[:1, :1]))  # a decode step (fewer than MIN_TOKENS): MLX's
        mx.eval(module.swiglu(g.astype(mx.bfloat16), x.astype(mx.bfloat16)))  # another dtype: MLX's
    assert kernel_calls == [(4, 17, 32), (1, 8, 32)]
    mx.eval(module.swiglu(g, x))  # off the engine thread: MLX's
    assert kernel_calls == [(4, 17, 32), (1, 8, 32)]
