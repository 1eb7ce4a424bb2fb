"""Degenerate loops in committed output: one short n-gram repeated over and over.

A small model can fall into a loop (one token, or one line, forever) and fill the whole
context window with it; an agent then gets a reply it can't use and a next prompt that
no longer fits. `LoopGuard` ends such a generation: it reads only committed tokens, so
drafting never changes what it sees and output before the cut is the target's own.
`repeated_share` measures the same thing after the fact, so benchmarks can flag an
output whose speedup is mostly the drafter copying a loop.

Both rest on one fact: a stretch of tokens is one n-gram of p tokens repeated exactly
when every token in it equals the token p places earlier.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW = 256  # committed tokens of one repeated n-gram that end a generation
MAX_PERIOD = 32  # longest n-gram counted as a loop (a short line of code)
DEGENERATE_SHARE = 0.5  # benchmark outputs with at least this share in loops are flagged


class LoopGuard:
    """Feed committed tokens one by one; `add` says when the last `window` are a loop."""

    def __init__(self, window: int = DEFAULT_WINDOW, max_period: int = MAX_PERIOD):
        if window < 2:
            raise ValueError(f"the loop guard's window must be at least 2 tokens, not {window}")
        self.window = window
        self.max_period = min(max_period, window // 2)  # a loop shows its n-gram at least twice
        self.recent: deque[int] = deque(maxlen=self.max_period + 1)
        # run[p]: how many of the latest tokens each equal the token p places before them
        self.run = [0] * (self.max_period + 1)
        self.period = 0  # the n-gram's length once a loop is found

    def add(self, token: int) -> bool:
        self.recent.append(token)
        n = len(self.recent)
        for p in range(1, self.max_period + 1):
            if n > p and self.recent[-1] == self.recent[-1 - p]:
                self.run[p] += 1
                # The last `window` tokens have period p: the first p start the n-gram.
                if self.run[p] >= self.window - p and not self.period:
                    self.period = p
            else:
                self.run[p] = 0
        return bool(self.period)

    def note(self) -> str:
        return (f"loop guard: the last {self.window} tokens repeat one {self.period}-token n-gram; "
                "generation ended as if max_tokens was reached")


def repeated_share(tokens: list[int], min_length: int = 32, max_period: int = MAX_PERIOD) -> float:
    """The share of `tokens` inside loops: stretches of at least `min_length` tokens (and
    three repeats) that are one n-gram of at most `max_period` tokens repeated."""
    n = len(tokens)
    if n == 0:
        return 0.0
    covered = bytearray(n)
    for p in range(1, max_period + 1):
        start = None  # first i of the current run of tokens[i] == tokens[i - p]
        for i in range(p, n + 1):
            if i < n and tokens[i] == tokens[i - p]:
                if start is None:
                    start = i
                continue
            if start is not None:
                first = start - p  # the run's first n-gram starts here
                if i - first >= max(min_length, 3 * p):
                    covered[first:i] = b"\x01" * (i - first)
                start = None
    return sum(covered) / n
