"""Verify forwards padded to a few widths (engine/decoding/verify.py `verify_width`: on by
default on MLX CUDA, forced here on the CPU): the output stays the target's own, greedy token
for token and sampled in distribution, and the padding never stays in the cache."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.caches.kv_segments import fresh_cache
from engine.decoding import verify
from engine.drafting.lookup import LookupDrafter
from test_lossless import MAX_TOKENS, corrupt, lookup_ids, mlx_lm_greedy, prompts
from test_sampling import check_engine_sampling

STEP = "MLX_DSPARK_VERIFY_WIDTH_STEP"


@pytest.fixture
def width_step(monkeypatch):
    """set_step(value): the variable set (None: unset), the cached step forgotten."""

    def set_step(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(STEP, raising=False)
        else:
            monkeypatch.setenv(STEP, value)
        verify._width_step.cache_clear()

    yield set_step
    verify._width_step.cache_clear()  # the next use reads the environment as it was


def test_width_rounds_up_on_cuda_only_and_bad_steps_fail(width_step, monkeypatch):
    widths = (2, 9, 53, 64)
    width_step(None)
    monkeypatch.setattr(verify, "on_cuda", lambda: False)
    assert [verify.verify_width(n) for n in widths] == [2, 9, 53, 64]  # a CPU computes every position
    monkeypatch.setattr(verify, "on_cuda", lambda: True)
    width_step(None)
    assert [verify.verify_width(n) for n in widths] == [8, 16, 56, 64]
    width_step("4")
    assert [verify.verify_width(n) for n in widths] == [4, 12, 56, 64]
    width_step("1")
    assert [verify.verify_width(n) for n in widths] == [2, 9, 53, 64]
    for bad in ("0", "-8", "eight", ""):
        width_step(bad)
        with pytest.raises(ValueError, match=STEP):
            verify.verify_width(3)


def test_padded_greedy_equals_mlx_lm(tiny_engine, width_step):
    width_step("8")
    vocab = tiny_engine.target.vocab_size
    for i, prompt in enumerate(prompts(tiny_engine)[::2]):
        ref = mlx_lm_greedy(tiny_engine, prompt, MAX_TOKENS)
        # drafts accepted in full, rejected early, and whatever the prompt itself gives
        for corpus in ((), [prompt + ref], [corrupt(prompt + ref, 5, vocab)]):
            for cap in (3, 16, 63):
                ids, _ = lookup_ids(tiny_engine, prompt, cap, corpus)
                assert ids == ref, f"prompt {i}, cap {cap}, corpus {len(corpus)}: {ids} != {ref}"


def test_padded_rounds_leave_only_the_context_in_the_cache(tiny_engine, width_step):
    width_step("8")
    prompt = prompts(tiny_engine)[0]
    ref = mlx_lm_greedy(tiny_engine, prompt, MAX_TOKENS)

    def decode(target):
        cache = fresh_cache(target)
        verify.prefill(target, cache, prompt[:-1])
        drafter = LookupDrafter(corpus=[prompt + corrupt(ref, 7, target.vocab_size)])
        drafter.start(prompt)
        made, padded = [], 0
        for r in verify.speculative_rounds(target, cache, prompt[-1], drafter, SamplingParams(), 16):
            made += r.tokens
            padded += r.drafted > 0 and verify.verify_width(r.drafted + 1) > r.drafted + 1
            # the cache holds the context but its last token, which the next round feeds
            assert cache[0].offset == len(prompt) + len(made) - 1, f"after {len(made)} tokens"
            if len(made) >= len(ref):
                return made[: len(ref)], padded

    made, padded = tiny_engine.call(decode)
    assert made == ref
    assert padded > 0, "no round's forward was padded: the test did not exercise the padding"


def test_padded_sampling_matches_target(tiny_engine, width_step):
    width_step("8")  # the draft of one token is fed as 8 rows
    prompt = tiny_engine.render_chat([{"role": "user", "content": "Re-emit: for i in range(10): print(i)"}])
    check_engine_sampling(tiny_engine, prompt, SamplingParams(temperature=1.0, top_k=4, top_p=1.0))
