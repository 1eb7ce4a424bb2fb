"""Which CPU prefill chunks take the blockwise attention (`cpu_attention.py`): the crossover
measured by engine/tuning/attention_tune.py, read here (a default where unmeasured), and the
attention calls a forward makes.

The crossover is a key count: prefill chunks attending to at least that many keys (cached
prefix plus the chunk) take the blockwise path. It depends on the machine (cores, BLAS,
numpy), MLX's version and the model's attention shape (query heads, kv heads, head
size), so it is measured once per such key and cached as JSON beside the verify cost curve.
Without a measurement a default that held on the machines we measured is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.measurements import MeasurementStore
from engine.base.platform import device_name
from engine.caches.kinds import kind_of
from engine.kernels import cpu_attention

FORMAT = 1
DEFAULT_MIN_KEYS = 512  # measured 2.7x faster than MLX already at 512 keys (2 cores, OpenBLAS)
CROSSOVERS = MeasurementStore("attention-crossover", shared=False)  # each rank's own layers  # attention-crossover-<digest of key>.json


@dataclass
class Crossover:
    min_keys: int | None  # None: the blockwise path never won here
    key: dict = field(default_factory=dict)
    measured: bool = True
    timings: list = field(default_factory=list)  # [keys, mlx_s, blockwise_s] per point
    measured_at: str = ""


def attention_calls(target) -> list[tuple[int, int, int, int]]:
    """(query heads, kv heads, key size, value size) of each attention call in one forward,
    seen by running two tokens with the attention router watching (`cpu_attention.watched_calls`):
    one way for every family, whatever its config calls these."""
    import mlx.core as mx

    with cpu_attention.watched_calls() as seen:
        mx.eval(target.forward([0, 0], target.make_cache()))
    return seen


def unread_last_call(target, cache) -> int | None:
    """How many attention calls a forward of this target makes, where the last one's output
    feeds no cache (so a forward that only fills the cache need not compute it); else None.
    That holds when every cache is a plain KVCache with one attention call each: keys and
    values are cached before attention, and no recurrent state follows the last layer."""
    if not cache or not all(kind_of(c).plain_kv for c in cache):
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
    return CROSSOVERS.path(key)


def load_crossover(key: dict) -> Crossover | None:
    """The measured crossover for exactly this key, or None (absent, another key's, damaged)."""
    data = CROSSOVERS.load(key)
    try:
        found = Crossover(**data) if data is not None else None
    except TypeError:  # fields this version doesn't know
        return None
    return found if found is not None and found.measured else None


def crossover_for(target) -> Crossover:
    """The cached crossover, else the default (measuring is `mlx-dspark tune`'s job)."""
    key = crossover_key(target)
    return load_crossover(key) or Crossover(DEFAULT_MIN_KEYS, key=key, measured=False)


def install_for(target) -> Crossover | None:
    """Route long CPU prefill chunks of this target through the blockwise attention."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or os.environ.get("MLX_DSPARK_CPU_ATTENTION") == "0":
        return None
    try:
        found = crossover_for(target)
    except ValueError:  # no attention layer to route (a recurrent model)
        return None
    cpu_attention.install(found.min_keys)
    return found
