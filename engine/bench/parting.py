"""Where a mode's greedy output parts from mlx-lm's, and whether the target itself was undecided there.

Lossless speculation compares the target with itself through the engine's forwards, whose kernels
and shapes (a verify pass of many rows, a prefill in other chunks) are not mlx-lm's one-row steps.
The sums come out the same to rounding, so where two tokens' logits lie within rounding (in bf16,
one step is 1/16 at a logit of 8-16) the two sides may pick differently, and from there the texts
go their own ways. The benchmark then says more than "NO": the step where they parted, how far
mlx-lm's own loop put its token ahead of ours, and how far the same model put it ahead when it read
the same text in prefill chunks (MLX's own kernels, as mlx-lm's prompt processing does). Where one
of those two computations of the target ranks our token level with or above mlx-lm's, the target
was undecided between them: a tie that rounding settles, not a drafting error. Where both put
mlx-lm's token clearly ahead, the parting is unexplained, and worth a bug report.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.base.sampling import SamplingParams
from engine.caches.radix_tree import common_prefix
from engine.engine import engine_stream
from engine.kernels.cpu_attention import disabled

PREFILL_STEP = 2048  # mlx-lm's own prompt chunk (generate_step's prefill_step_size)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (one ending first counts), None where equal."""
    return None if a == b else common_prefix(a, b)


def loop_logprobs(target, prompt: list[int], step: int) -> mx.array:
    """mlx-lm's greedy loop over `prompt`: its log-probabilities at output step `step`."""
    steps = generate_step(mx.array(prompt, dtype=mx.uint32), target.model, max_tokens=step + 1,
                          sampler=SamplingParams().mlx_lm_sampler(), stream=engine_stream())
    try:
        with disabled():  # as the benchmark's peer: MLX's own attention
            for i, (_, logprobs) in enumerate(steps):
                if i == step:
                    return logprobs.astype(mx.float32)
    finally:
        steps.close()
    raise ValueError(f"mlx-lm's loop stopped before step {step}")


def chunked_logits(target, tokens: list[int]) -> mx.array:
    """The target's next-token logits after `tokens`, read PREFILL_STEP at a time, MLX's own kernels."""
    cache = target.make_cache()
    with disabled():
        for start in range(0, len(tokens), PREFILL_STEP):
            logits = target.model(mx.array(tokens[start:start + PREFILL_STEP], dtype=mx.uint32)[None], cache=cache)
            mx.eval(logits)
    return logits[0, -1].astype(mx.float32)


def where_parted(target, prompt: list[int], peer: list[int], ours: list[int]) -> dict | None:
    """Where `ours` leaves `peer` (both greedy outputs for `prompt`, without their end token), the two
    tokens there (None: the end of the sequence) and the target's gaps between them; None where equal."""
    at = first_difference(peer, ours)
    if at is None:
        return None
    end = min(target.eos_token_ids) if target.eos_token_ids else None
    peer_token = peer[at] if at < len(peer) else None
    our_token = ours[at] if at < len(ours) else None
    a, b = (end if peer_token is None else peer_token), (end if our_token is None else our_token)
    report = {"at": at, "peer_token": peer_token, "our_token": our_token,
              "peer_text": _text(target, peer_token), "our_text": _text(target, our_token)}
    if a is None or b is None:  # a model without an end token ended: nothing to compare
        return {**report, "verdict": "unexplained"}
    loop = loop_logprobs(target, prompt, at)
    chunked = chunked_logits(target, prompt + peer[:at])
    loop_gap, chunked_gap = (loop[a] - loop[b]).item(), (chunked[a] - chunked[b]).item()
    tie = min(loop_gap, chunked_gap) <= 0
    return {**report, "loop_gap": round(loop_gap, 6), "chunked_gap": round(chunked_gap, 6),
            "chunked_logit": round(chunked[a].item(), 4), "verdict": "tie" if tie else "unexplained"}


def describe(parted: dict | None) -> str:
    """The table's "identical" cell for outputs that differ: 'NO: parted at 439, a tie (gaps 0.0625 /
    0); 4.12x over the 439 tokens both wrote'."""
    if parted is None:  # sampled: outputs may differ
        return "NO"
    gaps = f" (gaps {parted['loop_gap']:g} / {parted['chunked_gap']:g})" if "loop_gap" in parted else ""
    what = "a tie" if parted["verdict"] == "tie" else "unexplained"
    shared = (f"; {parted['shared_speedup']:.2f}x over the {parted['at']} tokens both wrote"
              if parted.get("shared_speedup") else "")
    return f"NO: parted at {parted['at']}, {what}{gaps}{shared}"


def _text(target, token: int | None) -> str:
    return "<end>" if token is None else target.tokenizer.decode([token])
