"""What an `Engine` is built with: one dataclass, checked once when it is made.

`Engine(model, config, **overrides)` takes these fields as keywords too, so
`Engine(path, mode="lookup", max_draft=4)` reads as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.base.loop_guard import LoopGuard
from engine.caches.kv_segments import KV_BITS
from engine.model.split import SPLITS

DEFAULT_MAX_DRAFT = "auto"  # per round, from the measured verify cost curve (engine/tuning/draft_control.py)


def _whole(value, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "auto"  # the default drafting mode (engine/drafting/modes.py)
    max_draft: int | str = DEFAULT_MAX_DRAFT  # the default draft cap per round, or "auto"
    prefill_chunk: int | None = None  # None: measured for this machine (engine/tuning/prefill_chunk.py)
    context_window: int | None = None  # None: the model's own
    dtype: str | None = None
    prefix_cache: bool = True
    prefix_cache_max_ram_mb: float | None = None
    prefix_cache_dir: str | None = None
    prefix_cache_max_disk_mb: float | None = None
    kv_bits: int | None = None  # quantised KV (engine/caches/kv_segments.py)
    drafter: str | None = None  # a head checkpoint, paired with the model when the engine starts
    drafter_bits: int | None = None
    # end a generation whose last N committed tokens repeat one short n-gram
    # (engine/base/loop_guard.py), as `length`; 0 (the library's default) never does
    loop_guard: int = 0
    max_batch: int | str = 1  # jobs run at once, or "auto": from this machine's batch cost surface
    # under a launcher (mlx.launch), how the model is split over its ranks: "pipeline" or
    # "tensor" (engine/model/split.py); None: mlx-lm's pick. Ignored on one process.
    split: str | None = None
    # many turns ahead (serve, mcp): worth a longer start that makes each warm turn faster (on MLX
    # CUDA, cuDNN's graphs of short prefill chunks built at load: engine/kernels/gpu_attention.py)
    long_lived: bool = False

    def __post_init__(self) -> None:
        if self.kv_bits not in (None, *KV_BITS):
            raise ValueError(f"kv_bits must be one of {KV_BITS}, not {self.kv_bits!r}")
        if self.prefill_chunk is not None and not _whole(self.prefill_chunk, 1):
            raise ValueError(f"prefill_chunk must be a whole number >= 1 or None (measured), not {self.prefill_chunk!r}")
        if self.loop_guard:
            LoopGuard(self.loop_guard)  # a window too small to hold a loop fails here, not per request
        if self.split not in (None, *SPLITS):
            raise ValueError(f"split must be one of {SPLITS} or None, not {self.split!r}")
        if self.max_batch != "auto" and not _whole(self.max_batch, 1):
            raise ValueError(f"max_batch must be a whole number >= 1 or 'auto', not {self.max_batch!r}")
