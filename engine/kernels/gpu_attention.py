"""Verify-width attention on MLX CUDA in plain ops, so that no cuDNN graph is built per shape.

MLX CUDA hands a bf16/fp16 attention of several queries to cuDNN, which builds (and keeps, up
to 256) a graph for each exact shape of queries, keys and mask. A verify forward meets a new
shape every round (its depth grows by what was accepted, its width varies with the draft), and a
build costs more than the forward: on the H200, an 8B-shape verify round of ~26 tokens took
56 ms in the engine against 22 ms for the same forwards once their graphs existed
(scripts/verify_shapes_gpu.py). Here such a forward's attention (up to MAX_WIDTH queries a row)
is two matmuls and a softmax, its scores in float32, kernels MLX builds per dtype, not per shape; its scores
are a few MB at verify widths. Prefill chunks (wider) stay with cuDNN: their shapes repeat,
because chunks end at multiples of the chunk size (engine/model/vision.py `prefill_chunks`).
Decoding (one query) stays with MLX's vector kernel. `MLX_DSPARK_GPU_ATTENTION=0` turns it off.
Even so a round's depth is new every round, and the two matmuls cost more at a shape met for the
first time; keys padded with masked zeros to a multiple of KEY_BLOCK (256) made a refactor's
verify rounds 29-30 ms instead of 31-33 on an H100 (8B yardstick, docs/benchmarks.md).
"""

from __future__ import annotations

import os

import mlx.core as mx

from engine.base.platform import on_cuda
from engine.kernels.cpu_attention import MAX_WIDTH

_original = None


def _key_block() -> int:
    """Keys are padded (masked) to a multiple of this; 1: as they come (the module says why)."""
    raw = os.environ.get("MLX_DSPARK_GPU_ATTENTION_KEY_BLOCK", "256")
    if not raw.isdecimal() or int(raw) < 1:
        raise ValueError(f"MLX_DSPARK_GPU_ATTENTION_KEY_BLOCK takes a whole number >= 1 (1: no padding), not {raw!r}")
    return int(raw)


KEY_BLOCK = _key_block()


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """softmax(q k^T * scale + mask) v, the query heads that share a kv head in one matmul.
    `mask`: None, "causal" (bottom-right: the last query sees every key) or an array
    broadcastable to (batch, heads, queries, keys), boolean (True: may see) or additive."""
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    g = H // Hk
    if isinstance(mask, str):  # "causal"
        mask = mx.arange(S)[None, :] <= mx.arange(S - L, S)[:, None]
    padded = -(-S // KEY_BLOCK) * KEY_BLOCK
    if padded > S:  # zero keys and values past S, masked out
        if mask is None:
            mask = mx.arange(padded) < S
        else:
            fill = False if mask.dtype == mx.bool_ else mx.finfo(mask.dtype).min
            mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, padded - S)], constant_values=fill)
        keys = mx.pad(keys, [(0, 0), (0, 0), (0, padded - S), (0, 0)])
        values = mx.pad(values, [(0, 0), (0, 0), (0, padded - S), (0, 0)])
        S = padded
    # Scores in float32, as cuDNN keeps them: bf16 scores would round away the small logit
    # differences that decide a greedy pick, and differently for each shape of the matmul.
    q = (queries.astype(mx.float32) * scale).reshape(B, Hk, g * L, D)
    scores = (q @ mx.swapaxes(keys.astype(mx.float32), -1, -2)).reshape(B, Hk, g, L, S)
    if mask is not None:
        mask = _per_kv_head(mask, Hk, g)
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)  # as cuDNN multiplies them
    out = weights.reshape(B, Hk, g * L, S) @ values
    return out.reshape(B, H, L, values.shape[-1])


def _per_kv_head(mask: mx.array, kv_heads: int, group: int) -> mx.array:
    """A (.., heads or 1, L, S) mask in the scores' (B, kv heads, group, L, S) layout."""
    if mask.ndim < 4:
        return mask
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def takes(queries, keys, mask, sinks) -> bool:
    """A verify-width forward on a GPU that cuDNN would take with a graph of its own: several
    queries a row (up to MAX_WIDTH), half precision, no sinks. One or a few queries without an
    array mask go to MLX's vector kernel, which needs no graph."""
    if sinks is not None or queries.ndim != 4 or keys.ndim != 4 or queries.shape[1] % keys.shape[1]:
        return False
    if queries.dtype not in (mx.bfloat16, mx.float16):
        return False
    L = queries.shape[2]
    return 2 <= L <= MAX_WIDTH and (L >= 4 or isinstance(mask, mx.array))


def _routed(queries, keys, values, *args, scale=None, mask=None, sinks=None, **kwargs):
    if args or kwargs or scale is None or not takes(queries, keys, mask, sinks):
        return _original(queries, keys, values, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return attention(queries, keys, values, scale, mask)


def wanted() -> bool:
    """MLX CUDA (cuDNN's graphs are built per shape; Metal's kernels are not), unless turned off."""
    return on_cuda() and os.environ.get("MLX_DSPARK_GPU_ATTENTION") != "0"


def install() -> bool:
    """Route verify-width attention through `attention` where `wanted()` (idempotent)."""
    global _original
    if _original is None and wanted():
        _original = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _routed
    return _original is not None


def uninstall() -> None:
    global _original
    if _original is not None:
        mx.fast.scaled_dot_product_attention = _original
        _original = None
