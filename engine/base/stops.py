"""Committed tokens -> text deltas, honouring stop strings and EOS.

Text that might be the start of a stop string is held back until it is known not to
be, so nothing past a stop string is ever emitted, even when the stop string spans
two rounds or two tokens.
"""

from __future__ import annotations

from typing import Any


class TextAssembler:
    def __init__(self, tokenizer: Any, stop: list[str] | tuple[str, ...] = ()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = [s for s in stop if s]
        self.released = 0  # characters of detokenizer.text already emitted
        self.stop_string: str | None = None
        self.text = ""  # everything emitted so far

    def add(self, token: int) -> tuple[str, bool]:
        """Feed one token; returns (new text safe to emit, whether a stop string ended it)."""
        self.detokenizer.add_token(token)
        return self._release(self.detokenizer.text, final=False)

    def finish(self) -> str:
        """No more tokens: flush what was held back (no stop string completed)."""
        if self.stop_string is not None:
            return ""
        self.detokenizer.finalize()
        delta, _ = self._release(self.detokenizer.text, final=True)
        return delta

    def _release(self, full: str, final: bool) -> tuple[str, bool]:
        if self.stop:
            longest = max(len(s) for s in self.stop)
            window_start = max(0, self.released - longest + 1)
            hits = [(full.find(s, window_start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stop_string = s
                return self._emit(full[self.released : max(i, self.released)]), True
            if not final:
                hold = _partial_stop_overlap(full, self.stop)
                return self._emit(full[self.released : len(full) - hold]), False
        return self._emit(full[self.released :]), False

    def _emit(self, delta: str) -> str:
        self.released += len(delta)
        self.text += delta
        return delta


def _partial_stop_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
