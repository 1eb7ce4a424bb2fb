"""--max-batch: jobs interleaved step by step give each the tokens it gets alone (greedy), with
drafts accepted and rejected, a job joining and one leaving mid-batch; a short job no longer
waits for a long one. Model: a tiny random qwen3 (real engine)."""

from __future__ import annotations

import threading
import time

import pytest

from engine import Done, Engine, GenerationRequest, Tokens
from greedy_ties import assert_same_greedy_away_from_ties

PROMPTS = [
    "a b c a b c a b c a b",  # repetitive: lookup drafts get accepted
    "The quick brown fox " * 12,
    "x",
    " ".join(f"line {i}: value = {i * 7 % 13}" for i in range(40)),  # several prefill chunks
]


@pytest.fixture(scope="module")
def batched(tiny_model_dir):
    e = Engine(str(tiny_model_dir), max_batch=3, prefill_chunk=16)
    yield e
    e.close()


def alone(engine, ids, max_tokens, mode):
    return engine.submit(GenerationRequest(ids, max_tokens=max_tokens, mode=mode)).result()


def run_all(jobs):
    """Read every job's events on its own thread; return (done, first-token time, end time) per job."""
    out = [None] * len(jobs)

    def read(i, job):
        first = None
        for ev in job:
            if isinstance(ev, Tokens) and first is None:
                first = time.perf_counter()
            if isinstance(ev, Done):
                out[i] = (ev, first, time.perf_counter())

    threads = [threading.Thread(target=read, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


@pytest.mark.parametrize("mode", ["lookup", "baseline"])
def test_batched_equals_alone(tiny_engine, batched, mode):
    ids = [tiny_engine.encode(p) for p in PROMPTS]
    lengths = [40, 25, 60, 30]
    expected = [alone(tiny_engine, i, n, mode).token_ids for i, n in zip(ids, lengths)]
    before = batched.load()["batched_rounds"]
    jobs = [batched.submit(GenerationRequest(i, max_tokens=n, mode=mode)) for i, n in zip(ids, lengths)]
    results = run_all(jobs)
    for i, want, r in zip(ids, expected, results):  # batched vs alone: other kernels' rounding
        assert_same_greedy_away_from_ties(tiny_engine, i, want, r[0].token_ids)
    if mode == "lookup":  # verified in batched forwards (baseline decodes through mlx-lm, one at a time)
        assert batched.load()["batched_rounds"] > before
    if mode == "lookup":
        drafted = sum(r[0].stats.drafted_tokens for r in results)
        accepted = sum(r[0].stats.accepted_tokens for r in results)
        assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert batched.load()["running"] == 0


def test_join_and_leave_mid_batch(tiny_engine, batched):
    ids = [tiny_engine.encode(p) for p in PROMPTS]
    expected_long = alone(tiny_engine, ids[1], 120, "lookup").token_ids
    expected_short = [alone(tiny_engine, i, 8, "lookup").token_ids for i in (ids[0], ids[3])]
    long_job = batched.submit(GenerationRequest(ids[1], max_tokens=120, mode="lookup"))
    first = next(ev for ev in long_job if isinstance(ev, Tokens))  # the long one is decoding
    joiners = [batched.submit(GenerationRequest(i, max_tokens=8, mode="lookup")) for i in (ids[0], ids[3])]
    # long enough not to end before its reader cancels it (long drafts of a loop are a few rounds)
    leaver = batched.submit(GenerationRequest(ids[2], max_tokens=3000, mode="lookup"))
    for ev in leaver:  # cancelled mid-batch: the others go on unharmed
        if isinstance(ev, Tokens):
            leaver.cancel()
        if isinstance(ev, Done):
            assert ev.finish_reason == "cancelled"
            break
    results = run_all([long_job, *joiners])
    assert first.token_ids == results[0][0].token_ids[: len(first.token_ids)]  # streamed as it ends
    assert_same_greedy_away_from_ties(tiny_engine, ids[1], expected_long, results[0][0].token_ids)
    for i, want, r in zip((ids[0], ids[3]), expected_short, results[1:]):
        assert_same_greedy_away_from_ties(tiny_engine, i, want, r[0].token_ids)
    # the short joiners did not wait behind the long one (one at a time, they would queue for most
    # of its run: test_max_batch_one_runs_in_arrival_order); the engine's clocks, not the readers'
    assert max(r[0].stats.queued_s for r in results[1:]) < 0.5 * results[0][0].stats.wall_s


def test_max_batch_one_runs_in_arrival_order(tiny_engine):
    ids = [tiny_engine.encode(p) for p in PROMPTS[:2]]
    jobs = [tiny_engine.submit(GenerationRequest(i, max_tokens=20, mode="lookup")) for i in ids]
    (d0, _, _), (d1, _, _) = run_all(jobs)
    assert d1.stats.queued_s >= 0.9 * d0.stats.wall_s  # one at a time: the second waited for the first
    assert tiny_engine.load()["max_batch"] == 1


def test_reference_model_batched_diverges_only_at_near_ties():
    """The bundled model (its default drafter, taps included) batched vs alone: identical, or the
    first difference comes where the alone run's top-two logits were within 1e-4 (a batched matmul
    may round differently from a single row's)."""
    with Engine(prefix_cache=False, dtype="float32", max_batch=4) as engine:
        prompts = [engine.render_chat([{"role": "user", "content": q}]) for q in (
            "Explain why unit tests are worth writing.", "Write a Python function that adds two numbers.",
            "What is 17 * 24?", "Rename the function foo to bar in: def foo(x):\n    return foo(x - 1)\n")]
        engine.max_batch = 1
        alone = [engine.submit(GenerationRequest(p, max_tokens=40)).result().token_ids for p in prompts]
        engine.max_batch = 4
        before = engine.load()["batched_rounds"]
        jobs = [engine.submit(GenerationRequest(p, max_tokens=40)) for p in prompts]
        together = [j.result().token_ids for j in jobs]
        assert engine.load()["batched_rounds"] > before
        for prompt, a, b in zip(prompts, alone, together):
            assert_same_greedy_away_from_ties(engine, prompt, a, b)


def test_moe_target_verifies_in_batched_forwards(tmp_path):
    """A mixture-of-experts target (tiny random qwen3_moe) shares forwards too, each row's
    tokens those it gets alone."""
    from tiny_models import build_family_model

    path = build_family_model(tmp_path / "moe", "qwen3_moe")
    with Engine(str(path), max_batch=3, prefill_chunk=16) as batched, Engine(str(path)) as single:
        ids = [single.encode(p) for p in PROMPTS[:2] + PROMPTS[3:]]
        expected = [alone(single, i, 30, "lookup").token_ids for i in ids]
        results = run_all([batched.submit(GenerationRequest(i, max_tokens=30, mode="lookup")) for i in ids])
        for i, want, r in zip(ids, expected, results):
            assert_same_greedy_away_from_ties(single, i, want, r[0].token_ids)
        assert batched.load()["batched_rounds"] > 0
