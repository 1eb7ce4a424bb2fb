"""What every drafter gives the verify loop.

A drafter proposes tokens to follow the committed context; the verify loop checks
them with one target forward and tells the drafter what was committed. Drafter
heads that read the target's hidden states name the layers they need in
`tap_layers`; the loop then hands them those states for the committed positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Draft:
    tokens: list[int]
    # The drafter's distribution for each proposed token, (len(tokens), vocab);
    # None for deterministic drafts (lookup), which speculative sampling treats as one-hot.
    q: np.ndarray | None = None
    # A verbatim copy of earlier text (a long lookup match): it may run past the round's
    # adaptive cap up to the hard one, since its acceptance doesn't follow the cap's model.
    verbatim: bool = False
    source: str = ""  # who proposed it when a drafter mixes sources (a head's lookup override); "": the drafter


class Drafter:
    name = "none"
    tap_layers: tuple[int, ...] = ()

    def set_sampling(self, sampling) -> None:
        """The request's SamplingParams, before the first round: a drafter that samples its
        draft reports the distribution it drew from as Draft.q, keeping verification exact."""

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation begins with this prompt (all of it is committed context)."""

    def use_context_cache(self, contexts) -> None:
        """The engine's lookup.ContextIndexCache: a lookup index to continue, not rebuild."""

    def finish(self) -> None:
        """The generation ended normally: hand back what the next one may continue."""

    def propose(self, max_len: int) -> Draft:
        """At most max_len tokens; only a `verbatim` draft may be longer (the loop bounds it)."""
        return Draft([])

    def continue_after(self, tokens: list[int], max_len: int) -> list[int]:
        """A deterministic continuation of the context plus `tokens` (a grammar's forced tokens,
        not committed), at most max_len; none by default (lookup has one)."""
        return []

    def plan(self, max_len: int):
        """`propose`, or a part left for the caller to run batched with other sequences' (a
        head's `HeadCall`, engine/drafting/heads/drafter.py); the drafter's `take(part)` then gives the Draft."""
        return self.propose(max_len)

    def commit(self, tokens: list[int], drafted: int, accepted: int, hidden=None) -> None:
        """`tokens` were appended to the context; `accepted` of `drafted` draft tokens held."""
