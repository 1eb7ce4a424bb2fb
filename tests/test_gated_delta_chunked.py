"""The chunked Gated DeltaNet (engine/kernels/gated_delta_chunked.py) against mlx-lm's step loop."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from engine.caches.state_capture import recording
from engine.kernels import gated_delta_chunked
from engine.kernels.gated_delta_chunked import chunked_gated_delta

step_loop = getattr(gated_delta.gated_delta_ops, "__wrapped__", gated_delta.gated_delta_ops)
while hasattr(step_loop, "__wrapped__"):
    step_loop = step_loop.__wrapped__


def inputs(T, Hk=2, Hv=4, Dk=32, Dv=16, B=1, strong_decay=False, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5  # as normalize_qk leaves them
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv)) * (6.0 if strong_decay else 1.0)
    g = gated_delta.compute_g(mx.random.normal((Hv,)) * 0.5, a, mx.zeros((Hv,)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [2, 3, 16, 63, 64, 65, 200])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_equals_step_loop(T, strong_decay):
    args = inputs(T, B=2, strong_decay=strong_decay, seed=T)
    y0, s0 = step_loop(*args)
    y1, s1 = chunked_gated_delta(*args)
    assert y1.shape == y0.shape and s1.shape == s0.shape
    assert not mx.isnan(y1).any() and not mx.isnan(s1).any()
    assert mx.allclose(y1, y0, rtol=1e-4, atol=1e-5), float(mx.abs(y1 - y0).max())
    assert mx.allclose(s1, s0, rtol=1e-4, atol=1e-5), float(mx.abs(s1 - s0).max())


def test_chunks_chain_like_one_pass():
    """Splitting a sequence at any point and carrying the state gives the same outputs."""
    q, k, v, g, beta, state = inputs(150)
    y, s = chunked_gated_delta(q, k, v, g, beta, state)
    ya, sa = chunked_gated_delta(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    yb, sb = chunked_gated_delta(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], sa)
    assert mx.allclose(mx.concatenate([ya, yb], axis=1), y, atol=1e-5)
    assert mx.allclose(sb, s, atol=1e-5)


@pytest.mark.parametrize("T,chunk", [(11, 64), (150, 64), (40, 16)])
def test_state_after_any_position_equals_the_step_loop(T, chunk):
    """The closed-form state after j positions (a verify pass's capture) is the step loop's state
    after those j, inside a chunk, on a chunk's last position and past it; after T, the last."""
    q, k, v, g, beta, state = inputs(T, B=2, seed=T)
    y, last, state_after = gated_delta_chunked.chunked_gated_delta_states(q, k, v, g, beta, state, chunk)
    assert state_after(T) is last
    for j in sorted({1, 2, chunk - 1, chunk, chunk + 1, T // 2, T - 1} & set(range(1, T))):
        _, s_j = step_loop(q[:, :j], k[:, :j], v[:, :j], g[:, :j], beta[:, :j], state)
        got = state_after(j)
        assert got.shape == s_j.shape
        assert mx.allclose(got, s_j, rtol=1e-4, atol=1e-5), (j, float(mx.abs(got - s_j).max()))


def test_routing_keeps_decode_steps_and_masks_on_mlx_lm():
    calls = []

    def original(q, k, v, g, beta, state=None, mask=None):
        calls.append(q.shape[1])
        return step_loop(q, k, v, g, beta, state, mask)

    routed = gated_delta_chunked._routed(original)
    q, k, v, g, beta, state = inputs(8)
    routed(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)  # a decode step
    routed(q, k, v, g, beta, state, mx.ones((1, 8), dtype=mx.bool_))  # a padding mask
    routed(q, k, v, mx.repeat(g[..., None], 32, -1), beta, state)  # per-key gates (kimi)
    assert calls == [1, 8, 8]
    routed(q, k, v, g, beta, state)  # many positions, scalar gates: chunked
    assert calls == [1, 8, 8]
    with recording() as tape:  # a verify pass whose states are recorded: chunked, the states on demand
        _, last = routed(q, k, v, g, beta, state)
    assert calls == [1, 8, 8] and tape.per_position_bytes == 0
    [(kept_last, positions, state_after)] = tape.states.values()
    assert kept_last is last and positions == 8
    assert mx.allclose(state_after(3), step_loop(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)[1],
                       rtol=1e-4, atol=1e-5)
