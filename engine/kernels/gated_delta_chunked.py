"""Gated DeltaNet over many positions at once: the chunked form, for CPU and CUDA.

mlx-lm runs the gated delta rule one position at a time wherever its Metal kernel is not
available (`gated_delta_ops`: a compiled step per token and layer). On a CPU that makes a
1.7k-token prompt take 30 s on a 12M hybrid, and a verify pass of width k cost k steps, so a
draft buys nothing. The same recurrence over a chunk of C positions is a few matrix products
(the "WY" form of DeltaNet, Yang et al. 2024, as in FLA and transformers' torch fallback):

    S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,   y_t = S_t q_t

Within a chunk, with G_t the cumulative log decay and D[i, j] = exp(G_i - G_j) (j <= i):

    W   = (I + strict_lower(diag(b) K K^T * D))^-1          (by doubling: log2 C products)
    U   = W diag(b) V,    Wk = W diag(b exp(G)) K
    V'  = U - Wk S^T                                        (values net of what S predicts)
    Y   = diag(exp(G)) Q S^T + lower(Q K^T * D) V'
    S'  = exp(G_C) S + V'^T diag(exp(G_C - G)) K

Only scalar gates (one decay per head: qwen3_next, qwen3_5, olmo_hybrid) without a padding
mask take this path; everything else, and single positions (decoding), stay on mlx-lm's own
function. The result equals the step loop's to float32 rounding, like `cpu_attention`.

A verify pass whose states are recorded (engine/caches/state_capture.py) takes this path too:
the state after the first p positions of a chunk follows from what the chunk computed anyway,
W being lower triangular (the first p rows of V' are those a chunk of p positions would give):

    S_p = exp(G_p) S + V'[:p]^T diag(exp(G_p - G[:p])) K[:p]

built only for the position a rollback asks for, where stepping one position at a time kept a
state per position and ran a compiled step per position and layer (the hybrid yardstick's
~37-token rounds on an H100: 215 ms against 16 ms for a step, docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from engine.base.forward_context import forward_context, get_context

CHUNK = 64
# Fewer positions than this run mlx-lm's step loop: a decode step, and verify passes too
# narrow for the chunk's fixed cost to pay off.
MIN_POSITIONS = 2


def chunked_gated_delta(q, k, v, g, beta, state=None, mask=None, chunk: int = CHUNK):
    """Same contract as mlx-lm's `gated_delta_ops` (scalar gates, no mask).

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] (decay factors in (0, 1]);
    beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]. Returns y [B, T, Hv, Dv] and the new state.
    """
    y, last, _ = chunked_gated_delta_states(q, k, v, g, beta, state, chunk)
    return y, last


def chunked_gated_delta_states(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """`chunked_gated_delta`'s y and last state, and `state_after(j)`: the state after the first
    j (1..T) positions, in the layout of the last, computed when called."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    C = T if T <= chunk else chunk
    n = -(-T // C)
    pad = n * C - T

    def heads_first(x):  # [B, T, H, ...] -> [B, H, n, C, ...] in float32, zero-padded
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = mx.moveaxis(x, 2, 1)
        return x.reshape(x.shape[:2] + (n, C) + x.shape[3:])

    # padded positions: k = 0 and b = 0 change nothing, log decay 0 keeps the state
    q, k, v, b = heads_first(q), heads_first(k), heads_first(v), heads_first(beta)
    log_g = heads_first(mx.log(mx.maximum(g.astype(mx.float32), 1e-30)))
    G = mx.cumsum(log_g, axis=-1)  # [B, H, n, C]

    rows = mx.arange(C)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    diff = G[..., :, None] - G[..., None, :]
    D = mx.exp(mx.where(lower, diff, -math.inf))  # exp(G_i - G_j) on and below the diagonal

    kb = k * b[..., None]
    L = mx.where(strict, (kb @ mx.swapaxes(k, -1, -2)) * D, 0.0)
    W = _unit_lower_inverse(L, C)
    U = W @ (v * b[..., None])
    Wk = W @ (kb * mx.exp(G)[..., None])
    QK = mx.where(lower, (q @ mx.swapaxes(k, -1, -2)) * D, 0.0)
    q_decayed = q * mx.exp(G)[..., None]
    k_to_end = k * mx.exp(G[..., -1:] - G)[..., None]
    end_decay = mx.exp(G[..., -1])  # [B, H, n]

    S = mx.swapaxes(state.astype(mx.float32), -1, -2)  # [B, H, Dk, Dv]
    ys, starts, v_news = [], [], []
    for i in range(n):
        v_new = U[:, :, i] - Wk[:, :, i] @ S
        ys.append(q_decayed[:, :, i] @ S + QK[:, :, i] @ v_new)
        starts.append(S)
        v_news.append(v_new)
        S = S * end_decay[:, :, i, None, None] + mx.swapaxes(k_to_end[:, :, i], -1, -2) @ v_new
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * C, Dv)[:, :, :T]
    last = mx.swapaxes(S, -1, -2)

    def state_after(j: int) -> mx.array:
        if j == T:
            return last
        i, p = (j - 1) // C, (j - 1) % C + 1  # p positions into chunk i
        Gi = G[:, :, i]
        k_to_p = k[:, :, i, :p] * mx.exp(Gi[..., p - 1 : p] - Gi[..., :p])[..., None]
        S_p = starts[i] * mx.exp(Gi[..., p - 1])[..., None, None] + mx.swapaxes(k_to_p, -1, -2) @ v_news[i][:, :, :p]
        return mx.swapaxes(S_p, -1, -2)

    return mx.moveaxis(y, 1, 2).astype(out_dtype), last, state_after


def _unit_lower_inverse(L, C: int):
    """(I + L)^-1 for strictly lower L: (I - L)(I + L^2)(I + L^4)... (L is nilpotent)."""
    eye = mx.eye(C, dtype=L.dtype)
    N = -L
    W = eye + N
    P = N
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        P = P @ P
        W = W + W @ P
    return W


def _routed(original):

    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
        context = get_context()
        if mask is None and g.ndim == 3 and q.shape[1] >= MIN_POSITIONS and not context.chunked_delta_off:
            if context.tape is None:
                return chunked_gated_delta(q, k, v, g, beta, state)
            # a verify pass whose states are recorded: the state after any position on demand
            y, last, state_after = chunked_gated_delta_states(q, k, v, g, beta, state)
            context.tape.add_states(last, q.shape[1], state_after)
            return y, last
        return original(q, k, v, g, beta, state, mask)

    gated_delta_ops.__wrapped__ = original
    gated_delta_ops.chunked_router = True
    return gated_delta_ops


def disabled():
    """mlx-lm's own step loop inside this block (on this thread): bit-level references."""
    return forward_context(chunked_delta_off=True)


def install() -> None:
    """Route mlx-lm's step-loop Gated DeltaNet through the chunked form (idempotent).

    `gated_delta_update` looks `gated_delta_ops` up in its module at each call, so every
    family that uses it goes through here; state capture's wrapper sits beneath. MLX_DSPARK_CHUNKED_DELTA=0 turns it off.
    """
    if os.environ.get("MLX_DSPARK_CHUNKED_DELTA", "1") == "0":
        return
    try:
        from mlx_lm.models import gated_delta
    except ImportError:  # an mlx-lm without hybrid models
        return
    if not getattr(gated_delta.gated_delta_ops, "chunked_router", False):
        gated_delta.gated_delta_ops = _routed(gated_delta.gated_delta_ops)
