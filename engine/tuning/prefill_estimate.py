"""How long a cold prefill of N tokens should take here, and how long it does (for `doctor`).

The estimate is the FLOPs a prefill needs at this machine's best matmul rate: the weights' matmuls
(2 x matmul parameters a token, without the output head: a prefill reads no logits) plus
causal attention (2 x (key + value size) x query heads x N(N+1)/2 per layer), where the last
layer's attention and what follows it are left out when they feed no cache, as MLX (and
plain mlx-lm) never compute them. The measurement is a cold prefill in full, or, where that would take too
long, a prediction from two timed chunks: the first, and one at the last chunk's depth
over a cache filled with random keys and values (a chunk's cost is linear in its depth).

The rate is a square matmul's, timed now: float32 at 1024 on a CPU (the engine computes in
float32 there), and on a GPU in the model's own dtype at the sizes where a GPU reaches its
peak. A GPU's float32 product at 1024 runs far under its bf16 prefill (551 TFLOP/s on an H200),
so timed that way the estimate was no bound there (docs/benchmarks.md, 2026-12-07).
"""

from __future__ import annotations

import time

from engine.caches.kinds import kind_of
from engine.kernels import cpu_attention
from engine.kernels.attention_crossover import attention_calls, unread_last_call
from engine.tuning.prefill_chunk import time_prefill


# Projections that make a layer's keys or values (alone or fused with queries), by family.
KV_PROJECTIONS = ("k_proj", "v_proj", "kv_proj", "qkv_proj", "wqkv", "query_key_value", "c_attn", "kv_a_proj_with_mqa")


def _linear_sizes(module) -> dict[str, int]:
    """Parameters each linear layer under `module` multiplies by, a token, by name."""
    import mlx.nn as nn

    sizes = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            sizes[name] = m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
        elif isinstance(m, nn.Linear):
            sizes[name] = m.weight.size
    return sizes


def matmul_params(target) -> int:
    """Parameters the forward multiplies by, a token: linear layers, and the embedding where
    it doubles as the output head (tied)."""
    return sum(_linear_sizes(target.model).values()) + _tied_head(target)


def _tied_head(target) -> int:
    import mlx.nn as nn

    if any(name.endswith("lm_head") for name, _ in target.model.named_modules()):
        return 0
    embed = 0
    for _, m in target.model.named_modules():
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            cols = m.weight.shape[1] * 32 // m.bits if hasattr(m, "bits") else m.weight.shape[1]
            embed = max(embed, m.weight.shape[0] * cols)
    return embed


def prefill_params(target) -> int:
    """Parameters a cache-filling forward (a prefill chunk) multiplies by, a token. Its logits
    are never read, so MLX never computes the head; where the last attention layer's output
    feeds no cache (`unread_last_call`), of that layer only what makes keys and values runs."""
    sizes = _linear_sizes(target.model)
    params = sum(n for name, n in sizes.items() if not name.endswith("lm_head"))
    if unread_last_call(target, target.make_cache()):
        last = _linear_sizes(target.model.layers[-1])
        params -= sum(n for name, n in last.items() if not name.lower().endswith(KV_PROJECTIONS))
    return params


def prefill_flops(target, tokens: int, calls=None) -> dict:
    """The FLOPs a cold prefill of `tokens` needs: the weights' matmuls (`prefill_params`) and
    causal attention, less the last layer's where nothing reads it."""
    calls = list(calls if calls is not None else attention_calls(target))
    if calls and unread_last_call(target, target.make_cache()):
        calls = calls[:-1]
    weights = 2.0 * prefill_params(target) * tokens
    pairs = tokens * (tokens + 1) / 2
    attention = sum(2.0 * hq * (dk + dv) * pairs for hq, _, dk, dv in calls)
    return {"weights": weights, "attention": attention, "total": weights + attention}


CPU_MATMUL_N = 1024
GPU_MATMUL_NS = (2048, 4096, 8192)  # a GPU's peak takes a large product; the best of these


def _best_gflops(fn, n: int, repeats: int) -> float:
    fn()
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return 2.0 * n**3 / t / 1e9


def blas_rates(dtype: str = "float32", repeats: int = 3) -> dict:
    """GFLOP/s of a square matmul: numpy's float32 BLAS at 1024 (the CPU's), and MLX's on its
    device, in `dtype` (the model's compute dtype) at the best of GPU_MATMUL_NS on a GPU, at 1024
    on a CPU."""
    import mlx.core as mx
    import numpy as np

    a = np.random.default_rng(0).standard_normal((CPU_MATMUL_N, CPU_MATMUL_N), dtype=np.float32)
    numpy_gflops = _best_gflops(lambda: a @ a, CPU_MATMUL_N, repeats)
    sizes = GPU_MATMUL_NS if mx.default_device().type == mx.gpu else (CPU_MATMUL_N,)
    mlx_gflops, mlx_n = 0.0, sizes[0]
    for n in sizes:
        am = mx.random.normal((n, n)).astype(getattr(mx, dtype))
        mx.eval(am)
        rate = _best_gflops(lambda: mx.eval(am @ am), n, repeats)
        if rate > mlx_gflops:
            mlx_gflops, mlx_n = rate, n
    return {"numpy_gflops": round(numpy_gflops, 1), "mlx_gflops": round(mlx_gflops, 1),
            "mlx_dtype": dtype, "mlx_n": mlx_n}


def _fillable(cache, calls) -> bool:
    return len(cache) == len(calls) and all(kind_of(c).plain_kv for c in cache)


def filled_cache(target, depth: int, calls) -> list:
    """A fresh cache holding `depth` positions of random keys and values in the model's dtype
    (float32 ones would turn a bf16 model's attention into a float32 one, off cuDNN on a GPU)."""
    import mlx.core as mx

    cache = target.make_cache()
    if depth:
        dtype = getattr(mx, target.dtype)
        for c, (_, hkv, dk, dv) in zip(cache, calls):
            c.update_and_fetch(mx.random.normal((1, hkv, depth, dk), dtype=dtype),
                               mx.random.normal((1, hkv, depth, dv), dtype=dtype))
        mx.eval([c.state for c in cache])
    return cache


def time_chunk_at(target, depth: int, ids: list[int], calls) -> float:
    """Seconds of one forward over `ids` after `depth` tokens of random keys and values."""
    import mlx.core as mx

    cache = filled_cache(target, depth, calls)
    t0 = time.perf_counter()
    with cpu_attention.last_call_unread(unread_last_call(target, cache)):  # as prefill() runs it
        target.forward(ids, cache)
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def predict_prefill(target, tokens: int, chunk: int, calls=None, seed: int = 0) -> float | None:
    """Seconds a cold prefill of `tokens` should take, from two timed chunks; None where the
    cache can't be filled with random keys (sliding windows, recurrent layers)."""
    import numpy as np

    calls = calls if calls is not None else attention_calls(target)
    if not _fillable(target.make_cache(), calls):
        return None
    chunk = min(chunk, tokens)
    ids = np.random.default_rng(seed).integers(0, target.vocab_size, size=chunk).tolist()
    # best of two at each depth: a GPU builds a shape's kernels and attention graph on its first run
    first = min(time_chunk_at(target, 0, ids, calls) for _ in range(2))
    last_depth = max(tokens - chunk, 0)
    last = min(time_chunk_at(target, last_depth, ids, calls) for _ in range(2)) if last_depth else first
    depths = range(0, tokens, chunk)
    slope = (last - first) / last_depth if last_depth else 0.0
    return sum((min(chunk, tokens - d) / chunk) * (first + slope * d) for d in depths)


def prefill_report(target, sizes=(8192, 32768), chunk: int = 1024, full=(), rates: dict | None = None) -> dict:
    """For each size: FLOPs, the time they take at the machine's best measured matmul rate (numpy's,
    or MLX's in the model's dtype), and a measured time (in full for sizes in `full`, else
    predicted from two chunks)."""
    import numpy as np

    rates = rates or blas_rates(target.dtype)
    rate = max(rates["numpy_gflops"], rates["mlx_gflops"])  # the best matmul this machine has
    calls = attention_calls(target)
    out = {"chunk": chunk, **rates, "sizes": []}
    for n in sizes:
        flops = prefill_flops(target, n, calls)
        row = {"tokens": n, "gflop": round(flops["total"] / 1e9, 1),
               "attention_gflop": round(flops["attention"] / 1e9, 1),
               "estimate_s": round(flops["total"] / (rate * 1e9), 4)}
        if n in full:
            if n > target.context_window:
                row["measured_note"] = f"over the model's {target.context_window}-token window"
            else:
                ids = np.random.default_rng(n).integers(0, target.vocab_size, size=n).tolist()
                row["measured_s"] = round(time_prefill(target, ids, chunk), 2)
        predicted = predict_prefill(target, n, chunk, calls)
        if predicted is not None:
            row["predicted_s"] = round(predicted, 2)
        out["sizes"].append(row)
    return out
