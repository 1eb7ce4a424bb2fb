"""The batch cost surface: what one verify forward of b sequences, each w tokens wide, costs here.

Measured through the scheduler's own batched forward (engine/decoding/batch_verify.py: the
sequences' rows of one persistent BatchCache, engine/caches/batch_cache.py, in one forward).
Cached as JSON beside the width curve, under the same key (engine/tuning/cost_curve.py). Three
readers:

- the draft controller, while several sequences decode: what a draft costs relative to a
  plain step *in a batch of b* (`factor`; engine/tuning/draft_control.py);
- the scheduler: which forwards to batch (`max_batched_width`, then the cheapest split:
  engine/decoding/batch_verify.py `choose_batch`);
- `--max-batch auto`: the largest batch whose aggregate throughput still gains (`best_max_batch`).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from engine.base.measurements import MeasurementStore, cached_or_measured
from engine.base.ranks import share
from engine.base.platform import slow_blas_warning
from engine.caches.batch_cache import BatchCache, joinable
from engine.caches.kv_segments import fresh_cache
from engine.caches.rollback import mark, take_back
from engine.decoding.batch_verify import Forward, run_forwards
from engine.tuning.cost_curve import curve_key

# 2: measured through the persistent BatchCache. Surfaces of 1 priced a per-round KV copy that
# no longer happens (they undersold batching): measured again.
# 3: every width up to 8 measured, and a batched forward runs at the widest width that measured
# no dearer (`padded_width`): on this project's CPU, 4 rows of 3 tokens took 31 ms and 4 rows of
# 4 took 21 (the BLAS's blocking likes 16 rows); version 2 capped the slow cell without padding.
SURFACE_VERSION = 3
BATCHES = (1, 2, 4, 8)
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
DEPTH = 1024  # context per sequence (attention's share of a forward grows with it)
REPEATS = 3
# What `--max-batch auto` and `doctor` measure when nothing is cached (seconds on a CPU);
# `mlx-dspark tune` measures the full grid.
QUICK = dict(widths=(1, 2, 4, 8, 16), depth=512, repeats=2)
BATCHING_MARGIN = 0.10  # batching a width must save a tenth of the forward-seconds (median over batch sizes)
BATCH_GAIN = 0.15  # a larger batch must raise aggregate tokens per second by 15% to be worth its latency
SHORT_DRAFT_WIDTH = 8  # `best_max_batch` judges by widths up to this: short drafts, where batching pays most
# Unmeasured (or nothing batched): what the CPU runs of issue 14 chose (scripts/bench_concurrency.py).
DEFAULT_MAX_BATCHED_WIDTH = 8
DEFAULT_MAX_BATCH = 4


# Beside the width curve of the same key: cost-batch-<digest>.json. What it settles per
# process is each target's surface (the scheduler asks per round): (id(target), kv_bits) ->
# (a weak reference to the target, its surface).
SURFACES = MeasurementStore("cost-batch")


def surface_path(key: dict):
    return SURFACES.path(key)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    x = max(xs[0], min(x, xs[-1]))
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[0]


@dataclass
class BatchSurface:
    """Seconds of one batched verify forward, per batch size (rows) and width (columns)."""

    batches: list[int]
    widths: list[int]
    seconds: list[list[float]]
    depth: int = DEPTH
    key: dict = field(default_factory=dict)
    measured: bool = True  # False: the default (no numbers: batching as issue 14's CPU runs chose)
    measured_at: str = ""
    measure_s: float = 0.0
    _cells: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def default(cls, key: dict | None = None) -> "BatchSurface":
        return cls([1], [1], [[1.0]], key=dict(key or {}), measured=False)

    def step_seconds(self, batch: int, width: int) -> float:
        """Interpolated seconds of a forward over `batch` sequences of `width` tokens each
        (remembered: the scheduler and every sequence's draft cap ask per round)."""
        cell = self._cells.get((batch, width))
        if cell is None:
            column = [_interp(self.widths, row, width) for row in self.seconds]
            cell = self._cells[batch, width] = _interp(self.batches, column, batch)
        return cell

    def factor(self, batch: int, width: int) -> float:
        """How much dearer a width-w forward is, relative to a plain step, among b decoding
        sequences than alone. Alone it costs S(1,w)/S(1,1) plain steps; in the batch a plain
        step costs S(b,1)/b, and a width-w forward S(b,w)/b if it is batched, else (wider than
        `max_batched_width`) S(1,w), run alone (a plain step too, where none batch). 1 for batch
        1 (or unmeasured)."""
        if batch <= 1 or not self.measured:
            return 1.0
        own = lambda w: (self.step_seconds(batch, w) if self.is_batched(w)  # noqa: E731
                         else batch * self.step_seconds(1, w))
        return (own(width) / own(1)) / (self.step_seconds(1, width) / self.step_seconds(1, 1))

    def padded_width(self, batch: int, width: int) -> int:
        """The width a batched forward of `batch` rows, its widest draft `width`, runs at: the
        widest measured width that measured no dearer. A cell slower than a wider one is capped
        to the wider one's time when measured, so the surface prices such a width as padded;
        this is that padding (padding lies past each row's length: nothing reads it)."""
        if batch < 2 or not self.measured or width not in self.widths:
            return width
        cost = self.step_seconds(batch, width)
        return max(w for w in self.widths if w >= width and self.step_seconds(batch, w) <= cost)

    def saving(self, batch: int, width: int) -> float:
        """The share of forward-seconds batching saves against running the b forwards alone."""
        return 1.0 - self.step_seconds(batch, width) / (batch * self.step_seconds(1, width))

    @functools.cached_property
    def _widest(self) -> int:
        larger = [b for b in self.batches if b > 1]
        best = 0
        for w in range(1, self.widths[-1] + 1) if larger else ():  # between measured widths: interpolated
            # the median over batch sizes: one cell disturbed by other processes doesn't decide
            if statistics.median(self.saving(b, w) for b in larger) < BATCHING_MARGIN:
                break
            best = w
        return best

    def max_batched_width(self) -> int:
        """The widest width (and every narrower one) that batching saves `BATCHING_MARGIN` for,
        the median over measured batch sizes (wider forwards run alone); 0 where even plain steps
        don't gain. Widths between measured ones are judged by the interpolated surface: a
        lookup copy's 17-token forward (a 16-token verbatim draft) batches where the line between
        16 and 32 still saves. On this project's CPU 16 saved 39% and 32 5%: cut at 16, the copy
        rounds of `benchmark --concurrency` chat x4 ran their rows alone, one after another."""
        return self._widest if self.measured else DEFAULT_MAX_BATCHED_WIDTH

    def is_batched(self, width: int) -> bool:
        """Is a width-`width` forward batched? Up to `max_batched_width`; and past the widest
        measured width where that one still batches (a 17-token verbatim copy beside a surface
        measured to 16: what pays at 16 pays at 17)."""
        widest = self.max_batched_width()
        return width <= widest or (self.measured and widest == self.widths[-1])

    def best_max_batch(self, gain: float = BATCH_GAIN) -> int:
        """The largest measured batch whose aggregate tokens per forward-second beats every
        smaller batch chosen before it by `gain`, over the short drafts' widths (those up to
        `SHORT_DRAFT_WIDTH` that are batched: where batching pays most). Where nothing is
        batched, sequences still take turns a step each, at no cost in throughput (every
        forward runs alone either way), so a short side request needn't wait for a long turn:
        then the default."""
        if not self.measured:
            return DEFAULT_MAX_BATCH
        widths = [w for w in self.widths if w <= min(SHORT_DRAFT_WIDTH, self.max_batched_width())]
        if not widths:
            return DEFAULT_MAX_BATCH
        throughput = lambda b: b * len(widths) / sum(self.step_seconds(b, w) for w in widths)  # noqa: E731
        best = self.batches[0]
        for b in self.batches[1:]:
            if throughput(b) >= throughput(best) * (1 + gain):
                best = b
        return best

    def describe(self) -> dict:
        """What the readers take from it, with the numbers: for `tune`, `doctor`, benchmarks."""
        return {"measured": self.measured, "measured_at": self.measured_at, "depth": self.depth,
                "max_batch": self.best_max_batch(), "max_batched_width": self.max_batched_width(),
                "forward_ms": {str(b): {str(w): round(s * 1e3, 3) for w, s in zip(self.widths, row)}
                               for b, row in zip(self.batches, self.seconds)} if self.measured else None,
                "saving": {str(b): {str(w): round(self.saving(b, w), 3) for w in self.widths}
                           for b in self.batches if b > 1} if self.measured else None}

    def to_dict(self) -> dict:
        return {"key": self.key, "batches": self.batches, "widths": self.widths, "seconds": self.seconds,
                "depth": self.depth, "measured": self.measured, "measured_at": self.measured_at,
                "measure_s": self.measure_s, "version": SURFACE_VERSION}

    @classmethod
    def from_dict(cls, d: dict) -> "BatchSurface":
        return cls(batches=[int(b) for b in d["batches"]], widths=[int(w) for w in d["widths"]],
                   seconds=[[float(s) for s in row] for row in d["seconds"]], depth=int(d.get("depth", DEPTH)),
                   key=dict(d.get("key") or {}), measured=bool(d.get("measured", True)),
                   measured_at=str(d.get("measured_at", "")), measure_s=float(d.get("measure_s", 0.0)))


# -- measuring --------------------------------------------------------------------------------


def measure_batch_surface(
    target,
    batches: tuple[int, ...] | list[int] = BATCHES,
    widths: tuple[int, ...] | list[int] = WIDTHS,
    depth: int = DEPTH,
    repeats: int = REPEATS,
    key: dict | None = None,
    kv_bits: int | None = None,
    seed: int = 0,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> BatchSurface:
    """Time the scheduler's batched forward for each batch size and width (median of
    `repeats` whole sweeps), every sequence at `depth` tokens of random context. Where the
    scheduler can't batch the caches (quantised, rotating, recurrent layers) only batch 1 is
    measured: nothing is batched, so the surface says so (widest batched width 0, factor 1)."""
    import mlx.core as mx
    import numpy as np


    batches = sorted(set(int(b) for b in batches))
    widths = sorted(set(int(w) for w in widths))
    if not batches or batches[0] != 1 or not widths or widths[0] != 1:
        raise ValueError("batch surface batches and widths must include 1")
    depth = max(1, min(int(depth), target.context_window - widths[-1] - 1))
    rng = np.random.default_rng(seed)
    t_start = time.perf_counter()
    caches = []
    while len(caches) < batches[-1]:
        cache = fresh_cache(target, kv_bits)
        context = rng.integers(0, target.vocab_size, size=depth).tolist()
        for s in range(0, depth, 512):
            target.forward(context[s:s + 512], cache)
            mx.eval([c.state for c in cache])
        caches.append(cache)
        if not joinable(target, cache):
            batches = [1]
    draws = {w: rng.integers(0, target.vocab_size, size=w).tolist() for w in widths}
    passes = {(b, w): [] for b in batches for w in widths}
    total, done = len(passes) * repeats, 0
    for sweep in range(repeats + 1):  # sweep 0 warms every shape up
        for b in batches:
            group = caches[:b]
            store = BatchCache()  # the rows as the engine holds them (joined once, not per forward)
            for c in group:
                if joinable(target, c):
                    store.join(c)
            for w in widths:
                before = [mark(c) for c in group]
                forwards = [Forward(draws[w], c) for c in group]
                t0 = time.perf_counter()
                run_forwards(target, forwards)  # no surface: all of them in one batch
                mx.eval([mx.argmax(f.result[0], axis=-1) for f in forwards])  # what the verify loop reads
                dt = time.perf_counter() - t0
                for c, m in zip(group, before):
                    take_back(c, m, w, 0, replay=None)
                if sweep:
                    passes[(b, w)].append(dt)
                    done += 1
                    if on_progress:
                        on_progress(f"batch {b} width {w} pass {sweep}/{repeats}", done, total)
            for c in group:
                if store.owns(c):
                    store.leave(c)
    rows = [[statistics.median(passes[(b, w)]) for w in widths] for b in batches]
    # A pass slower than a wider one is priced as the wider one: the batched forward pads to it
    # (`padded_width`). One slower than a pass of more sequences was disturbed: interference only
    # ever adds time (on a loaded CPU one cell measured 947 ms beside 356 ms for twice the rows).
    for j in range(len(rows) - 1, -1, -1):
        row = rows[j]
        for i in range(len(row) - 1, -1, -1):
            wider = row[i + 1] if i + 1 < len(row) else row[i]
            more = rows[j + 1][i] if j + 1 < len(rows) else row[i]
            row[i] = min(row[i], wider, more)
    rows = [[round(s, 7) for s in row] for row in rows]
    return BatchSurface(batches, widths, rows, depth=depth, key=dict(key or {}), measured=True,
                        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        measure_s=round(time.perf_counter() - t_start, 3))


# -- the cache ----------------------------------------------------------------------------------


def load_batch_surface(key: dict) -> BatchSurface | None:
    """The cached surface for exactly this key, or None."""
    d = SURFACES.load(key)
    if d is None or d.get("version") != SURFACE_VERSION:
        return None
    try:
        surface = BatchSurface.from_dict(d)
    except (ValueError, KeyError, TypeError):
        return None
    return surface if surface.measured else None


def save_batch_surface(surface: BatchSurface):
    path = SURFACES.save(surface.to_dict())
    SURFACES.forget()  # every target looks its surface up again
    return path


def tune_batch(target, kv_bits: int | None = None, refresh: bool = False, **measure_kwargs) -> BatchSurface:
    """The cached surface for this target and machine; measured (and cached) if absent or `refresh`."""
    key = curve_key(target, kv_bits)
    return cached_or_measured(lambda: load_batch_surface(key), save=save_batch_surface, refresh=refresh,
                              measure=lambda: measure_batch_surface(target, key=key, kv_bits=kv_bits, **measure_kwargs))


def quick_surface(target, kv_bits: int | None = None) -> BatchSurface:
    """The cached surface, else a quick one measured now and cached; on a slow reference BLAS
    (minutes to measure, and `doctor` says to fix that first) the default."""
    cached = load_batch_surface(curve_key(target, kv_bits))
    if cached is not None:
        return cached
    if share(slow_blas_warning()):
        return BatchSurface.default(curve_key(target, kv_bits))
    try:
        return tune_batch(target, kv_bits, **QUICK)
    except Exception as e:  # a model this can't drive must still serve: with the defaults
        logging.getLogger(__name__).warning("batch cost surface not measured: %s: %s", type(e).__name__, e)
        return BatchSurface.default(curve_key(target, kv_bits))


def surface_for(target, kv_bits: int | None = None) -> BatchSurface:
    """The cached surface, else the default; looked up once per target (the scheduler asks
    per round). Saving a surface forgets what was looked up."""
    memo_key = (id(target), kv_bits)
    held = SURFACES.recall(memo_key)
    if held is None or held[0]() is not target:  # not looked up, or another target under a reused id
        key = curve_key(target, kv_bits)
        held = SURFACES.remember(memo_key, (weakref.ref(target), load_batch_surface(key) or BatchSurface.default(key)))
    return held[1]
