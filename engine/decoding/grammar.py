"""Constrained decoding: the reply kept to a grammar (a JSON schema, any JSON) by llguidance.

A request carries a `Constraint` (the grammar, checked when it is made); the engine compiles it
per generation into a `GrammarState` over the model's tokenizer (`Grammars`, one per model).
The state masks the target's logits before every pick: at each position of a verify pass the
matcher is advanced through the drafted tokens (one mask per position) and rolled back with
the rejected ones, so greedy output equals constrained plain decoding token for token and
sampling keeps the constrained distribution (engine/decoding/verify.py). Where the grammar
allows one continuation only (keys, punctuation, closing braces) those tokens are the draft,
for free (`shape_draft`).

llguidance (Rust, no torch) was picked over xgrammar, whose wheel requires torch,
transformers and triton; its mask costs ~0.03 ms a token on the bundled 8k vocabulary
(scripts/bench_structured.py measures it, on a 150k one too).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from engine.base.errors import InvalidRequestError


# JSON as json.dumps writes it: no free whitespace (a small model pads with it forever) and the
# separators fixed, so the grammar forces them (drafted for free)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_executor: LLExecutor | None = None  # llguidance's batch masker (a verify pass's masks in one call)


def llg_executor() -> LLExecutor:
    global _executor
    if _executor is None:
        _executor = LLExecutor(num_threads=1)
    return _executor


@dataclass(frozen=True)
class Constraint:
    """What a reply must be: `grammar` is llguidance's grammar (JSON form); `what` names it."""

    grammar: str
    what: str = "json"

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        """JSON valid under `schema`; a schema llguidance can't compile raises InvalidRequestError."""
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"the JSON schema can't be compiled: {e}") from None
        problem = LLMatcher.validate_grammar(grammar)
        if problem:
            raise InvalidRequestError(f"the JSON schema can't be compiled: {problem}")
        return cls(grammar, "json_schema")

    @classmethod
    def any_json(cls) -> "Constraint":
        """Any JSON value (OpenAI's json_object, Ollama's "json")."""
        return cls(LLMatcher.grammar_from_json_schema("{}", defaults=JSON_STYLE), "json")

    @classmethod
    def lark(cls, text: str, what: str) -> "Constraint":
        """A grammar in llguidance's Lark syntax (free text, markers, `%json` parts: `schema_lark`);
        one that doesn't parse raises InvalidRequestError. Special tokens (`literal`) are checked
        against the model's tokenizer when the engine takes the request (`Grammars.check`)."""
        try:
            return cls(LLMatcher.grammar_from_lark(text), what)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"the {what} grammar can't be compiled: {e}") from None

    @staticmethod
    def schema_lark(schema: dict | bool) -> str:
        """A JSON schema as a Lark expression (`%json {...}`), in JSON_STYLE; a schema llguidance
        can't compile raises InvalidRequestError, as `json_schema` does."""
        Constraint.json_schema(schema)
        body = schema if isinstance(schema, dict) else {} if schema else {"not": {}}
        style = {**JSON_STYLE, **body.get("x-guidance", {})}  # as `defaults`: the schema's own options win
        return "%json " + json.dumps({**body, "x-guidance": style})


class Grammars:
    """Compiles constraints over one model's tokenizer (its llguidance form built once, on first use)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Any):
        self._hf, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, sorted(int(e) for e in eos_ids)
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(self._hf, self.vocab_size, self.eos_ids)
            return self._tokenizer

    def literal(self, text: str) -> str:
        """`text` as a Lark term for this tokenizer: a special token by its id (`<[7]>`: its
        bytes never match a string literal), else a string literal."""
        ids = self.tokenizer.tokenize_str(text)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def check(self, constraint: Constraint) -> None:
        problem = LLMatcher.validate_grammar(constraint.grammar, self.tokenizer)
        if problem:
            raise InvalidRequestError(f"the {constraint.what} constraint can't be compiled for this model: {problem}")

    def start(self, constraint: Constraint) -> "GrammarState":
        matcher = LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {constraint.what} constraint can't be compiled: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size, self.eos_ids)


def llg_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> LLTokenizer:
    """llguidance's tokenizer from a Hugging Face fast tokenizer (mlx-lm's wrapper unwrapped),
    as wide as the model's logits (padding ids beyond the tokenizer's are never allowed)."""
    fast = getattr(hf_tokenizer, "_tokenizer", hf_tokenizer)
    backend = getattr(fast, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError("constrained decoding needs a fast (tokenizer.json) tokenizer")
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_ids or None)


class GrammarState:
    """One generation's place in its grammar: masks, forced tokens, advance and roll back."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_ids: list[int]):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.eos_only = np.zeros(vocab_size, dtype=bool)
        self.eos_only[[e for e in eos_ids if e < vocab_size]] = True
        self.eos_ids = {e for e in eos_ids if e < vocab_size}
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._eos_bits = pack_bits(self.eos_only, self._words.size)
        # per token advanced: whether the matcher holds it (an end after a complete grammar it doesn't)
        self.held: list[bool] = []
        self.mask_calls = 0

    @property
    def done(self) -> bool:
        """The grammar is complete: only the end may follow."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, a bool per vocabulary id (only EOS once the grammar is done)."""
        if self.matcher.is_stopped():
            return self.eos_only
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self.mask_calls += 1
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def bitmasks_along(self, draft: list[int]) -> np.ndarray:
        """The allowed sets at each position of a verify pass over `draft` (valid: `shape_draft`
        cuts it) as llguidance's bits, (len(draft) + 1, words) int32, in one call that drops the
        GIL; the matcher is left where it was. A row past the grammar's end allows only EOS."""
        bits = np.zeros((len(draft) + 1, self._words.size), dtype=np.int32)
        if not draft:  # llguidance's draft call wants a draft
            if not self.matcher.is_stopped():
                self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        else:
            llg_executor().unsafe_compute_mask_ptr_with_draft_token(
                [(self.matcher, 0, [int(t) for t in draft])], bits.ctypes.data, self._words.nbytes, len(bits))
        self.mask_calls += len(bits)
        bits[~bits.any(axis=1)] = self._eos_bits  # llguidance leaves the rows after a stop empty
        return bits

    def advance(self, tokens: list[int]) -> None:
        for tok in tokens:
            if self.matcher.is_stopped() and int(tok) in self.eos_ids:
                self.held.append(False)  # the end after a complete grammar: llguidance holds nothing for it
                continue
            if not self.matcher.consume_token(int(tok)):
                raise RuntimeError(f"constrained decoding: token {tok} broke the grammar ({self.matcher.get_error()})")
            self.held.append(True)

    def rollback(self, n: int) -> None:
        """Take back the last `n` tokens advanced."""
        taken = self.held[len(self.held) - n :] if n > 0 else []
        del self.held[len(self.held) - len(taken) :]
        if sum(taken):
            self.matcher.rollback(sum(taken))

    def follow(self, generated: list[int]) -> None:
        """Advance to the end of `generated` (all tokens so far), those already advanced skipped:
        for plain decoding, where two places see each token."""
        self.advance(generated[len(self.held) :])

    def valid_prefix(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only continuation, at most `limit`."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def shape_draft(self, draft: list[int], q: np.ndarray | None, limit: int, deterministic: bool,
                    continue_after: Callable[[list[int], int], list[int]] | None = None) -> "ShapedDraft":
        """The draft to verify: forced tokens first (then the drafter's own continuation of them,
        where its draft is deterministic and starts with them), cut where it breaks the grammar,
        then the forced tokens that follow what is left; after a forced run, the drafter's
        deterministic continuation from there (`continue_after(tokens, n)`: lookup's match at the
        new end), as far as the grammar allows, then forced tokens again, and so on. `q` (the
        drafter's distributions) gets one-hot rows for forced and continued tokens; a cut token `q`
        drew is kept as `cut`, to be rejected at its position (the residual p - q, not p, is what
        keeps speculative sampling exact)."""
        forced = self.forced(limit)
        if forced:
            mine = draft[len(forced):] if deterministic and draft[: len(forced)] == forced else []
            tokens, rows = forced + mine, [None] * (len(forced) + len(mine))
        else:
            tokens, rows = list(draft), list(range(len(draft))) if q is not None else [None] * len(draft)
        tokens, rows = tokens[:limit], rows[:limit]
        valid = self.valid_prefix(tokens)
        cut_row = rows[valid] if valid < len(tokens) else None
        cut = tokens[valid] if cut_row is not None else None
        tokens, rows = tokens[:valid], rows[:valid]
        n_forced = min(len(forced), valid)
        if cut is None and len(tokens) < limit:  # the grammar may force what follows the drafter's tokens
            ends_forced = 0 < n_forced == len(tokens)
            self.advance(tokens)
            while len(tokens) < limit:
                more = self.forced(limit - len(tokens))
                self.advance(more)
                tokens, rows, n_forced = tokens + more, rows + [None] * len(more), n_forced + len(more)
                if not (more or ends_forced) or continue_after is None or len(tokens) >= limit:
                    break
                extra = continue_after(tokens, limit - len(tokens))[: limit - len(tokens)]
                extra = extra[: self.valid_prefix(extra)]
                if not extra:
                    break
                self.advance(extra)
                tokens, rows, ends_forced = tokens + extra, rows + [None] * len(extra), False
            self.rollback(len(tokens))
        if q is None or all(r is None for r in rows + [cut_row]):
            return ShapedDraft(tokens, None, None, n_forced)
        q_rows = [q[r] if r is not None else one_hot(t, q.shape[1]) for t, r in zip(tokens, rows)]
        q_rows += [q[cut_row]] if cut is not None else []
        return ShapedDraft(tokens, np.stack(q_rows), cut, n_forced)


@dataclass
class ShapedDraft:
    tokens: list[int]
    q: np.ndarray | None  # the draft's distributions (None: every token deterministic)
    cut: int | None  # a token q drew that broke the grammar: verified as a certain rejection
    forced: int  # how many of the tokens the grammar forced


def one_hot(token: int, vocab: int) -> np.ndarray:
    row = np.zeros(vocab)
    row[token] = 1.0
    return row


def pack_bits(allowed: np.ndarray, words: int) -> np.ndarray:
    """A bool per vocabulary id as llguidance's mask words (int32, bit i of word i // 32)."""
    padded = np.zeros(words * 32, dtype=bool)
    padded[: allowed.shape[-1]] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32)


def unpack_bits(bits: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's mask words, (rows, words), as a bool per vocabulary id, (rows, vocab)."""
    return np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[..., :vocab].astype(bool)


def bit_set(row: np.ndarray, token: int, vocab: int) -> bool:
    """Whether one position's mask words allow `token` (ids past the vocabulary never)."""
    return token < vocab and (int(row[token >> 5]) >> (token & 31)) & 1 == 1


def masked(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """Logits with the disallowed tokens at -inf, before any pick (rows: positions)."""
    width = logits.shape[-1]
    if allowed.shape[-1] < width:  # logits wider than the vocabulary: the extra ids never allowed
        pad = np.zeros((*allowed.shape[:-1], width - allowed.shape[-1]), dtype=bool)
        allowed = np.concatenate([allowed, pad], axis=-1)
    return mx.where(mx.array(allowed[..., :width]), logits, mx.array(-np.inf, dtype=logits.dtype))


def logits_processor(state: GrammarState):
    """The mask for mlx-lm's plain decoding (generate_step's `logits_processors`): `tokens` is
    the last prompt token and the generated ones."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        state.follow(tokens.tolist()[1:])
        return masked(logits, state.allowed()[None])

    return process
