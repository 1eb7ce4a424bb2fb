"""Verify forwards of several sequences in one batched forward.

With `--max-batch` > 1 each decoding sequence's round hands its verify forward (the last
token plus its draft) to the scheduler as a `Forward`; the scheduler runs a step's forwards
together where the measured batch cost surface (engine/tuning/batch_cost.py) says that pays. The
sequences' KV already lives in one persistent `BatchCache` (engine/caches/batch_cache.py: joined
once, when a second sequence's forward could share one; a row each with its own length), so a
batched round is one forward over the rows with the inputs right-padded to the longest draft
(ragged drafts, verbatim copies included: a padded position comes after every real one, so
causally no real token sees it, and it lies past its row's length afterwards) and no KV copy.
Weights are read once for the batch instead of once per sequence: that is the throughput gain.

Only plain `KVCache`s join a batch (quantised, rotating and recurrent caches run alone), and
a batched matmul may round differently from a single row's: outputs equal running alone,
except that a near-tie (top-two logits within rounding) may break the other way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from engine.caches.batch_cache import BatchCache, batch_of
from engine.caches.state_capture import bind, recording
from engine.model.target import Target


@dataclass
class Forward:
    tokens: list[int]
    cache: list
    taps: tuple[int, ...] = ()
    result: tuple | None = None  # (logits (n, vocab), hidden (n, taps*hidden) or None)
    capture: bool = False  # keep recurrent states per position (engine/caches/state_capture.py)
    captured: object = None  # the state_capture.Capture, where the pass could be captured
    picks: Callable[[], list[int]] | None = None  # the greedy picks per position, where a batch reads them for all rows

    def run(self, target: Target) -> None:
        with recording(self.capture) as tape:
            if self.taps:
                self.result = target.forward_tapped(self.tokens, self.cache, self.taps)
            else:
                self.result = (target.forward(self.tokens, self.cache), None)
        self.captured = bind(tape, self.cache, len(self.tokens))


def run_forwards(target: Target, forwards: list[Forward], surface=None) -> int:
    """Run every forward: those of one batch's rows (same taps), as `choose_batch` picks them
    from the measured `surface`, in one batched forward; the rest alone. Without a surface every
    row's forward joins (the surface's own measurement). Returns how many ran in a batch."""
    groups: dict[tuple, tuple[BatchCache, list[Forward]]] = {}
    for f in forwards:
        store = batch_of(f.cache)
        if store is None:
            f.run(target)
        else:
            groups.setdefault((id(store), tuple(f.taps)), (store, []))[1].append(f)
    batched = 0
    for store, group in groups.values():
        together = group if surface is None else choose_batch(group, surface, store.used)
        for f in group:
            if not any(f is t for t in together):
                f.run(target)  # its row alone
        if len(together) > 1 and not store.failed:
            try:
                widest = max(len(f.tokens) for f in together)
                store.forward(target, together, surface.padded_width(store.used, widest) if surface else None)
                batched += len(together)
                continue
            except Exception as e:  # a model this batched forward doesn't fit: its rows run alone from now on
                store.failed = f"{type(e).__name__}: {e}"
                logging.getLogger(__name__).warning("batched verify failed, running sequences alone: %s", store.failed)
        for f in together:
            f.run(target)
    return batched


def choose_batch(group: list[Forward], surface, rows: int | None = None) -> list[Forward]:
    """The forwards worth one batched forward, `rows` being how many rows that forward computes
    (a batch's every row: those without a forward compute padding; default: the group's size).
    Only widths the surface says batch (long drafts may keep the machine busy alone). Among
    those, the narrowest n, n chosen to make the step cheapest by the measured surface: the
    batch computes every row at its widest member's width, so one long draft among short ones
    may be cheaper alone. Unmeasured: all that fit."""
    fit = sorted((f for f in group if surface.is_batched(len(f.tokens))), key=lambda f: len(f.tokens))
    if not surface.measured:
        return fit
    alone = [surface.step_seconds(1, len(f.tokens)) for f in fit]
    best_n, best = 1, sum(alone)
    for n in range(2, len(fit) + 1):
        cost = surface.step_seconds(max(n, rows or 0), len(fit[n - 1].tokens)) + sum(alone[n:])
        if cost < best:
            best_n, best = n, cost
    return fit[:best_n] if best_n > 1 else []
