"""Verify forwards of several sequences in one batched forward.

With `--max-batch` > 1 each decoding sequence's round hands its verify forward (the last
token plus its draft) to the scheduler as a `Forward`; the scheduler runs a step's forwards
together where the measured batch cost surface (engine/batch_cost.py) says that pays. Sequences have different depths and draft lengths: their caches are
merged into mlx-lm's left-padded `BatchKVCache`, the inputs right-padded to the longest
draft (a padded position comes after every real one, so causally no real token sees it),
and each sequence's cache is cut back out afterwards, without the padding. Weights are read
once for the batch instead of once per sequence: that is the throughput gain.

Only plain `KVCache`s are merged (quantised, rotating and recurrent caches run alone), and
a batched matmul may round differently from a single row's: outputs equal running alone,
except that a near-tie (top-two logits within rounding) may break the other way.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .batch_cost import BatchSurface
from .state_capture import bind, recording
from .target import Target


@dataclass
class Forward:
    tokens: list[int]
    cache: list
    taps: tuple[int, ...] = ()
    result: tuple | None = None  # (logits (n, vocab), hidden (n, taps*hidden) or None)
    capture: bool = False  # keep recurrent states per position (engine/state_capture.py)
    captured: object = None  # the state_capture.Capture, where the pass could be captured

    def run(self, target: Target) -> None:
        with recording(self.capture) as tape:
            if self.taps:
                self.result = target.forward_tapped(self.tokens, self.cache, self.taps)
            else:
                self.result = (target.forward(self.tokens, self.cache), None)
        self.captured = bind(tape, self.cache, len(self.tokens))


def batchable(f: Forward) -> bool:
    # a cache whose positions are shifted (an M-RoPE image prompt, engine/vision.py) runs alone
    return all(type(c) is KVCache and c.keys is not None and not getattr(c, "position_shift", 0) for c in f.cache)


def run_forwards(target: Target, forwards: list[Forward], surface: BatchSurface | None = None) -> int:
    """Run every forward: those that can share a batch (same taps), as `choose_batch` picks
    them from the measured `surface`, together; the rest alone. Without a surface every
    batchable forward joins (the surface's own measurement). Returns how many ran in a batch."""
    groups: dict[tuple, list[Forward]] = {}
    for f in forwards:
        if batchable(f):
            groups.setdefault(tuple(f.taps), []).append(f)
        else:
            f.run(target)
    batched = 0
    for group in groups.values():
        together = group if surface is None else choose_batch(group, surface)
        for f in group:
            if not any(f is t for t in together):
                f.run(target)
        if len(together) > 1:
            run_batched(target, together)
            batched += len(together)
        elif together:
            together[0].run(target)
    return batched


def choose_batch(group: list[Forward], surface: BatchSurface) -> list[Forward]:
    """The forwards worth one batched forward. Only those up to the surface's widest batched
    width: long drafts (refactors, copies) may keep the machine busy alone, and each batched
    round copies the KV in and out (on CPU, batching them lost: 0.6x with 4 refactor streams,
    while short drafts gained 2-2.7x). Among those, the narrowest n, n chosen to make the step
    cheapest by the measured surface: a batch computes every row at its widest member's width,
    so one long draft among short ones may be cheaper alone. Unmeasured: all that fit."""
    fit = sorted((f for f in group if len(f.tokens) <= surface.max_batched_width()), key=lambda f: len(f.tokens))
    if not surface.measured:
        return fit
    alone = [surface.step_seconds(1, len(f.tokens)) for f in fit]
    best_n, best = 1, sum(alone)
    for n in range(2, len(fit) + 1):
        cost = surface.step_seconds(n, len(fit[n - 1].tokens)) + sum(alone[n:])
        if cost < best:
            best_n, best = n, cost
    return fit[:best_n] if best_n > 1 else []


def run_batched(target: Target, group: list[Forward]) -> None:
    width = max(len(f.tokens) for f in group)
    tokens = mx.array([f.tokens + [0] * (width - len(f.tokens)) for f in group], dtype=mx.uint32)
    n_layers = len(group[0].cache)
    merged = [BatchKVCache.merge([f.cache[i] for f in group]) for i in range(n_layers)]
    taps = group[0].taps
    if taps:
        logits, hidden = target.forward_tapped(tokens, merged, taps)
    else:
        logits, hidden = target.model(tokens, cache=merged), None
    for b, f in enumerate(group):
        pad = width - len(f.tokens)
        for layer, own in zip(merged, f.cache):
            cut = layer.extract(b)
            own.keys, own.values, own.offset = cut.keys, cut.values, cut.offset - pad
        n = len(f.tokens)
        f.result = (logits[b, :n], None if hidden is None else hidden[b, :n])
