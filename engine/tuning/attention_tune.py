"""Where the blockwise CPU attention (`cpu_attention.py`) beats MLX's: measured and cached
(engine/kernels/attention_crossover.py reads the result and routes prefill chunks by it).

Timed per attention shape: one causal chunk of queries over each key count, MLX's kernel
against the blockwise one.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from engine.base.measurements import cached_or_measured
from engine.kernels import cpu_attention
from engine.kernels.attention_crossover import CROSSOVERS, Crossover, attention_shape, crossover_key, load_crossover

KEY_COUNTS = (512, 1024, 2048, 4096, 8192, 16384)
CHUNK = 512  # queries per measured chunk (the default prefill chunk)


def save_crossover(found: Crossover) -> Path:
    return CROSSOVERS.save(asdict(found))


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_crossover(shape, key: dict | None = None, key_counts=KEY_COUNTS, chunk: int = CHUNK,
                      repeats: int = 2) -> Crossover:
    """Time one causal chunk of `chunk` queries over each key count, MLX's kernel against
    the blockwise one; the crossover is the smallest count from which blockwise wins."""
    import mlx.core as mx
    import numpy as np

    hq, hkv, dk, dv = shape
    rng = np.random.default_rng(0)
    timings = []
    for keys in key_counts:
        L = min(chunk, keys)
        q = rng.standard_normal((1, hq, L, dk), dtype=np.float32)
        k = rng.standard_normal((1, hkv, keys, dk), dtype=np.float32)
        v = rng.standard_normal((1, hkv, keys, dv), dtype=np.float32)
        qm, km, vm = mx.array(q), mx.array(k), mx.array(v)
        mx.eval(qm, km, vm)
        with cpu_attention.disabled():
            mlx_s = _best_of(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
                qm, km, vm, scale=dk**-0.5, mask="causal")), repeats)
        ours_s = _best_of(lambda: cpu_attention.attention(q, k, v, dk**-0.5, causal=True), repeats)
        timings.append([keys, round(mlx_s, 6), round(ours_s, 6)])
    min_keys = None
    for keys, mlx_s, ours_s in reversed(timings):  # the smallest count from which it always wins
        if ours_s > mlx_s:
            break
        min_keys = keys
    return Crossover(min_keys, key=dict(key or {}), measured=True, timings=timings,
                     measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def tune_attention(target, refresh: bool = False) -> Crossover:
    """The cached crossover for this target's attention shape here; measured if absent."""
    shape = attention_shape(target)
    key = crossover_key(target, shape)
    return cached_or_measured(lambda: load_crossover(key), lambda: measure_crossover(shape, key=key),
                              save_crossover, refresh, shared=False)
