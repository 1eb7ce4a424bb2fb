"""The lookup drafter continues its context index off the engine thread: `start` returns at once
(the prefill runs meanwhile) and the first draft uses the finished index."""

from __future__ import annotations

import threading

from engine.drafting.lookup import ContextIndexCache, LookupDrafter


class HeldIndexCache(ContextIndexCache):
    """Index building held until the test lets it go: shows where `start` would have waited."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()
        self.built_on: str | None = None

    def index_for(self, tokens):
        self.go.wait(30)
        self.built_on = threading.current_thread().name
        return super().index_for(tokens)


def test_start_does_not_wait_for_the_index_and_the_first_draft_uses_it():
    contexts = HeldIndexCache()
    drafter = LookupDrafter()
    drafter.use_context_cache(contexts)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    drafter.start(prompt)  # returns although the index is still held
    assert contexts.built_on is None
    contexts.go.set()
    assert drafter.propose(4).tokens == [4, 5, 6, 7]  # what followed the earlier 1 2 3
    assert contexts.built_on != threading.current_thread().name


def test_the_next_request_continues_the_kept_index():
    contexts = ContextIndexCache()
    drafter = LookupDrafter()
    drafter.use_context_cache(contexts)
    drafter.start([5, 6, 7, 8, 9])
    drafter.commit([10, 11], drafted=0, accepted=0)
    drafter.finish()
    kept = contexts.index
    assert kept is not None and kept.tokens == [5, 6, 7, 8, 9, 10, 11]
    drafter.start([5, 6, 7, 8, 9, 10, 11, 5, 6])
    assert drafter.context is kept  # continued, not rebuilt
    assert drafter.propose(3).tokens == [7, 8]  # a 2-token match drafts 2
