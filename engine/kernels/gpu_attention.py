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
first time, so keys are padded with masked zeros to a multiple of KEY_BLOCK: 256 made a refactor's
verify rounds 29-30 ms instead of 31-33 on an H100 (8B yardstick); 2048 made `benchmark`'s edit
1.3-1.4x faster there again (1445-1600 tok/s against 1886-2018, with verify widths as drafted or
in steps of 8 alike; docs/benchmarks.md). Up to 2047 masked keys more cost little: at a verify
width the scores are a few MB, and the forward's time goes to reading the weights.

A short prefill chunk (an agent's warm turn adds ~80-500 tokens, past MAX_WIDTH) stays with cuDNN,
whose attention beats the plain ops there, but its shape, (new tokens, depth), is new every turn,
and cuDNN's build of it (51-64 ms on an H100, against 0.3-0.5 ms for the attention itself) was a
fifth to a third of such a turn. So a chunk of up to BUCKET_QUERIES[-1] queries runs in a bucket:
its queries padded to the next of BUCKET_QUERIES, its keys and values with masked zeros to a
multiple of BUCKET_KEYS, the causal mask an additive array, only the real rows kept; `build_for`
builds every bucket's graph up to the context window when a long-lived engine (serve, mcp)
starts (48 graphs in 3.7 s for a 65,536-token window on an H100). A bucket's attention costs
about twice the chunk's own (0.7-1.2 ms a layer at 111-300 queries over 15-22k keys), ~15 ms a
forward of 36 layers: less than the build it saves on every turn (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from engine.base.platform import on_cuda, whole_number_setting
from engine.kernels.cpu_attention import MAX_WIDTH

_original = None


def _key_block() -> int:
    """Keys are padded (masked) to a multiple of this; 1: as they come (the module says why)."""
    return whole_number_setting("MLX_DSPARK_GPU_ATTENTION_KEY_BLOCK", 2048, "no padding")


KEY_BLOCK = _key_block()
BUCKET_QUERIES = (128, 256, 512)  # a short prefill chunk's queries are padded to the first that holds them
BUCKET_KEYS = 4096  # ...and its keys to a multiple of this
# `build_for` builds no deeper than this: 3 graphs per 4,096 keys, of the 256 that MLX keeps per
# thread (MLX_CUDA_SDPA_CACHE_SIZE); a turn past it builds its own graph, as before
BUILD_KEYS = 131072


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


def bucketed(queries: mx.array, keys: mx.array, values: mx.array, scale: float, sdpa) -> mx.array:
    """`sdpa` (MLX's fused attention) of a causal prefill chunk at a bucket's shape: queries padded
    to the first of BUCKET_QUERIES that holds them, keys and values with zeros to a multiple of
    BUCKET_KEYS, those masked out. The real rows see what the bottom-right causal mask lets them
    see; a padded row sees every real key (no row is wholly masked), and is dropped."""
    L, S = queries.shape[2], keys.shape[2]
    rows = next(b for b in BUCKET_QUERIES if b >= L)
    cols = -(-S // BUCKET_KEYS) * BUCKET_KEYS
    pad = lambda a, n: mx.pad(a, [(0, 0), (0, 0), (0, n - a.shape[2]), (0, 0)])  # noqa: E731
    mask = _causal_bias(L, S, rows, cols, queries.dtype)
    return sdpa(pad(queries, rows), pad(keys, cols), pad(values, cols), scale=scale, mask=mask)[:, :, :L, :]


@functools.lru_cache(maxsize=1)
def _causal_bias(L: int, S: int, rows: int, cols: int, dtype) -> mx.array:
    """The bucket's mask, additive in the queries' dtype (a boolean one MLX would widen to every
    head, per layer), (rows, cols): MLX broadcasts it over batch and heads without a copy. One
    forward's layers share it."""
    col = mx.arange(cols)
    visible = (col[None, :] <= mx.arange(S - L, S - L + rows)[:, None]) & (col < S)[None, :]
    return mx.where(visible, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def takes_bucketed(queries, keys, mask, sinks) -> bool:
    """A causal prefill chunk wider than a verify forward and at most the widest bucket, half
    precision, heads cuDNN takes, no sinks: cuDNN's, at a bucket's shape (a shape MLX would run
    unfused gains nothing from its padding)."""
    if sinks is not None or not isinstance(mask, str) or mask != "causal" or queries.ndim != 4 or keys.ndim != 4:
        return False
    return (queries.dtype in (mx.bfloat16, mx.float16) and MAX_WIDTH < queries.shape[2] <= BUCKET_QUERIES[-1]
            and cudnn_head(queries.shape[-1]))


def cudnn_head(dim: int) -> bool:
    """A head size cuDNN's attention takes (MLX's `supports_sdpa_cudnn`): a multiple of 8, at most 128."""
    return dim % 8 == 0 and dim <= 128


def build_for(model, context_window: int, dtype) -> int:
    """Build cuDNN's graph of every bucket up to `context_window` keys (at most BUILD_KEYS) for
    `model`'s attention layers (those with n_heads, n_kv_heads and a k_proj, of a head size cuDNN
    takes), now, on the calling thread: MLX keeps cuDNN's graphs per thread, and the engine's
    forwards run on the thread that loads the model. Returns how many were built (0 where the
    routing isn't installed)."""
    if _original is None or dtype not in (mx.bfloat16, mx.float16):
        return 0
    shapes = set()
    for _, layer in model.named_modules():
        heads, kv_heads, k_proj = (getattr(layer, a, None) for a in ("n_heads", "n_kv_heads", "k_proj"))
        if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads and k_proj is not None:
            dim = k_proj.weight.shape[0] // kv_heads
            if cudnn_head(dim):
                shapes.add((heads, kv_heads, dim))
    deepest = -(-min(context_window, BUILD_KEYS) // BUCKET_KEYS) * BUCKET_KEYS
    built = 0
    for heads, kv_heads, dim in shapes:
        for cols in range(BUCKET_KEYS, deepest + 1, BUCKET_KEYS):
            kv = mx.zeros((1, kv_heads, cols, dim), dtype)
            for rows in BUCKET_QUERIES:
                mx.eval(bucketed(mx.zeros((1, heads, rows, dim), dtype), kv, kv, dim ** -0.5, _original))
                built += 1
    _causal_bias.cache_clear()  # the deepest bucket's mask, which no turn may need
    return built


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
    if not args and not kwargs and scale is not None:
        if takes(queries, keys, mask, sinks):
            return attention(queries, keys, values, scale, mask)
        if takes_bucketed(queries, keys, mask, sinks):
            return bucketed(queries, keys, values, scale, _original)
    return _original(queries, keys, values, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)


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
