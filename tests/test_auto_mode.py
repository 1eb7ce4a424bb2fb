"""`auto` runs the mode expected fastest here, from measurements: a head's draft cost on this
machine, the verify cost curve, the acceptance seen of each head, lookup's matches on the prompt
(engine/tuning/mode_choice.py). The bundled model and its heads, real engine; what a measurement
would say is stored where the engine reads it, as `mlx-dspark tune` or an earlier run stores it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import REFERENCE_MODEL_DIR, Engine, GenerationRequest
from engine.base.events import Done
from engine.drafting.heads.registry import REFERENCE_DRAFTERS
from engine.tuning.cost_curve import MAX_WIDTH
from engine.tuning.draft_control import forget_seen_acceptance, seen_acceptance
from engine.tuning.head_cost import HEAD_COSTS, head_cost_key, save_head_cost
from engine.tuning.mode_choice import replay_lookup

pytestmark = pytest.mark.skipif(
    not (REFERENCE_MODEL_DIR / "config.json").exists()
    or not all((REFERENCE_DRAFTERS / k / "model.safetensors").exists() for k in ("dflash", "dspark")),
    reason="the reference model or its trained heads are absent",
)

QUESTION = "Write a Python function that returns the larger of two numbers."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One measurement folder for the module (the engine and the doctor subprocess read it)."""
    path = tmp_path_factory.mktemp("auto-mode-cache")
    before = os.environ.get("MLX_DSPARK_CACHE_DIR")
    os.environ["MLX_DSPARK_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("MLX_DSPARK_CACHE_DIR")
    else:
        os.environ["MLX_DSPARK_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def engine(cache):
    with Engine(prefix_cache=False, prefill_chunk=256) as engine:
        yield engine


@pytest.fixture(autouse=True)
def fresh_process_record():
    forget_seen_acceptance()
    yield
    forget_seen_acceptance()


def store_head_costs(engine, **ratios: float) -> None:
    """Record each head's draft cost (in plain steps) as a measurement on this machine would."""
    for mode, ratio in ratios.items():
        key = engine.call(lambda t: head_cost_key(t, mode))
        save_head_cost({"key": key, "draft_s": ratio * 0.01, "step_s": 0.01, "ratio": ratio, "block": 7})
        HEAD_COSTS.forget()


def run(engine, prompt: list[int], mode: str) -> Done:
    events = list(engine.generate(GenerationRequest(prompt, max_tokens=24, mode=mode)))
    return events[-1]


def test_heads_that_cost_more_than_they_gain_lose_to_lookup(engine):
    store_head_costs(engine, dflash=5.0, dspark=5.0)
    prompt = engine.render_chat([{"role": "user", "content": QUESTION}])
    done = run(engine, prompt, "auto")
    choice = engine.last_mode_choice
    assert done.stats.mode == choice.mode == "lookup"
    heads = {s.mode: s for s in choice.speeds if s.mode != "lookup"}
    assert set(heads) == {"dflash", "dspark"} and all(s.draft_cost == 5.0 and s.draft == 0 for s in heads.values())
    assert "dspark" in choice.reason() and "draft 5.00 of a step" in choice.reason()
    assert done.token_ids == run(engine, prompt, "baseline").token_ids


def test_a_cheap_well_accepted_head_wins_and_stays_lossless(engine):
    store_head_costs(engine, dflash=5.0, dspark=0.01)
    prompt = engine.render_chat([{"role": "user", "content": QUESTION}])
    at_prior = {s.mode: s for s in engine.mode_choice(prompt).speeds}["dspark"]
    record = engine.call(lambda t: seen_acceptance(t, "dspark"))
    for _ in range(40):  # what earlier dspark requests in this process would have left
        record.observe(7, 7)
    done = run(engine, prompt, "auto")
    choice = engine.last_mode_choice
    assert done.stats.mode == choice.mode == "dspark"
    speeds = {s.mode: s for s in choice.speeds}
    assert speeds["dspark"].speed > max(speeds["lookup"].speed, speeds["dflash"].speed)
    assert at_prior.acceptance_from == "prior" and speeds["dspark"].acceptance_from == "seen in 40 rounds"
    assert speeds["dspark"].speed > at_prior.speed  # the acceptance seen moves the estimate
    assert done.token_ids == run(engine, prompt, "baseline").token_ids


def test_lookup_replay_reads_the_prompts_own_repeats():
    costs = [1.0 + 0.15 * k for k in range(MAX_WIDTH)]
    block = list(range(100, 400))
    repeated = replay_lookup(block * 3, costs)
    fresh = replay_lookup(list(range(1000, 1900)), costs)
    assert repeated.long_tokens > 0.8 * repeated.tokens
    assert fresh.long_tokens == 0 and fresh.tokens == fresh.rounds  # nothing to match: a token a round


def test_doctor_names_autos_pick_and_why(engine, cache, tmp_path):
    store_head_costs(engine, dflash=5.0, dspark=5.0)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(QUESTION)
    env = {k: v for k, v in os.environ.items() if k != "MLX_DSPARK_NO_REEXEC"}
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "doctor", "--no-roofline", "--no-prefill",
                        "--prompt-file", str(prompt)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert f"auto mode: lookup for the prompt in {prompt}" in r.stdout
    assert "dspark 1.00x (draft 5.00 of a step" in r.stdout
