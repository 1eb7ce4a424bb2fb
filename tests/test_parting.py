"""Where a mode's output parts from mlx-lm's (engine/bench/parting.py), on a tiny random model:
the step found, the tokens named, and the target's own gaps between them there."""

from __future__ import annotations

import mlx.core as mx

from engine import SamplingParams
from engine.bench import benchmark
from engine.bench.benchmark import build_content, plain_mlx_lm
from engine.bench.parting import describe, first_difference, loop_logprobs, where_parted

PROMPT_TEXT = "def area(width, height):\n    return"


def _greedy(target, n=12):
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    return prompt, plain_mlx_lm(target, prompt, n, SamplingParams()).tokens


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2


def test_equal_outputs_did_not_part(target):
    prompt, peer = _greedy(target)
    assert where_parted(target, prompt, peer, list(peer)) is None


def test_a_far_worse_token_is_found_and_unexplained(target):
    """Ours takes, at step 5, the token mlx-lm's loop ranked last: the parting is at 5, mlx-lm's
    token is ahead in both of the target's computations, by about its whole range there."""
    prompt, peer = _greedy(target)
    assert len(peer) > 6
    loop = loop_logprobs(target, prompt, 5)
    assert int(mx.argmax(loop).item()) == peer[5]  # the loop's step 5 is the peer's
    worst = int(mx.argmin(loop).item())
    ours = peer[:5] + [worst] + peer[6:]
    parted = where_parted(target, prompt, peer, ours)
    assert parted["at"] == 5 and parted["peer_token"] == peer[5] and parted["our_token"] == worst
    spread = (loop.max() - loop.min()).item()
    assert abs(parted["loop_gap"] - spread) <= 1e-3 * spread
    assert parted["chunked_gap"] > 0.5 * spread  # the same model read at once agrees to rounding
    assert parted["verdict"] == "unexplained"
    assert describe(parted).startswith("NO: parted at 5, unexplained (gaps ")


def test_an_ending_side_is_named(target):
    """mlx-lm stopped (its output shorter) where ours went on: the end token is what it chose."""
    prompt, peer = _greedy(target)
    parted = where_parted(target, prompt, peer[:4], peer[:4] + [peer[4]])
    assert parted["at"] == 4 and parted["peer_token"] is None and parted["peer_text"] == "<end>"
    assert parted["our_token"] == peer[4] and "loop_gap" in parted


def test_describe_a_tie_and_a_sampled_difference():
    tie = {"at": 439, "verdict": "tie", "loop_gap": 0.0625, "chunked_gap": 0.0}
    assert describe(tie) == "NO: parted at 439, a tie (gaps 0.0625 / 0)"
    assert describe(None) == "NO"


def test_benchmark_reports_where_a_mode_parted(tiny_engine, cache_home, monkeypatch):
    """A mode whose output left mlx-lm's (here: one token swapped after the real run) is reported
    with where it parted, and the table says so."""
    real_run = benchmark.engine_run

    def swapped(engine, prompt, *args):
        s = real_run(engine, prompt, *args)
        s.tokens = s.tokens[:3] + [(s.tokens[3] + 1) % 64] + s.tokens[4:]
        return s

    monkeypatch.setattr(benchmark, "engine_run", swapped)
    content = build_content(tiny_engine, "chat")
    content.max_tokens = 12
    result = benchmark.bench_decode(tiny_engine, content, ["lookup"], 4, 1, SamplingParams(), lambda msg: None)
    m = result["modes"]["lookup"]
    assert not m["identical"] and m["parted"]["at"] == 3
    assert m["parted"]["shared_speedup"] > 0  # the speed ratio over the 3 tokens both wrote
    table = benchmark.format_table({"contents": {"chat": result}})
    assert "NO: parted at 3, " in table and "x over the 3 tokens both wrote" in table


def test_runs_mark_when_their_tokens_came(tiny_engine):
    """Both sides record, as tokens come, how many so far and when: counts rise to the output's
    length, times rise to the run's end."""
    content = build_content(tiny_engine, "chat")
    runs = [tiny_engine.call(plain_mlx_lm, content.prompts[0], 12, SamplingParams()),
            benchmark.engine_run(tiny_engine, content.prompts[0], 12, SamplingParams(), "lookup", 4)]
    for s in runs:
        counts, times = zip(*s.marks)
        assert list(counts) == sorted(set(counts)) and counts[-1] == len(s.tokens)
        assert list(times) == sorted(times) and 0 < times[0] and times[-1] <= s.seconds
        assert s.seconds_to(1) == times[0] and s.seconds_to(len(s.tokens)) == times[-1]


def test_shared_speedup_compares_the_time_to_the_same_tokens():
    """Ours had its first 4 tokens after 0.5 s (one round of 5), the peer after 2.0 s (a token each
    0.5 s): 4x over those 4, whatever either side wrote after them."""
    ours = benchmark.Sample(list(range(9)), 3.0, 0.2, 0.0, 5.0, marks=[(1, 0.2), (6, 0.5), (9, 3.0)])
    peer = benchmark.Sample(list(range(5)), 2.5, 0.5, 0.0, 1.0, marks=[(i, 0.5 * i) for i in range(1, 6)])
    assert ours.seconds_to(4) == 0.5 and peer.seconds_to(4) == 2.0 and ours.seconds_to(20) == 3.0
    assert benchmark.shared_speedup(ours, peer, 4) == 4.0
    assert benchmark.shared_speedup(ours, peer, 1) == 2.5
    assert benchmark.shared_speedup(ours, peer, 0) is None
