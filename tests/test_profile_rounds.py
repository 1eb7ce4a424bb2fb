"""scripts/profile_rounds.py: the verify loop's rounds and bare forwards of the same inputs, timed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine import Engine


def load_script():
    spec = importlib.util.spec_from_file_location(
        "profile_rounds", Path(__file__).resolve().parents[1] / "scripts" / "profile_rounds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


PROMPT = list(range(3, 40)) * 6  # a context to copy from


def test_times_every_round_of_the_loop_and_its_replays(tiny_model_dir):
    """Each round of a greedy lookup decode is timed in the loop and replayed three ways on a second
    cache that follows the loop's (a round's kept tokens stay, so the replay ends where the loop did)."""
    script = load_script()
    with Engine(str(tiny_model_dir), max_draft=8, prefix_cache=False) as engine:
        report = engine.call(script.profile, PROMPT, 48, 8)
    assert report["rounds"] >= 1 and report["tokens"] <= 48  # never drafted past the budget
    assert report["depths"] == [len(PROMPT) - 1, len(PROMPT) - 1 + report["tokens"]]
    assert report["replay_depth"] == report["depths"][1]  # the replay kept what the loop kept
    assert 1 <= report["mean_width"] <= 9
    assert list(report["ms_a_round"]) == list(script.ROWS[1:])
    assert all(ms > 0 for ms in report["ms_a_round"].values())


def test_an_auto_cap_follows_the_engines_controller(tiny_model_dir, cache_home):
    """With the engine's default cap (`auto`, the cost curve's controller) the loop runs as the
    engine's would, never drafting past the budget; the same request through `engine.generate`
    is timed after its first round."""
    script = load_script()
    with Engine(str(tiny_model_dir), max_draft="auto", prefix_cache=False) as engine:
        report = engine.call(script.profile, PROMPT, 40, "auto")
        whole = script.through_engine(engine, PROMPT, 40, "auto")
    assert report["rounds"] >= 1 and report["tokens"] <= 40
    assert 1 <= whole["tokens"] <= 40 and whole["rounds"] >= 1 and (whole["ms_a_round"] is None) == (whole["rounds"] == 1)
