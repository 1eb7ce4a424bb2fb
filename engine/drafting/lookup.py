"""Match-scaled lookup drafting: propose what followed the longest earlier match.

Agents re-emit code that is already in their prompt. The index maps every 2-, 4-
and 8-gram of the context (and of any extra corpus) to where it ends; a query
extends the candidates backwards to the true match length, and the longer the
match, the longer the draft. A gate halves the allowed length after a long draft is
mostly rejected and doubles it back after full acceptances.
"""

from __future__ import annotations

from array import array
from concurrent.futures import Future, ThreadPoolExecutor

from engine.caches.radix_tree import common_prefix
from engine.drafting.drafter import Draft, Drafter

NGRAM_SIZES = (8, 4, 2)  # probe the most specific first
MAX_CANDIDATES = 16  # most recent occurrences examined per query
MAX_MATCH = 64  # backward extension limit
WIDEST = max(NGRAM_SIZES)
TOKEN_BITS = 32  # a token id's room in a packed n-gram key
_MASKS = {n: (1 << (TOKEN_BITS * n)) - 1 for n in NGRAM_SIZES}
# Continues (or rebuilds) a request's context index while its prefill runs: MLX computes without
# the GIL, so the first token doesn't wait for the index (after a long divergent reply, rebuilding
# 15k tokens' n-grams takes a few hundred ms on a slow CPU). One worker: takes never overlap.
_INDEXER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookup-index")


def pack(tokens: list[int]) -> int:
    """An n-gram as one int, the last token in the lowest bits (as `TokenIndex.extend` rolls it)."""
    key = 0
    for t in tokens:
        key = (key << TOKEN_BITS) | t
    return key


def draft_length_for_match(match_len: int) -> int:
    """Short drafts for short matches, long drafts for long verbatim runs."""
    if match_len < 2:
        return 0
    if match_len < 4:
        return 2 * match_len - 2  # 2 -> 2, 3 -> 4
    if match_len < 8:
        return 8
    if match_len < 16:
        return 16
    if match_len < 32:
        return 32
    return 64


class TokenIndex:
    """A token sequence with an incremental n-gram index: for each n, the last end of every
    n-gram (`heads`) and, for every end, the one before it of the same n-gram (`prev`, -1: none).

    Keys are an n-gram's tokens packed into one int (`pack`), values ints, the chains one array per
    n: a handful of objects the garbage collector tracks, where a dict of tuples to lists made ~80k
    for a 38k-token prompt, walked by every full collection (100-300 ms on a server's engine
    thread every few agent turns)."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        self.heads: dict[int, dict[int, int]] = {n: {} for n in NGRAM_SIZES}
        self.prev: dict[int, array] = {n: array("i") for n in NGRAM_SIZES}
        self.extend(tokens or [])

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        packed = pack(self.tokens[-WIDEST:])
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens) - 1
            packed = ((packed << TOKEN_BITS) | t) & _MASKS[WIDEST]
            for n in NGRAM_SIZES:
                if end + 1 < n:  # no n-gram ends here yet
                    self.prev[n].append(-1)
                    continue
                heads, key = self.heads[n], packed & _MASKS[n]
                self.prev[n].append(heads.get(key, -1))
                heads[key] = end

    def truncate(self, n: int) -> None:
        """Forget every token from position n on (each of their n-grams' chains goes back a link)."""
        for end in range(len(self.tokens) - 1, n - 1, -1):
            for size in NGRAM_SIZES:
                if end + 1 >= size:
                    key, before = pack(self.tokens[end - size + 1 : end + 1]), self.prev[size][end]
                    if before < 0:
                        del self.heads[size][key]
                    else:
                        self.heads[size][key] = before
        del self.tokens[n:]
        for chain in self.prev.values():
            del chain[n:]

    def best_match(self, suffix: list[int], exclude_end: int | None = None) -> tuple[int, int, int]:
        """(draft length, match length, end position) of the best earlier occurrence of
        `suffix`'s tail: the one allowing the longest draft (its match length scaled,
        bounded by what follows it), then the longest match, then the most recent.
        """
        best = (0, 0, -1)
        for n in NGRAM_SIZES:
            if len(suffix) < n:
                continue
            end, chain, examined = self.heads[n].get(pack(suffix[-n:]), -1), self.prev[n], 0
            while end >= 0 and examined < MAX_CANDIDATES:  # the most recent first
                if end != exclude_end and end + 1 < len(self.tokens):
                    m = self._match_length(suffix, end)
                    usable = min(draft_length_for_match(m), len(self.tokens) - end - 1)
                    if (usable, m) > best[:2]:
                        best = (usable, m, end)
                    examined += 1
                end = chain[end]
            if best[0]:
                return best
        return best

    def _match_length(self, suffix: list[int], end: int) -> int:
        limit = min(MAX_MATCH, end + 1, len(suffix))
        m = 0
        while m < limit and self.tokens[end - m] == suffix[-1 - m]:
            m += 1
        return m


class ContextIndexCache:
    """The last request's context index, continued by the next prompt instead of rebuilt.

    An agent's next prompt is the last one plus a reply and a tool result: the index of
    the shared start is kept, the rest cut and the new tokens added. A drafter takes the
    index for its request and gives it back when done, so two requests never share one."""

    def __init__(self):
        self.index: TokenIndex | None = None

    def index_for(self, tokens: list[int]) -> TokenIndex:
        index, self.index = self.index, None
        if index is None:
            return TokenIndex(tokens)
        m = common_prefix(index.tokens, tokens)
        if (len(index) - m) + (len(tokens) - m) >= len(tokens):  # cheaper to start over
            return TokenIndex(tokens)
        index.truncate(m)
        index.extend(tokens[m:])
        return index

    def keep(self, index: TokenIndex) -> None:
        self.index = index


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, corpus: "list[list[int] | TokenIndex] | None" = None, min_limit: int = 2):
        # documents may come indexed already (the engine's corpus: indexed once, on arrival)
        self.corpus = [doc if isinstance(doc, TokenIndex) else TokenIndex(doc) for doc in (corpus or []) if len(doc) > 1]
        self._context = TokenIndex()
        self._pending: Future | None = None  # the context index, being built off this thread
        self.min_limit = min_limit
        self.limit = 1 << 30  # the gate; the caller's cap bounds it too
        self.contexts: ContextIndexCache | None = None

    @property
    def context(self) -> TokenIndex:
        """The request's context so far, indexed (waits for the index started by `start`)."""
        if self._pending is not None:
            self._context, self._pending = self._pending.result(), None
        return self._context

    def use_context_cache(self, contexts: ContextIndexCache) -> None:
        self.contexts = contexts

    def start(self, prompt_ids: list[int]) -> None:
        self.limit = 1 << 30
        if self.contexts is None:
            self._context, self._pending = TokenIndex(prompt_ids), None
        else:
            self._pending = _INDEXER.submit(self.contexts.index_for, list(prompt_ids))

    def finish(self) -> None:
        if self.contexts is not None:
            self.contexts.keep(self.context)
            self._context = TokenIndex()

    def add_corpus(self, doc: list[int]) -> None:
        if len(doc) > 1:
            self.corpus.append(TokenIndex(doc))

    def propose(self, max_len: int, gated: bool = True) -> Draft:
        """The continuation of the best match, as long as the match allows (`draft_length_for_match`),
        `max_len` and, when `gated`, the gate."""
        if max_len <= 0 or len(self.context) < 2:
            return Draft([])
        return Draft(self._follow(self.context.tokens[-MAX_MATCH:], max_len, gated, len(self.context) - 1))

    def continue_after(self, tokens: list[int], max_len: int) -> list[int]:
        """What the best match drafts after the context plus `tokens` (not committed: a draft's
        forced tokens, engine/decoding/grammar.py), gated as `propose` is."""
        if max_len <= 0 or not tokens:
            return []
        return self._follow((self.context.tokens[-MAX_MATCH:] + list(tokens))[-MAX_MATCH:], max_len, True, None)

    def _follow(self, suffix: list[int], max_len: int, gated: bool, context_end: int | None) -> list[int]:
        """The continuation of `suffix`'s best match in the context and corpus (`context_end`:
        the suffix's own place in the context, never its match)."""
        best, source = (0, 0, -1), None
        for index in [self.context, *self.corpus]:
            exclude = context_end if index is self.context else None
            found = index.best_match(suffix, exclude_end=exclude)
            if found[:2] > best[:2]:
                best, source = found, index
        usable, _, end = best
        n = min(usable, max_len, self.limit if gated else max_len)
        if n <= 0 or source is None:
            return []
        return source.tokens[end + 1 : end + 1 + n]

    def commit(self, tokens: list[int], drafted: int, accepted: int, hidden=None) -> None:
        self.context.extend(tokens)
        if drafted >= 4 and accepted < drafted // 2:
            self.limit = max(self.min_limit, min(self.limit, drafted) // 2)
        elif drafted > 0 and accepted == drafted:
            self.limit = min(1 << 30, max(self.limit, drafted) * 2)
