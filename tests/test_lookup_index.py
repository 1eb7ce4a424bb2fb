"""The lookup index against a plain scan of the context, and what it costs the garbage collector."""

from __future__ import annotations

import gc
import random

from engine.drafting.lookup import MAX_CANDIDATES, NGRAM_SIZES, TokenIndex, draft_length_for_match


def scanned_best_match(tokens: list[int], suffix: list[int], exclude_end: int | None) -> tuple[int, int, int]:
    """best_match's rule by brute force: for the longest n-gram size with a usable occurrence, the
    MAX_CANDIDATES most recent occurrences (not the excluded end, not the context's last token)
    ranked by draft length, then match length, then recency."""
    for n in NGRAM_SIZES:
        if len(suffix) < n:
            continue
        ends = [e for e in range(len(tokens) - 2, n - 2, -1)
                if tokens[e - n + 1 : e + 1] == suffix[-n:] and e != exclude_end][:MAX_CANDIDATES]
        best = (0, 0, -1)
        for e in ends:
            m = 0
            while m < min(64, e + 1, len(suffix)) and tokens[e - m] == suffix[-1 - m]:
                m += 1
            usable = min(draft_length_for_match(m), len(tokens) - e - 1)
            if (usable, m) > best[:2]:
                best = (usable, m, e)
        if best[0]:
            return best
    return (0, 0, -1)


def test_best_match_is_the_scan_through_extends_and_truncations():
    rng = random.Random(7)
    for trial in range(12):
        vocab = rng.choice([3, 8, 50, 1 << 31])  # few symbols: long chains; ids up to 2^31
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(50, 400))]
        index = TokenIndex(tokens)
        for _ in range(15):
            if rng.random() < 0.4:
                cut = rng.randrange(0, len(tokens) + 1)
                index.truncate(cut)
                del tokens[cut:]
            more = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
            index.extend(more)
            tokens += more
            assert index.tokens == tokens
            for _ in range(10):
                if not tokens:
                    break
                at = rng.randrange(len(tokens))
                suffix = tokens[max(0, at - 70) : at + 1]
                exclude = rng.choice([None, at])
                assert index.best_match(suffix, exclude) == scanned_best_match(tokens, suffix, exclude)


def test_an_index_gives_the_garbage_collector_nothing_to_walk():
    """Dicts of tuples to lists made ~80k tracked objects for a 38k-token prompt, walked by every
    full collection on the engine thread; ints and arrays make a handful."""
    rng = random.Random(1)
    tokens = [rng.randrange(2000) for _ in range(20_000)]
    gc.collect()
    before = len(gc.get_objects())
    index = TokenIndex(tokens)
    index.truncate(15_000)
    index.extend(tokens[:3000])
    assert len(gc.get_objects()) - before < 50
    assert index.best_match(tokens[:40], None)[0] > 0  # the repeat is found
