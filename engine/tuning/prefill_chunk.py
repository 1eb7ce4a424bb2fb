"""The prefill chunk size: tokens per forward while prefilling, chosen by measurement.

Wider chunks read the weights fewer times (matmuls with more rows run nearer BLAS
speed); narrower ones report progress and honour cancellation sooner and hold less
memory. Which width is fastest depends on the machine and the model, so it is timed
once per (machine, MLX, model, dtype) by `mlx-dspark tune` and cached beside the cost
curve; without a measurement the default below (measured on the bundled model, 2 cores,
OpenBLAS) is used.
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.base.measurements import MeasurementStore, cached_or_measured
from engine.base.platform import device_name, on_cuda
from engine.decoding.verify import prefill
from engine.kernels import quantized_route
from engine.kernels.attention_crossover import install_for
from engine.tuning.attention_tune import tune_attention

FORMAT = 2  # 2: wider candidates on MLX CUDA, prefill through wide_dequantize
DEFAULT_CHUNK = 1024  # 4096-token prefill, bundled model: 256 18.8 s, 512 13.9, 1024 13.2, 2048 21.0 (load 10)
CANDIDATES = (256, 512, 1024, 2048)
MEASURE_TOKENS = 4096
# MLX CUDA (H200, 8-bit 8B yardstick, 16,384 tokens, wide_dequantize): 2048 0.68 s, 4096 0.55 s
CUDA_DEFAULT_CHUNK = 4096
CUDA_CANDIDATES = (1024, 2048, 4096)
CUDA_MEASURE_TOKENS = 8192
CHUNKS = MeasurementStore("prefill-chunk")  # prefill-chunk-<digest of key>.json


def chunk_key(target) -> dict:
    import mlx.core as mx

    return {"format": FORMAT, "device": device_name(), "mlx": mx.__version__,
            "model": target.identity, "dtype": target.dtype, **quantized_route.measurement_key()}


def chunk_path(key: dict) -> Path:
    return CHUNKS.path(key)


def time_prefill(target, tokens: list[int], chunk: int) -> float:
    """Seconds to prefill `tokens` into a fresh cache, `chunk` tokens a forward."""
    import mlx.core as mx


    cache = target.make_cache()
    t0 = time.perf_counter()
    prefill(target, cache, tokens, chunk_size=chunk)
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def default_chunk() -> int:
    return CUDA_DEFAULT_CHUNK if on_cuda() else DEFAULT_CHUNK


def measure_chunk(target, candidates=None, tokens: int | None = None, seed: int = 0) -> dict:
    """Prefill the same random `tokens` at each candidate width; the fastest (best of two) wins."""
    import numpy as np

    cuda = on_cuda()
    candidates = candidates or (CUDA_CANDIDATES if cuda else CANDIDATES)
    tokens = tokens or (CUDA_MEASURE_TOKENS if cuda else MEASURE_TOKENS)
    n = min(tokens, target.context_window - 1)
    ids = np.random.default_rng(seed).integers(0, target.vocab_size, size=n).tolist()
    time_prefill(target, ids[: min(n, 256)], 256)  # warm up
    seconds = {c: float("inf") for c in candidates}
    for _ in range(2):  # whole sweeps, best of two: a burst of load spoils one pass, not a width
        for c in candidates:
            seconds[c] = min(seconds[c], round(time_prefill(target, ids, c), 4))
    best = min(seconds, key=seconds.get)
    return {"chunk": best, "key": chunk_key(target), "tokens": n,
            "seconds": {str(c): s for c, s in seconds.items()},
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def load_chunk(key: dict) -> dict | None:
    """The measured chunk record for exactly this key, or None (absent, another key's, damaged)."""
    found = CHUNKS.load(key)
    ok = found is not None and isinstance(found.get("chunk"), int)
    return found if ok and found["chunk"] > 0 else None


def tune_chunk(target, refresh: bool = False) -> dict:
    key = chunk_key(target)
    return cached_or_measured(lambda: load_chunk(key), lambda: measure_chunk(target), CHUNKS.save, refresh)


def chunk_for(target) -> int:
    """The measured chunk for this target here, else the device's default."""
    found = load_chunk(chunk_key(target))
    return found["chunk"] if found else default_chunk()


def tune_prefill(target, refresh: bool = False) -> dict:
    """`mlx-dspark tune`'s prefill part: the attention crossover (CPU), then the chunk size
    (timed with that attention in place)."""
    from dataclasses import asdict

    import mlx.core as mx


    attention = None
    if mx.default_device() == mx.cpu:
        try:
            attention = asdict(tune_attention(target, refresh=refresh))
        except ValueError:  # no attention layers
            attention = None
        install_for(target)
    return {"attention": attention, "chunk": tune_chunk(target, refresh=refresh)}
