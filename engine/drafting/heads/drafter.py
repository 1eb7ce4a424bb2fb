"""The Drafter that runs a DFlash or DSpark head inside the shared verify loop.

Context features arrive from the target's own forwards: prefill chunks through
`observe_prefill` (only the part that was not served from the prefix cache: the head
then sees a recent window) and, each round, the states of the tokens that entered the
cache through `commit`. They are turned into the head's per-layer keys and values
lazily, at the next head draft. A long lookup match replaces the head's draft for that
round, so copy-heavy turns keep lookup's speed.

Drafting is batched across sequences: `plan` returns the head's part of a round as a
`HeadCall`, and `draft_together` runs the calls of one head as one draft (the rows' new
context features in one projection, one head forward, one walk over all rows; each row
attends over its own context, so rows of different lengths need no padding). A single
sequence's `propose` is the same path with one row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.base.sampling import SamplingParams
from engine.drafting.drafter import Draft, Drafter
from engine.drafting.heads.backbone import ContextCache, DraftRow
from engine.drafting.lookup import LookupDrafter

DEFAULT_CONTEXT_LIMIT = 4096  # most recent context positions the head attends to
LOOKUP_OVERRIDE = 8  # a verbatim lookup match this long replaces the head's draft for the round
LOOKUP_QUERY = 64  # the longest draft lookup may make for the override


@dataclass
class HeadCall:
    """One sequence's head draft, planned; `draft_together` fills `result` (or `error`)."""

    drafter: "HeadDrafter"
    row: DraftRow  # its `ctx` is set by draft_together, once the pending context is in
    result: tuple[list[int], np.ndarray | None] | None = None
    error: Exception | None = None


def draft_together(target, calls: list[HeadCall]) -> int:
    """Run the calls: those of one head as one batched draft (their new context features in
    one projection, one head forward, one walk for all rows). Should a batched draft fail,
    each row drafts alone, so one row's fault stays its own. Returns how many calls were
    drafted in a batch."""
    groups: dict[int, list[HeadCall]] = {}
    for c in calls:
        groups.setdefault(id(c.drafter.head), []).append(c)
    batched = 0
    for group in groups.values():
        try:
            _draft(target, group)
            batched += len(group) if len(group) > 1 else 0
            continue
        except Exception as e:
            if len(group) == 1:
                group[0].error = e
                continue
            logging.getLogger(__name__).warning("batched head draft failed, drafting rows alone: %s: %s",
                                                type(e).__name__, e)
        for c in group:
            try:
                _draft(target, [c])
            except Exception as e:
                c.error = e
    return batched


def _draft(target, calls: list[HeadCall]) -> None:
    flush_together([c.drafter for c in calls])
    for c in calls:
        c.row.ctx = c.drafter.ctx.kv
    for c, result in zip(calls, calls[0].drafter.head.draft_rows(target, [c.row for c in calls])):
        c.result = result


def flush_together(drafters: list["HeadDrafter"]) -> None:
    """Every drafter's pending context features (all one head's) into its context keys and
    values, in one projection; a drafter's pending features stay where the projection fails."""
    chunks = [(d, chunk) for d in drafters for chunk in d.pending_chunks()]
    if chunks:
        kvs = drafters[0].head.context_kvs([chunk for _, chunk in chunks])
        for (d, _), kv in zip(chunks, kvs):
            d.ctx.add(kv)
    for d in drafters:
        d.pending = []


class HeadDrafter(Drafter):
    def __init__(self, head, target, corpus: list[list[int]] | None = None,
                 lookup_override: bool = True, context_limit: int | None = DEFAULT_CONTEXT_LIMIT):
        self.head, self.target = head, target
        self.name = head.kind
        self.tap_layers = tuple(head.cfg.target_layer_ids)
        self.lookup = LookupDrafter(corpus=corpus) if lookup_override else None
        self.context_limit = context_limit
        self.sampling = SamplingParams()
        self.rng = np.random.default_rng()
        self.start([])

    def set_sampling(self, sampling: SamplingParams) -> None:
        """Draw drafts from the head's own distribution at the request's settings (q stays exact)."""
        self.sampling = sampling
        self.rng = np.random.default_rng(None if sampling.seed is None else [sampling.seed, 0x6472])

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.ctx = ContextCache(self.context_limit)
        self.prefill_chunks: list[mx.array] = []
        self.pending: list[tuple[mx.array, int]] = []  # (features, absolute position of the first row)
        self.source = None
        if self.lookup is not None:
            self.lookup.start(prompt_ids)

    def use_context_cache(self, contexts) -> None:
        if self.lookup is not None:
            self.lookup.use_context_cache(contexts)

    def finish(self) -> None:
        if self.lookup is not None:
            self.lookup.finish()

    def observe_prefill(self, hidden: mx.array) -> None:
        self.prefill_chunks.append(hidden)
        # Positions are counted back from the prompt's end, so the oldest chunks can go as
        # soon as the window is full without them (a 30k-token prompt keeps ~limit rows).
        limit = self.context_limit
        while limit and sum(int(c.shape[0]) for c in self.prefill_chunks[1:]) >= limit:
            self.prefill_chunks.pop(0)

    def commit(self, tokens: list[int], drafted: int, accepted: int, hidden=None) -> None:
        self._place_prefill()
        if hidden is not None and hidden.shape[0]:
            self.pending.append((hidden, len(self.tokens) - 1))  # from the old anchor on
        self.tokens.extend(tokens)
        if self.lookup is not None:
            mine = self.source == "lookup"
            self.lookup.commit(tokens, drafted if mine else 0, accepted if mine else 0)

    def propose(self, max_len: int) -> Draft:
        draft = self.plan(max_len)
        if isinstance(draft, HeadCall):
            draft_together(self.target, [draft])  # alone: a batch of one row
            draft = self.take(draft)
        return draft

    def plan(self, max_len: int) -> "Draft | HeadCall":
        """This round's draft where it needs no head (a lookup override, nothing), else the
        head's part of it as a `HeadCall`, for `draft_together` to run with other sequences'."""
        self.source = None
        if not self.tokens:
            return Draft([])
        if self.lookup is not None:
            # Lookup drafts 2 x LOOKUP_OVERRIDE tokens or more only for a verbatim match of
            # LOOKUP_OVERRIDE+ tokens. Such a draft is verbatim: the loop lets it run past an
            # adaptive cap tuned to the head's acceptance (up to the hard cap), and even when
            # that cap has turned head drafting off. The match decides, not lookup's gate: a
            # gate shut below that length by rejected drafts would never open again (it learns
            # only from rounds lookup drafts); the gate only shortens the draft, to no less.
            found = self.lookup.propose(LOOKUP_QUERY, gated=False)
            if len(found.tokens) >= 2 * LOOKUP_OVERRIDE:
                self.source = "lookup"
                n = max(2 * LOOKUP_OVERRIDE, self.lookup.limit)
                return Draft(found.tokens[:n], verbatim=True, source="lookup")
        if max_len <= 0:
            return Draft([])
        position = len(self.tokens) - 1  # the anchor's: every earlier token is in the target's cache
        return HeadCall(self, DraftRow(self.tokens[-1], None, position, max_len, self.sampling, self.rng))

    def take(self, call: "HeadCall") -> Draft:
        """The draft of a planned call, once `draft_together` has run it."""
        if call.error is not None:
            raise call.error
        tokens, q = call.result
        self.source = "head"
        return Draft(tokens, q)

    def _place_prefill(self) -> None:
        # Prefill chunks are contiguous and end just before the prompt's last token.
        if self.prefill_chunks:
            start = self.prompt_len - 1 - sum(int(c.shape[0]) for c in self.prefill_chunks)
            for c in self.prefill_chunks:
                self.pending.append((c, start))
                start += int(c.shape[0])
            self.prefill_chunks = []

    def pending_chunks(self) -> list[tuple[mx.array, int]]:
        """The context features not yet in the head's context, (features, position), oldest first."""
        self._place_prefill()
        oldest = len(self.tokens) - 1 - (self.context_limit or 1 << 62)
        chunks = []
        for feats, pos in self.pending:
            skip = max(0, oldest - pos)  # rows older than the window would be dropped anyway
            if skip < feats.shape[0]:
                chunks.append((feats[skip:], pos + skip))
        return chunks

    def _flush(self) -> None:
        flush_together([self])
