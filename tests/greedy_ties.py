"""Greedy tokens of two compute paths (a row batched and alone, other chunkings, other kernels)
are equal away from near-ties: the paths agree to float32 rounding, not bit for bit (OpenBLAS
picks its kernels by shape and CPU), so where the top two logits are within NEAR_TIE either
token may win. A path that mixes rows or drops keys moves logits by far more than that."""

from __future__ import annotations

import mlx.core as mx

from engine.caches.kv_segments import fresh_cache

NEAR_TIE = 1e-4


def top_two_gap(logits: mx.array) -> mx.array:
    """Per position, the largest logit minus the second largest."""
    top = mx.sort(logits.astype(mx.float32), axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


def argmax_equal_away_from_ties(got: mx.array, ref: mx.array, margin: float = NEAR_TIE) -> bool:
    """argmax(got) == argmax(ref) at every position whose top two in ref are over margin apart."""
    decided = top_two_gap(ref) > margin
    same = mx.argmax(got, axis=-1) == mx.argmax(ref, axis=-1)
    return bool(mx.all(same | ~decided).item())


def assert_same_greedy_away_from_ties(engine, prompt: list[int], want: list[int], got: list[int],
                                      margin: float = NEAR_TIE) -> None:
    """got == want (greedy tokens after prompt), or the first token where they part was a near-tie
    for the target (its top two logits after prompt + want[:k] within margin)."""
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))

    def gap(target):
        return float(top_two_gap(target.forward(prompt + want[:k], fresh_cache(target, None))[-1]).item())

    assert engine.call(gap) < margin, f"diverged at token {k} without a near-tie: {want} != {got}"
