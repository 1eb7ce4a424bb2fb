"""Where the blockwise CPU attention (`cpu_attention.py`) beats MLX's: measured, cached.

The crossover is a key count: prefill chunks attending to at least that many keys (cached
prefix plus the chunk) take the blockwise path. It depends on the machine (cores, BLAS,
numpy), MLX's version and the model's attention shape (query heads, kv heads, head
size), so it is measured once per such key, like the verify cost curve, and cached as
JSON beside it. Without a measurement a default that held on the machines we measured
is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cost_curve import cache_dir, device_name, write_json

FORMAT = 1
DEFAULT_MIN_KEYS = 512  # measured 2.7x faster than MLX already at 512 keys (2 cores, OpenBLAS)
KEY_COUNTS = (512, 1024, 2048, 4096, 8192, 16384)
CHUNK = 512  # queries per measured chunk (the default prefill chunk)


@dataclass
class Crossover:
    min_keys: int | None  # None: the blockwise path never won here
    key: dict = field(default_factory=dict)
    measured: bool = True
    timings: list = field(default_factory=list)  # [keys, mlx_s, blockwise_s] per point
    measured_at: str = ""


def attention_calls(target) -> list[tuple[int, int, int, int]]:
    """(query heads, kv heads, key size, value size) of each attention call in one forward,
    seen by running two tokens with `mx.fast.scaled_dot_product_attention` watched: one
    way for every family, whatever its config calls these."""
    import mlx.core as mx

    seen = []
    original = mx.fast.scaled_dot_product_attention

    def watch(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], k.shape[-1], v.shape[-1]))
        return original(q, k, v, *args, **kwargs)

    mx.fast.scaled_dot_product_attention = watch
    try:
        mx.eval(target.forward([0, 0], target.make_cache()))
    finally:
        mx.fast.scaled_dot_product_attention = original
    return seen


def unread_last_call(target, cache) -> int | None:
    """How many attention calls a forward of this target makes, where the last one's output
    feeds no cache (so a forward that only fills the cache need not compute it); else None.
    That holds when every cache is a plain KVCache with one attention call each: keys and
    values are cached before attention, and no recurrent state follows the last layer."""
    if not cache or any(type(c).__name__ != "KVCache" for c in cache):
        return None
    calls = getattr(target, "_attention_call_count", None)
    if calls is None:  # counted once per target
        calls = target._attention_call_count = len(attention_calls(target))
    return calls if calls == len(cache) else None


def attention_shape(target) -> tuple[int, int, int, int]:
    """The widest attention layer's shape: where the crossover matters most."""
    seen = attention_calls(target)
    if not seen:
        raise ValueError("the model never called scaled_dot_product_attention")
    return max(seen, key=lambda s: s[0] * s[2])


def crossover_key(target, shape=None) -> dict:
    import mlx.core as mx
    import numpy as np

    return {
        "format": FORMAT,
        "device": device_name(),
        "mlx": mx.__version__,
        "numpy": np.__version__,
        "shape": list(shape or attention_shape(target)),
    }


def crossover_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"attention-crossover-{digest}.json"


def load_crossover(key: dict) -> Crossover | None:
    try:
        data = json.loads(crossover_path(key).read_text())
        found = Crossover(**data)
    except (OSError, ValueError, TypeError):
        return None
    return found if found.key == key and found.measured else None


def save_crossover(found: Crossover) -> Path:
    return write_json(crossover_path(found.key), asdict(found))


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

    from . import cpu_attention

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
    if not refresh:
        found = load_crossover(key)
        if found is not None:
            return found
    found = measure_crossover(shape, key=key)
    save_crossover(found)
    return found


def crossover_for(target) -> Crossover:
    """The cached crossover, else the default (measuring is `mlx-dspark tune`'s job)."""
    key = crossover_key(target)
    return load_crossover(key) or Crossover(DEFAULT_MIN_KEYS, key=key, measured=False)


def install_for(target) -> Crossover | None:
    """Route long CPU prefill chunks of this target through the blockwise attention."""
    import mlx.core as mx

    from . import cpu_attention

    if mx.default_device() != mx.cpu or os.environ.get("MLX_DSPARK_CPU_ATTENTION") == "0":
        return None
    try:
        found = crossover_for(target)
    except ValueError:  # no attention layer to route (a recurrent model)
        return None
    cpu_attention.install(found.min_keys)
    return found
