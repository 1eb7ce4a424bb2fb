"""scripts/profile_rounds.py: the verify loop's rounds and bare forwards of the same inputs, timed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine import Engine


def test_times_every_round_four_ways(tiny_model_dir):
    """Each round of a greedy lookup decode is timed in the loop and replayed three ways on a second
    cache that follows the loop's (a round's kept tokens stay, so the replay ends where the loop did)."""
    spec = importlib.util.spec_from_file_location(
        "profile_rounds", Path(__file__).resolve().parents[1] / "scripts" / "profile_rounds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompt = list(range(3, 40)) * 6  # a context to copy from
    with Engine(str(tiny_model_dir), max_draft=8, prefix_cache=False) as engine:
        report = engine.call(script.profile, prompt, 48, 8)
    assert report["rounds"] >= 1 and report["tokens"] >= 48
    assert report["depths"] == [len(prompt) - 1, len(prompt) - 1 + report["tokens"]]
    assert report["replay_depth"] == report["depths"][1]  # the replay kept what the loop kept
    assert 1 <= report["mean_width"] <= 9
    assert list(report["ms_a_round"]) == list(script.ROWS)
    assert all(ms > 0 for ms in report["ms_a_round"].values())
