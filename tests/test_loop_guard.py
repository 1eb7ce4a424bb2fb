"""The loop guard ends a generation stuck in one repeated n-gram, and nothing else."""

import random

import pytest

from engine.base.loop_guard import LoopGuard, repeated_share


def first_trip(tokens, window=64, max_period=8):
    guard = LoopGuard(window, max_period)
    for i, t in enumerate(tokens):
        if guard.add(t):
            return i, guard.period
    return None, guard.period


@pytest.mark.parametrize("period", [1, 2, 3, 7, 8])
def test_trips_once_window_tokens_repeat(period):
    rng = random.Random(period)
    head = [rng.randrange(1000, 2000) for _ in range(50)]
    gram = list(range(period))
    loop = (gram * 200)[:150]
    i, p = first_trip(head + loop)
    assert p == period
    assert i == len(head) + 64 - 1  # exactly when the last 64 tokens are the loop


def test_longer_period_than_allowed_or_random_text_never_trips():
    rng = random.Random(0)
    assert first_trip([rng.randrange(50) for _ in range(5000)]) == (None, 0)
    assert first_trip(list(range(9)) * 100) == (None, 0)  # a 9-token n-gram, max_period 8


def test_a_loop_broken_before_the_window_does_not_trip():
    stretch = [5] * 63 + [6]
    assert first_trip(stretch * 10)[0] is None


def test_window_must_leave_room_for_a_repeat():
    with pytest.raises(ValueError):
        LoopGuard(1)


def test_repeated_share():
    rng = random.Random(1)
    prose = [rng.randrange(100, 10_000) for _ in range(300)]
    assert repeated_share(prose) == 0.0
    assert repeated_share([]) == 0.0
    assert repeated_share([7] * 100) == 1.0
    share = repeated_share(prose + [1, 2, 3, 4] * 75)  # 300 of 600 tokens in a loop
    assert share == pytest.approx(0.5)
    assert repeated_share(prose + [1, 2] * 10) == 0.0  # 20 tokens: too short to count


# -- in the engine: the guard reads committed tokens only, so every mode stops at the same token --

@pytest.fixture(scope="module")
def looping_output(tiny_model_dir):
    """A prompt whose greedy continuation on the tiny random model falls into a loop,
    its unguarded output, and where a 64-token guard trips in it."""
    from engine import Engine, GenerationRequest

    with Engine(str(tiny_model_dir), mode="baseline", prefix_cache=False) as e:
        for text in ("for i in range(10):", "class Engine:", "def", "import os"):
            prompt = e.encode(text)
            out = list(e.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS)))[-1].token_ids
            trip, _ = first_trip(out, window=64, max_period=32)
            if trip is not None:
                return prompt, out, trip
    pytest.skip("no prompt made the tiny random model loop")


MAX_TOKENS = 600


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_engine_ends_a_loop_as_length_with_a_note(tiny_model_dir, looping_output, mode):
    from engine import Engine, GenerationRequest

    prompt, unguarded, trip = looping_output
    with Engine(str(tiny_model_dir), mode=mode, prefix_cache=False, loop_guard=64) as e:
        done = list(e.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS)))[-1]
    assert done.finish_reason == "length"
    assert "loop guard" in done.stats.note
    assert done.token_ids == unguarded[:trip + 1]  # the target's own tokens, cut where the loop showed


def test_engine_without_guard_runs_to_max_tokens(tiny_model_dir, looping_output):
    from engine import Engine, GenerationRequest

    prompt, unguarded, _ = looping_output
    with Engine(str(tiny_model_dir), mode="lookup", prefix_cache=False) as e:
        done = list(e.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS)))[-1]
    assert done.token_ids == unguarded
    assert "loop guard" not in done.stats.note


def test_benchmark_flags_a_looping_reply_as_degenerate(tiny_model_dir, looping_output, monkeypatch):
    import engine.bench.benchmark as benchmark
    from engine import Engine
    from engine.base.sampling import SamplingParams

    prompt, unguarded, _ = looping_output
    share = repeated_share(unguarded)
    assert share > 0.1
    # The tiny model's loop fills about a third of its reply: flag from a lower share here.
    monkeypatch.setattr(benchmark, "DEGENERATE_SHARE", share / 2)
    with Engine(str(tiny_model_dir), prefix_cache=False) as e:
        content = benchmark.Content("loop", [prompt], MAX_TOKENS, note="a looping reply")
        r = benchmark.bench_decode(e, content, ["lookup"], 16, 1, SamplingParams(), lambda msg: None)
    assert r["repeated_share"] == pytest.approx(share, abs=1e-3)
    assert r["degenerate"] is True and r["modes"]["lookup"]["identical"]
    row = benchmark.format_table({"contents": {"loop": r}}).splitlines()[-1]
    assert row.split()[-2:] == [f"{share:.0%}", "degenerate"]


def test_loop_guard_flag_defaults_on_for_servers_only(tiny_model_dir):
    import argparse

    from agent_bridge.commands import CommandError
    from agent_bridge.commands.common import add_engine_args, engine_from_args
    from engine.base.loop_guard import DEFAULT_WINDOW

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = ["--model", str(tiny_model_dir), "--no-prefix-cache"]
    with pytest.raises(CommandError, match="--loop-guard must be 0"):
        engine_from_args(parser.parse_args([*model, "--loop-guard", "1"]))
    with engine_from_args(parser.parse_args(model), persistent=True) as e:  # serve, mcp
        assert e.loop_guard == DEFAULT_WINDOW
    with engine_from_args(parser.parse_args(model)) as e:  # generate, benchmark: the model as it is
        assert e.loop_guard == 0
    with engine_from_args(parser.parse_args([*model, "--loop-guard", "0"]), persistent=True) as e:
        assert e.loop_guard == 0
