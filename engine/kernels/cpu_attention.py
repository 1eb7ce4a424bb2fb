"""Prefill attention on CPU at BLAS speed: query blocks x key blocks, online softmax.

MLX's CPU `scaled_dot_product_attention` builds the whole score matrix of a prefill
chunk (a 2048-token chunk at 30k tokens of depth is 1.5 GB per layer) and runs the
softmax on one core; at long depth it is an order of magnitude slower than its FLOPs.
Here each (query block, key block) pair is one BLAS matmul into a score tile of a
few hundred KB, the softmax is carried online (running max and sum, flash-attention
style), key blocks past the causal diagonal are skipped, and one thread per core
takes (batch, kv head, query block) items. An item's tile loop runs in C
(`cpu_kernels.c`: numpy's own OpenBLAS sgemm for the two matmuls, the softmax step in
two passes with a vectorised exp, no GIL held); where that can't be compiled, numpy's
matmuls and ufuncs do the same steps (they release the GIL too).

`install()` routes `mx.fast.scaled_dot_product_attention` here, which every mlx-lm
family reaches (directly or through `mlx_lm.models.base.scaled_dot_product_attention`,
which looks it up at call time), so no model file is forked. Only what this computes
exactly is taken: the CPU device, float32, no sinks, and either
- a prefill chunk (wider than any verify pass) over at least the measured crossover's keys
  (`attention_tune.py`), no mask or the bottom-right "causal" one; or
- on the engine's thread (`engine_thread`), a decode or verify forward (as narrow as a verify
  pass), no mask, "causal", or an array mask that is causal with its own offset per batch row
  (a batched verify forward's, engine/caches/batch_cache.py). MLX's CPU exp costs about 25 ns an
  element here (numpy's: under 1), so its softmax, not the matmuls, was most of the attention
  of a verify forward: 4.5 ms a layer for 4 rows of 17 tokens over 300 keys.
Anything else (sliding windows and other array masks, sinks, other dtypes, a graph being
compiled, a forward off the engine thread) goes to MLX's own kernel.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.base.forward_context import forward_context, get_context
from engine.kernels import native

MAX_WIDTH = 64  # the widest verify forward `--max-draft auto` makes (engine/tuning/cost_curve.py measures up to it)

QUERY_ROWS = 256  # rows of a score tile (query positions x heads sharing a kv head)
KEY_BLOCK = 512  # columns of a score tile: 256 x 512 float32 = 512 KB per thread
SPLIT_WORK = 1 << 24  # q elements x keys below which one thread does it all (handing items out costs more)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@functools.cache
def thread_count() -> int:
    return max(1, os.cpu_count() or 1)


def _numpy_openblas_paths() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "openblas" in line and "numpy" in line})
    except OSError:
        return []


def _numpy_openblas():
    """(get, set) of numpy's own OpenBLAS thread count, or None where it has none.

    Each worker thread here runs its own matmuls; numpy's OpenBLAS would also split
    every one of them over all cores, and on 2 cores that oversubscription measured
    5-10x slower than one BLAS thread per worker.
    """
    import ctypes

    for path in _numpy_openblas_paths():
        lib = ctypes.CDLL(path)
        for get, set_ in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                          ("openblas_get_num_threads", "openblas_set_num_threads")):
            if hasattr(lib, get) and hasattr(lib, set_):
                return getattr(lib, get), getattr(lib, set_)
    return None


_blas_threads = None


@contextlib.contextmanager
def _one_blas_thread():
    global _blas_threads
    if _blas_threads is None:
        _blas_threads = _numpy_openblas() or False
    if not _blas_threads:
        yield
        return
    get, set_ = _blas_threads
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


def worker_pool() -> ThreadPoolExecutor:
    """One worker per core, shared by the CPU kernels (cpu_swiglu's too)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=thread_count(), thread_name_prefix="cpu-attn")
        return _pool


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    causal: bool,
    query_rows: int = QUERY_ROWS,
    key_block: int = KEY_BLOCK,
    threads: int | None = None,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """softmax(q k^T * scale [+ causal mask]) v for float32 arrays.

    q: (B, Hq, L, D); k: (B, Hkv, S, Dk); v: (B, Hkv, S, Dv), Hq a multiple of Hkv
    (grouped-query attention). The causal mask is MLX's: query i sits at position
    S - L + i (a prefill chunk after a cached prefix of S - L tokens) and sees keys
    0..S - L + i; `offsets` (B,) put batch row b's query i at offsets[b] + i instead
    (a batched verify forward: each row at its own length). Returns (B, Hq, L, Dv) float32.
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} kv heads")
    if causal and S < L:
        raise ValueError("a causal chunk needs at least as many keys as queries")
    rep = Hq // Hkv
    if offsets is None:
        offsets = np.full(B, S - L if causal else 0)
    elif causal and int(np.max(offsets)) + L > S:
        raise ValueError("a row's queries sit past the keys")
    n = threads or (thread_count() if q.size * S >= SPLIT_WORK else 1)
    if n == 1 and L * rep <= query_rows and _heads_kernel():
        with _one_blas_thread():
            return _heads_in_c(q, k, v, scale, offsets if causal else None, key_block)
    out = np.empty((B, Hq, L, v.shape[-1]), dtype=np.float32)
    positions = max(1, query_rows // rep)  # query positions per tile; all `rep` heads of each
    items = [(b, h, p0, min(p0 + positions, L)) for b in range(B) for h in range(Hkv)
             for p0 in range(0, L, positions)]
    # Longest first (causal tiles near the end see the most keys): better balance.
    items.sort(key=lambda it: -it[3])
    scale = np.float32(scale)

    def run(item):
        b, h, p0, p1 = item
        _tile(q, k, v, out, b, h, rep, p0, p1, int(offsets[b]), causal, scale, key_block)

    with _one_blas_thread():
        if n == 1 or len(items) == 1:
            for item in items:
                run(item)
        else:
            for f in [worker_pool().submit(run, it) for it in items]:
                f.result()
    return out


_kernel = None


def _compiled():
    """(cpu_kernels.c's attention_rows, the address of numpy's OpenBLAS sgemm) or None: the
    work item in numpy passes. The C loop calls the same OpenBLAS numpy does, holds no GIL
    (the two workers never wait on each other) and runs the softmax step in two passes."""
    global _kernel
    if _kernel is None:
        import ctypes

        lib, sgemm = native.load("cpu_kernels"), _numpy_sgemm64()
        if lib is None or sgemm is None:
            _kernel = False
        else:
            fn = lib.attention_rows
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 2]
            _kernel = fn, sgemm
    return _kernel or None


_heads = None


def _heads_kernel():
    """cpu_kernels.c's attention_heads (every batch row and kv head in one call), or None
    (where the per-item kernel is off too)."""
    global _heads
    if not _compiled():
        return None
    if _heads is None:
        import ctypes

        fn = native.load("cpu_kernels").attention_heads
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p,
                       *[ctypes.c_int64] * 3, ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_void_p,
                       *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 4]
        _heads = fn
    return _heads


def _heads_in_c(q, k, v, scale, offsets, key_block):
    """`attention` of a small problem (each kv head's rows fit one tile) on this thread, one C
    call for every (batch row, kv head): the same steps as `_tile`'s, so the same result."""
    B, Hq, L, D = q.shape
    Hkv, S, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep, rows = Hq // Hkv, L * Hq // Hkv
    # rows position-major (row = pos * rep + head), as `_tile` orders them
    qb = np.ascontiguousarray((q.reshape(B, Hkv, rep, L, D) * scale).transpose(0, 1, 3, 2, 4))
    k, v = _unit_stride_heads(k), _unit_stride_heads(v)
    out = np.empty((B, Hkv, rows, dv), dtype=np.float32)
    m, s = np.empty((B, Hkv, rows), dtype=np.float32), np.empty((B, Hkv, rows), dtype=np.float32)
    tile = np.empty((rows, key_block), dtype=np.float32)
    first = None if offsets is None else np.ascontiguousarray(offsets, dtype=np.int64)
    _heads_kernel()(_compiled()[1], qb.ctypes.data, B, Hkv, rows, D, k.ctypes.data, k.strides[0] // 4,
                    k.strides[1] // 4, k.strides[2] // 4, v.ctypes.data, v.strides[0] // 4, v.strides[1] // 4,
                    v.strides[2] // 4, dv, S, None if first is None else first.ctypes.data, rep, key_block,
                    tile.ctypes.data, m.ctypes.data, s.ctypes.data, out.ctypes.data)
    return out.reshape(B, Hkv, L, rep, dv).transpose(0, 1, 3, 2, 4).reshape(B, Hq, L, dv)


def _unit_stride_heads(x: np.ndarray) -> np.ndarray:
    """x (B, heads, rows, cols) with its columns adjacent and every stride a whole float32."""
    ok = x.strides[-1] == x.itemsize and all(st % x.itemsize == 0 and st >= 0 for st in x.strides)
    return x if ok else np.ascontiguousarray(x)


def _numpy_sgemm64() -> int | None:
    """Address of cblas_sgemm with 64-bit integers in numpy's bundled OpenBLAS, or None."""
    import ctypes

    for path in _numpy_openblas_paths():
        lib = ctypes.CDLL(path)
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):
            if hasattr(lib, name):
                return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    return None


def _tile(q, k, v, out, b, h, rep, p0, p1, offset, causal, scale, key_block):
    """One kv head's `rep` query heads at positions p0..p1, over every key it may see."""
    n_pos, D = p1 - p0, q.shape[-1]
    rows, dv = n_pos * rep, v.shape[-1]
    # Rows ordered position-major (row = pos * rep + head): one mask per position serves
    # every head of the group, and the group's heads share each K/V block's matmul.
    qb = q[b, h * rep : (h + 1) * rep, p0:p1, :].transpose(1, 0, 2).reshape(rows, D) * scale
    kk, vv = _unit_stride_rows(k[b, h]), _unit_stride_rows(v[b, h])
    last_key = offset + p1 if causal else kk.shape[0]  # keys past it are masked for every row
    m = np.full(rows, -np.inf, dtype=np.float32)  # running max of each row's scores
    s = np.zeros(rows, dtype=np.float32)  # running sum of exp(score - m)
    acc = np.zeros((rows, dv), dtype=np.float32)
    tile = np.empty((rows, key_block), dtype=np.float32)
    compiled = _compiled()
    if compiled:
        fn, sgemm = compiled
        fn(sgemm, qb.ctypes.data, rows, D, kk.ctypes.data, kk.strides[0] // 4, vv.ctypes.data, vv.strides[0] // 4,
           dv, last_key, key_block, tile.ctypes.data, m.ctypes.data, s.ctypes.data, acc.ctypes.data,
           offset + p0 if causal else -1, rep)
    else:
        step = _NumpySoftmax(rows, rep, offset + p0)
        for k0 in range(0, last_key, key_block):
            k1 = min(k0 + key_block, last_key)
            sc = tile[:, : k1 - k0]
            np.matmul(qb, kk[k0:k1].T, out=sc)
            m = step(sc, m, s, acc, k0, k1, causal)
            acc += sc @ vv[k0:k1]
    acc /= s[:, None]
    out[b, h * rep : (h + 1) * rep, p0:p1, :] = acc.reshape(n_pos, rep, -1).transpose(1, 0, 2)


def _unit_stride_rows(x: np.ndarray) -> np.ndarray:
    """x (rows x cols) with its columns adjacent, as BLAS needs (a cache slice already is)."""
    return x if x.strides[-1] == x.itemsize and x.strides[0] >= x.shape[-1] * x.itemsize else np.ascontiguousarray(x)


class _NumpySoftmax:
    """The online softmax's step in numpy passes (where cpu_kernels.c can't be compiled)."""

    def __init__(self, rows, rep, first_pos):
        self.row_pos = np.repeat(np.arange(first_pos, first_pos + rows // rep), rep)[:, None]
        self.new_m = np.empty(rows, dtype=np.float32)
        self.corr = np.empty(rows, dtype=np.float32)

    def __call__(self, sc, m, s, acc, k0, k1, causal):
        """Turns the tile into exp(score - new max), rescales s and acc; returns the new max."""
        new_m, corr = self.new_m, self.corr
        if causal and k1 - 1 > self.row_pos[0, 0]:  # the tile crosses the diagonal
            sc[np.arange(k0, k1)[None, :] > self.row_pos] = -np.inf
        # The first tile always holds key 0, which every row sees: m is finite from then on.
        np.maximum(m, sc.max(axis=1), out=new_m)
        np.subtract(m, new_m, out=corr)
        np.exp(corr, out=corr)
        np.subtract(sc, new_m[:, None], out=sc)
        np.exp(sc, out=sc)
        s *= corr
        s += sc.sum(axis=1)
        acc *= corr[:, None]
        self.new_m = m
        return new_m


# -- routing mx.fast.scaled_dot_product_attention ----------------------------------------
# The one patch of it in the engine (`route`); what a forward asks of it is in this thread's
# forward context (engine/base/forward_context.py), set by the blocks below.

_original = None
# Prefill chunks: those wider than the verify passes `--max-draft auto` makes (MAX_WIDTH).
MIN_QUERIES = MAX_WIDTH + 1
# Decode and verify forwards on the engine thread: those of at least this many tokens (rows x
# width). Each routed call waits for the layer's graph so far (a sync); in a narrower forward two
# syncs a layer cost more than MLX's exp saves. Bundled model, 300 tokens of context, MLX ->
# routed: 1 token 9.7 -> 12.0 ms, 4 tokens 22.5 -> 21.9, 8 tokens 25.1 -> 22.6, one row of 17
# 33.0 -> 26.9, 4 rows of 2 27.6 -> 26.9, 4 rows of 17 85.7 -> 50.7.
MIN_TOKENS = 8
_min_keys: int | None = None  # the measured crossover in keys (cached prefix + chunk); None: off


def set_crossover(min_keys: int | None) -> None:
    """Use this path for prefill chunks attending to at least `min_keys` keys (None: never)."""
    global _min_keys
    _min_keys = min_keys


def disabled():
    """MLX's own kernel inside this block (on this thread): references, measurements."""
    return forward_context(cpu_kernels_off=True)


def last_call_unread(calls: int | None):
    """Inside this block (on this thread) a prefill chunk's forward whose last attention output
    nobody reads: a chunk that only fills KV caches. MLX never evaluates that output (its graph
    is dropped), but this path computes eagerly, so the forward's `calls`-th attention call goes
    to MLX's kernel, lazily, and costs nothing. `calls` None: every call as usual."""
    return forward_context(prefill=True, unread_call=calls or None, attention_calls_made=0)


def engine_thread():
    """This thread is the engine's (engine/engine.py holds it for its life): its decode and
    verify forwards may take this path too, and cpu_swiglu's kernel. Everything the engine
    decodes runs here, alone or batched, and so does a reference it is compared with
    (`Engine.call`): a forward of the same size computes the same way in both. Off it
    (training, a script's own forward under autodiff) MLX computes as usual."""
    return forward_context(engine_thread=True)


@contextlib.contextmanager
def watched_calls():
    """Inside this block, each attention call of this thread's forwards leaves its shape
    (query heads, kv heads, key size, value size) in the list it yields."""
    route()
    with forward_context(attention_shapes=[]) as context:
        yield context.attention_shapes


def handles(queries, keys, mask, sinks) -> bool:
    """Whether this path should take these arguments: it computes them exactly (up to
    float32 rounding) and pays: a prefill chunk above the crossover, or on the engine thread a
    decode or verify forward of MIN_TOKENS tokens or more."""
    import mlx.core as mx

    if _min_keys is None or get_context().cpu_kernels_off or sinks is not None:
        return False
    if queries.ndim != 4 or keys.ndim != 4 or queries.dtype != mx.float32 or keys.dtype != mx.float32:
        return False
    if mx.default_device() != mx.cpu or queries.shape[1] % keys.shape[1]:
        return False
    L, S = queries.shape[2], keys.shape[2]
    plain = mask is None or (isinstance(mask, str) and mask == "causal")
    if L >= MIN_QUERIES:  # a prefill chunk
        return plain and S >= _min_keys
    # a decode or verify forward; an array mask is taken where it is causal per row (`row_offsets`)
    wide = queries.shape[0] * L >= MIN_TOKENS
    return get_context().engine_thread and wide and (plain or (isinstance(mask, mx.array) and mask.dtype == mx.bool_))


def row_offsets(mask: np.ndarray, B: int, L: int, S: int) -> np.ndarray | None:
    """Per batch row, the position of its first query, where the boolean `mask` (broadcast to
    (B, 1, L, S)) lets query i of row b see exactly keys 0..offset_b + i; else None (a window,
    padding, a mask that differs by head)."""
    if mask.ndim not in (2, 4) or mask.shape[-2:] != (L, S):
        return None
    if mask.ndim == 4 and (mask.shape[0] not in (1, B) or mask.shape[1] != 1):
        return None
    m = np.broadcast_to(mask[:, 0] if mask.ndim == 4 else mask, (B, L, S))
    offsets = m[:, 0, :].sum(axis=1) - 1
    if (offsets < 0).any() or (offsets + L > S).any():
        return None
    causal = np.arange(S)[None, None, :] <= (offsets[:, None, None] + np.arange(L)[None, :, None])
    return offsets if np.array_equal(m, causal) else None


def _routed(queries, keys, values, *args, scale=None, mask=None, sinks=None, **kwargs):
    context = get_context()
    if context.attention_shapes is not None:
        context.attention_shapes.append((queries.shape[1], keys.shape[1], keys.shape[-1], values.shape[-1]))
    last = False
    if context.unread_call is not None:
        context.attention_calls_made += 1
        last = context.attention_calls_made == context.unread_call
    if args or kwargs or scale is None or last or not handles(queries, keys, mask, sinks):
        return _original(queries, keys, values, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)
    import mlx.core as mx

    try:
        mx.eval(queries, keys, values, *([mask] if isinstance(mask, mx.array) else []))  # numpy needs values
        q, k, v = np.asarray(queries), np.asarray(keys), np.asarray(values)  # no copies
    except Exception:  # a traced graph (mx.compile) has no values yet: MLX's kernel
        return _original(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    offsets = None
    if isinstance(mask, mx.array):
        # every layer of a forward gets the same mask object: read it once, not once a layer
        shape = (q.shape[0], q.shape[2], k.shape[2])
        seen = context.mask_read
        if seen is not None and seen[0] is mask and seen[1] == shape:
            offsets = seen[2]
        else:
            offsets = row_offsets(np.asarray(mask), *shape)
            context.mask_read = (mask, shape, offsets)
        if offsets is None:
            return _original(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return mx.array(attention(q, k, v, scale, causal=mask is not None, offsets=offsets))


def install(min_keys: int | None) -> None:
    """Route `mx.fast.scaled_dot_product_attention` through this path above `min_keys`
    keys (idempotent; None routes nothing)."""
    set_crossover(min_keys)
    route()


def route() -> None:
    """Put the router in place of `mx.fast.scaled_dot_product_attention` (idempotent). Until a
    crossover is set it hands every call to MLX's kernel, only counting and watching."""
    global _original
    import mlx.core as mx

    if _original is None:
        _original = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _routed


def uninstall() -> None:
    global _original
    import mlx.core as mx

    if _original is not None:
        mx.fast.scaled_dot_product_attention = _original
        _original = None
