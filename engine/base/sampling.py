"""Sampling parameters and the acceptance rules of speculative decoding.

The target's distribution at each position is exactly what mlx-lm's sampler draws
from: its filters (top-p, min-p, top-k, in mlx-lm's order) on the log-probabilities,
then softmax at the temperature. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler
from engine.base.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def for_vocab(self, vocab_size: int) -> "SamplingParams":
        """The same sampling with a top_k at or above the vocabulary read as no limit
        (mlx-lm's top-k sampler can't take k >= vocab)."""
        return replace(self, top_k=0) if self.top_k >= vocab_size else self

    def validate(self, vocab_size: int) -> None:
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]")

    def mlx_lm_sampler(self):
        """The equivalent mlx-lm sampler, for plain decoding through mlx-lm."""
        return make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)


def target_probs(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """Per-position sampling distributions, shape (k, vocab), float64 numpy."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    # Same filters, same order as mlx_lm.sample_utils.make_sampler.
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    probs = mx.softmax(logprobs * (1.0 / params.temperature), axis=-1)
    p = np.array(probs, dtype=np.float64)
    return p / p.sum(axis=-1, keepdims=True)


def accept_speculative(
    p: np.ndarray, draft: list[int], q: np.ndarray | None, rng: np.random.Generator
) -> tuple[int, int]:
    """Speculative-sampling acceptance (Leviathan et al.; Chen et al.).

    p: target distributions for the k draft positions plus the bonus position, (k+1, V).
    q: the drafter's distributions for its k tokens, (k, V); None means one-hot
       (a deterministic draft such as lookup), where the ratio p/q is just p(x).
    Returns (number of draft tokens accepted, the token that follows them), whose
    joint distribution is exactly the target's.
    """
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and rng.random() < min(1.0, p[i, x] / qx):
            continue
        # Rejected: sample from the residual max(p - q, 0), renormalised.
        residual = p[i].copy()
        if q is None:
            residual[x] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        total = residual.sum()
        if total <= 0:  # p == q on the support: any sample from p is exact
            residual, total = p[i], p[i].sum()
        return i, int(rng.choice(len(residual), p=residual / total))
    k = len(draft)
    return k, int(rng.choice(p.shape[1], p=p[k]))


def accept_greedy(logits: mx.array, draft: list[int], preds: list[int] | None = None) -> tuple[int, int]:
    """Longest prefix of the draft equal to the target's argmax, and the next argmax (`preds`:
    that argmax per position, where the caller has it already)."""
    if preds is None:
        preds = mx.argmax(logits, axis=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == preds[n]:
        n += 1
    return n, preds[n]
