"""The verify loop: one generator for every drafter.

Each round feeds the last committed token plus the draft to the target in one
forward pass, accepts the longest lossless prefix of the draft (greedy: equal to the
target's argmax; sampling: speculative-sampling acceptance), commits one more
token from the target itself, and takes the rejected tokens back out of the cache
(engine/caches/rollback.py: attention cut, sliding windows trimmed, recurrent state taken from
the verify pass's per-position capture, or restored and the kept tokens replayed:
whichever the cost curve measured cheaper for this model, engine/caches/state_capture.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from engine.base.errors import CancelledError
from engine.base.platform import on_cuda, whole_number_setting
from engine.base.sampling import SamplingParams, accept_greedy, accept_speculative, target_probs
from engine.caches.rollback import DEFAULT_ROLLBACK, mark, needs_replay, supports_drafts, take_back
from engine.caches.state_capture import widest_capture
from engine.decoding.batch_verify import Forward
from engine.decoding.grammar import GrammarState, bit_set, masked, unpack_bits
from engine.drafting.drafter import Draft, Drafter
from engine.kernels import cpu_attention
from engine.kernels.attention_crossover import unread_last_call
from engine.model.target import Target
from engine.model.vision import ImageFeatures


@dataclass
class Round:
    tokens: list[int]  # committed this round: accepted draft tokens, then the target's own
    drafted: int
    accepted: int
    seconds: float
    # keep_only(u): the caller used only the first u >= 1 of `tokens` (a stop mid-round);
    # leave the cache as if the round had committed just those. Call it right after the round.
    keep_only: Callable[[int], None] | None = None
    source: str = ""  # the drafter that proposed this round's draft ("" when none was drafted)
    width: int = 1  # the rows its forward ran: the last token and the draft, padded (`verify_width`)


def prefill(
    target: Target,
    cache: list,
    tokens: list[int],
    chunk_size: int = 512,
    on_progress: Callable[[int, int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    on_hidden: Callable | None = None,
    tap_layers: tuple[int, ...] = (),
    embeddings: ImageFeatures | None = None,
) -> None:
    """Feed `tokens` into the cache in chunks, reporting progress, cancellable between chunks.
    `embeddings` (one row per token) are fed instead of the tokens' own: a VLM prompt's images
    (engine/model/vision.py)."""
    total = len(tokens)
    # The last layer's attention output feeds no cache: unread, unless a drafter taps that layer
    unread = None
    if embeddings is None and not (tap_layers and max(tap_layers) >= len(cache) - 1):
        unread = unread_last_call(target, cache)
    for start in range(0, total, chunk_size):
        if cancelled and cancelled():
            raise CancelledError("cancelled during prefill")
        chunk = tokens[start : start + chunk_size]
        if embeddings is not None:
            target.forward(chunk, cache, embeddings[start : start + chunk_size])
        else:
            with cpu_attention.last_call_unread(unread):  # the caches (and any taps) are all that is read
                if tap_layers:
                    on_hidden(target.forward_tapped(chunk, cache, tap_layers)[1])
                else:
                    target.forward(chunk, cache)
        mx.eval([c.state for c in cache])
        if on_progress:
            on_progress(min(start + chunk_size, total), total)


# The widths of an agent's warm turn, by the kernels they take at the default thresholds: a
# decode step, verify passes (MLX's quantized kernel for 2 rows, narrow_qmm's), a short prefill
# chunk in each of gpu_attention's buckets, the widest past wide_dequantize's threshold
WARM_WIDTHS = (1, 2, 16, 100, 200, 400)


def warm_up(target: Target, cache: list) -> None:
    """One forward of each of WARM_WIDTHS into `cache`, a scratch one: the target's own forwards
    (not a batched one, a head's or a recurrent capture). MLX CUDA readies a kernel the first time
    a process runs it: on an H100 a warm turn's first short prefill chunk took 0.1-0.4 s longer
    than the next turn's (25 s in a machine's first process, the driver compiling it), a cost a
    long-lived engine takes here, at its start, instead of in a user's turn."""
    for width in WARM_WIDTHS:
        prefill(target, cache, [0] * width, chunk_size=width)


@functools.cache
def _width_step() -> int:
    """Verify forwards run at a multiple of this many tokens (`verify_width` says why)."""
    # a CPU computes every extra position: none there
    return whole_number_setting("MLX_DSPARK_VERIFY_WIDTH_STEP", 8 if on_cuda() else 1, "as drafted")


def verify_width(tokens: int) -> int:
    """The width a verify forward of `tokens` inputs runs at: on MLX CUDA the next multiple of 8.
    MLX CUDA replays a forward as captured graphs, one kept per sequence of kernel launches and
    updated in place for the next forward of that sequence; a shape met for the first time (or
    after others) can mean other kernels, and a graph built again. A verify forward's width
    follows its draft, so it was new most rounds; on an H100 (8B yardstick, 8-bit) the edit
    content's rounds then cost 31-36 ms against 25 ms once their shapes had been met. A few widths
    instead of every one made `benchmark`'s edit 1.11x faster with gpu_attention's keys padded to
    256, and changed nothing measurable with them padded to 2048 (its KEY_BLOCK now, which took
    most of the gain; docs/benchmarks.md); the widths also fall on narrow_qmm's tile counts, so its
    matmuls cost the padding nothing. The extra positions (the last input again) come after
    every real one, so causally no real token sees them; their logits are dropped and their KV is
    taken back with the rejected draft. `MLX_DSPARK_VERIFY_WIDTH_STEP` sets the multiple."""
    step = _width_step()
    return -(-tokens // step) * step


def speculative_rounds(
    target: Target,
    cache: list,
    last_token: int,
    drafter: Drafter,
    sampling: SamplingParams,
    max_draft: int | Callable[[], int],
    rng: np.random.Generator | None = None,
    hard_cap: int | Callable[[], int] | None = None,
    defer_forward: bool = False,
    rollback: str | None = None,
    grammar: GrammarState | None = None,
) -> Iterator[Round]:
    """Endless rounds of draft-and-verify; the caller stops iterating when done.

    `max_draft` is the round's cap (a number, or a callable such as the adaptive
    controller); `hard_cap` (default: the same) bounds `verbatim` drafts, which may
    exceed an adaptive cap. On entry the cache holds the context minus `last_token`;
    after every round it holds the context minus the last committed token, which the
    next round feeds. `defer_forward`: each round first yields its head draft where it has
    one (a `heads.drafter.HeadCall`, for `draft_together`), then its verify forward (a
    `batch_verify.Forward`), for the caller to run batched with other sequences', then its Round.
    `rollback` ("capture" or "replay"; default: `target.state_rollback`, else DEFAULT_ROLLBACK;
    the engine passes the cost curve's pick) is how recurrent layers take back a rejected draft.
    `grammar` (engine/decoding/grammar.py) constrains the output: the draft is shaped to it
    (forced tokens drafted, a breaking tail cut) and every position's logits are masked before
    the pick, so the rounds equal constrained plain decoding (greedy) or its distribution.
    """
    rng = rng or np.random.default_rng(sampling.seed)
    cap = max_draft if callable(max_draft) else (lambda: max_draft)
    drafter.set_sampling(sampling)
    # A cache type engine/caches/rollback.py doesn't know can't take back a rejected draft:
    # decode it plainly, which is always correct.
    drafting = supports_drafts(cache)
    capture_width = 0  # the widest pass whose recurrent states are captured; wider ones replay
    width_known = True  # once a recorded pass has said what a capture keeps per position
    recurrent = drafting and needs_replay(cache)
    if recurrent and (rollback or target.state_rollback or DEFAULT_ROLLBACK) == "capture":
        # split over ranks, each holds its own recurrent layers: all capture up to the same width
        capture_width, width_known = min(target.ranks.gather(widest_capture(cache))), False
    # Recurrent layers would capture or replay the padding too: only attention caches are padded
    padded = drafting and not recurrent
    y = last_token
    while True:
        t0 = time.perf_counter()
        k = cap() if drafting else 0
        hc = hard_cap() if callable(hard_cap) else hard_cap
        hard = max(k, hc if hc is not None and drafting else 0)
        draft = None
        if hard > 0:
            draft = drafter.plan(k) if defer_forward else drafter.propose(k)
            if not isinstance(draft, Draft):  # a head's draft: the caller runs it with other sequences'
                yield draft
                draft = drafter.take(draft)
        draft_tokens = draft.tokens[: hard if draft.verbatim else k] if draft else []
        q = draft.q[: len(draft_tokens)] if draft is not None and draft.q is not None else None
        cut, forced = None, 0
        if grammar is not None:
            shaped = grammar.shape_draft(draft_tokens, q, hard if drafting else 0,
                                         deterministic=q is None or sampling.greedy,
                                         continue_after=drafter.continue_after)
            draft_tokens, q, cut, forced = shaped.tokens, shaped.q, shaped.cut, shaped.forced
        inputs = [y, *draft_tokens]
        fed = inputs + [inputs[-1]] * (verify_width(len(inputs)) - len(inputs)) if padded and draft_tokens else inputs
        before = mark(cache) if draft_tokens else None
        # until a recorded pass says what a capture keeps, record (a stepping layer stops at the budget)
        fwd = Forward(fed, cache, tuple(drafter.tap_layers),
                      capture=bool(draft_tokens) and (len(inputs) <= capture_width or not width_known))
        if defer_forward:
            yield fwd
        else:
            fwd.run(target)
        logits, hidden = fwd.result
        if fwd.capture and not width_known:  # layers in closed form keep nothing per position
            width = fwd.captured.widest() if fwd.captured is not None else capture_width
            capture_width, width_known = min(target.ranks.gather(width)), True
        if len(fed) > len(inputs):
            logits = logits[: len(inputs)]  # the padding's rows: no draft token's
        if grammar is not None:  # the forward computes on MLX's thread while llguidance makes the masks
            mx.async_eval(logits)
            bits = grammar.bitmasks_along(draft_tokens)
        picks = fwd.picks() if fwd.picks and sampling.greedy else None
        if grammar is not None and sampling.greedy:
            n, nxt = accept_greedy_masked(logits, draft_tokens, bits, grammar.vocab_size, picks)
        elif sampling.greedy:
            n, nxt = accept_greedy(logits, draft_tokens, picks)
        else:
            if grammar is not None:
                logits = masked(logits, unpack_bits(bits, grammar.vocab_size))
            proposed = draft_tokens + ([cut] if cut is not None else [])  # a cut token: certainly rejected
            n, nxt = accept_speculative(target_probs(logits, sampling), proposed, q, rng)
        if grammar is not None:
            grammar.advance([*draft_tokens[:n], nxt])
        if draft_tokens:
            take_back(cache, before, len(fed), n + 1, replay=lambda: target.forward(inputs[: n + 1], cache),
                      captured=fwd.captured)
        committed = [*draft_tokens[:n], nxt]
        drafter.commit(
            committed, len(draft_tokens), n, hidden=None if hidden is None else hidden[: n + 1]
        )
        y = nxt
        keep_only = None
        if draft_tokens:
            def keep_only(u, before=before, inputs=inputs, held=n + 1, captured=fwd.captured):
                take_back(cache, before, held, u, replay=lambda: target.forward(inputs[:u], cache),
                          captured=captured)
        source = ("grammar" if forced == len(draft_tokens) else (draft.source or drafter.name)) if draft_tokens else ""
        yield Round(committed, len(draft_tokens), n, time.perf_counter() - t0, keep_only, source, len(fed))


def accept_greedy_masked(logits: mx.array, draft: list[int], bits, vocab: int,
                         picks: list[int] | None = None) -> tuple[int, int]:
    """`accept_greedy` under a grammar's masks (`bits`: llguidance's words, a row per position):
    the target's own argmax where the mask allows it (it is then the masked argmax too), else
    the first argmax over the allowed tokens, found for that position only."""
    preds = picks if picks is not None else mx.argmax(logits, axis=-1).tolist()
    values = None  # the logits in numpy, taken once where a position needs its mask
    i = 0
    while True:
        pick = preds[i]
        if not bit_set(bits[i], pick, vocab):
            values = np.asarray(logits.astype(mx.float32)) if values is None else values
            ids = np.flatnonzero(unpack_bits(bits[i], vocab))  # never empty: a row allows EOS at least
            pick = int(ids[np.argmax(values[i, ids])])
        if i == len(draft) or pick != draft[i]:
            return i, pick
        i += 1
