"""Tokenise a rendered chat by its pieces, encoding only the pieces not seen before.

An agent re-sends the whole conversation every turn (a 15k-token prompt for a turn
that adds 200 tokens). The chat template renders each message as a run of text that
starts with a special token (`<|im_start|>` for ChatML). Hugging Face tokenizers split
the text at special tokens before anything else, so the ids of the whole text are the
ids of its pieces, concatenated: each piece is encoded once and remembered (LRU,
bounded by characters).

That holds for the tokenizers seen here but not for every one (a pre-tokenizer that
prepends a space only to the first piece, a special token that strips the whitespace
before it), so the equality is checked against a full encode: on a probe chat when the
encoder is made, and on the first real prompts. Any difference turns the piece path
off for good (one log line) and every prompt is encoded whole.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from typing import Any

log = logging.getLogger(__name__)

MAX_CACHED_CHARS = 8_000_000  # about 2M tokens of pieces
CHECKS = 1  # real prompts also encoded whole and compared (the first: a cold turn anyway)


class PieceEncoder:
    def __init__(self, tokenizer: Any, max_chars: int = MAX_CACHED_CHARS, checks: int = CHECKS):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.checks_left = checks
        self.pieces: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self.chars = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self.splitter = _splitter(tokenizer)
        if self.splitter is not None and not self._probe_ok():
            log.info("piece tokenising off for this tokenizer: pieces don't encode like the whole")
            self.splitter = None

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added), equal to tokenizer.encode(text)."""
        if self.splitter is None:
            return self._full(text)
        with self._lock:
            ids = self._by_pieces(text)
            if self.checks_left > 0:
                self.checks_left -= 1
                if ids != self._full(text):
                    log.warning("piece tokenising off: a prompt's pieces encoded differently from the whole")
                    self.splitter = None
                    self.pieces.clear()
                    return self._full(text)
        return ids

    def _full(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _by_pieces(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.splitter.split(text):
            if not piece:
                continue
            ids = self.pieces.get(piece)
            if ids is None:
                self.misses += 1
                ids = tuple(self._full(piece))
                self._remember(piece, ids)
            else:
                self.hits += 1
                self.pieces.move_to_end(piece)
            out.extend(ids)
        return out

    def _remember(self, piece: str, ids: tuple[int, ...]) -> None:
        if len(piece) > self.max_chars:
            return
        self.pieces[piece] = ids
        self.chars += len(piece)
        while self.chars > self.max_chars:
            old, _ = self.pieces.popitem(last=False)
            self.chars -= len(old)

    def _probe_ok(self) -> bool:
        """Pieces of a small chat with awkward whitespace and text encode as the whole does."""
        specials = _split_tokens(self.tokenizer)
        body = ["  leading spaces", "trailing  \n\n", "\tTab and ünïcödé → ✓", "x", "\n", " {\"a\": 1}  "]
        text = "".join(f"{s}{b}" for s in specials[:4] for b in body) + "plain end " + "".join(specials[:2])
        text = "start " + text
        try:
            return self._by_pieces(text) == self._full(text)
        finally:
            self.pieces.clear()
            self.chars = 0
            self.hits = self.misses = 0


def _split_tokens(tokenizer: Any) -> list[str]:
    """Special added tokens that split text and keep the whitespace before them."""
    try:
        added = tokenizer.added_tokens_decoder
    except Exception:
        return []
    out = []
    for tok in added.values():
        content = getattr(tok, "content", None)
        if content and getattr(tok, "special", False) and not getattr(tok, "lstrip", False):
            out.append(content)
    return sorted(set(out), key=len, reverse=True)


def _splitter(tokenizer: Any) -> re.Pattern | None:
    specials = _split_tokens(tokenizer)
    if not specials:
        return None
    return re.compile("(?=" + "|".join(re.escape(s) for s in specials) + ")")
