"""Per-position recurrent state capture (engine/caches/state_capture.py) against snapshot + replay.

Every recurrent family is a tiny random model built from mlx-lm's own class
(tests/tiny_models.py). Checked: the state a capture restores after j accepted tokens is
the one a replay of those j tokens builds (Gated DeltaNet, Mamba 2, short conv, falcon_h1's
CacheList); both ways decode the same tokens as mlx-lm, with drafts accepted in full and
rejected at several positions; sampling stays exact with capture on a Mamba 2 hybrid
(chi-square); anything the capture can't account for falls back to replay; and the way
used is the one the measured cost curve found cheaper. The full greedy matrix with capture
on is tests/test_lossless_families.py (capture is the default there).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from engine import Engine, SamplingParams
from engine.tuning.cost_curve import (
    CostCurve,
    curve_key,
    measure_cost_curve,
    pick_rollback,
    save_cost_curve,
    state_rollback,
)
from engine.kernels import gated_delta_chunked
from engine.caches import state_capture
from engine.caches.rollback import leaves, mark, needs_replay, take_back
from engine.caches.state_capture import Capture, bind, recording
from engine.model.target import load_target
from test_lossless import corrupt, lookup_ids, mlx_lm_greedy
from test_sampling import check_engine_sampling
from tiny_models import WINDOW, build_family_model, family_installed

RECURRENT = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "lfm2", "lfm2_moe",
             "nemotron_h", "granitemoehybrid", "falcon_h1"]
GATED_DELTA = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear"}
SCALAR_GATES = GATED_DELTA - {"kimi_linear"}  # kimi's gates are per key dimension: it steps


FAMILY_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(not family_installed(f), reason=f"mlx-lm has no {f}"))
                 for f in RECURRENT]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(family):
        if family not in built:
            built[family] = build_family_model(tmp_path_factory.mktemp(family), family, seed=5)
        return built[family]

    return get


def _slots(cache) -> list:
    out = []
    for c in leaves(cache):
        if hasattr(c, "cache"):
            out += [a for a in c.cache if a is not None]
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


def _recorded_beside_plain(target, context: list[int], fed: list[int]) -> tuple:
    """Two caches holding `context`, each marked; `fed` run into the first with a recording.
    Returns (captured cache, plain cache, their marks, the Capture or None, the recorded logits)."""
    captured_cache, plain = target.make_cache(), target.make_cache()
    for c in (captured_cache, plain):
        target.forward(context, c)
        mx.eval([x.state for x in c])
    a, b = mark(captured_cache), mark(plain)
    with recording() as tape:
        logits = target.forward(fed, captured_cache)
    return captured_cache, plain, a, b, bind(tape, captured_cache, len(fed)), logits


def _assert_same_states(target, captured_cache, replayed, what: str) -> None:
    """Every layer's slots equal (float32 rounding), and so does the next pass's output."""
    for x, y in zip(_slots(captured_cache), _slots(replayed)):
        assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4), what
    nxt = [9, 10, 11]
    assert mx.allclose(target.forward(nxt, captured_cache), target.forward(nxt, replayed), atol=1e-4), what


@pytest.fixture
def step_loop():
    """Gated DeltaNet one position at a time in every pass (a recorded pass always is), so the
    capture and the replay can be compared bit for bit (engine/kernels/gated_delta_chunked.py)."""
    with gated_delta_chunked.disabled():
        yield


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_capture_restores_what_replay_restores(family, models, step_loop):
    """After a verify pass of 11 tokens, keeping j of them (every j: a draft rejected at each
    position): every layer's state from the capture equals the state a replay of the j tokens
    builds, and so does the next pass's output; a second take-back (a stop mid-round,
    `keep_only`) works from the same capture."""
    target = load_target(models(family))
    assert needs_replay(target.make_cache())
    context, fed = list(range(5, 5 + WINDOW + 7)), list(range(60, 71))
    for kept, then in [(j, None) for j in range(1, len(fed))] + [(7, 3), (10, 1)]:
        captured_cache, replayed, a, b, capture, logits = _recorded_beside_plain(target, context, fed)
        assert isinstance(capture, Capture), f"{family}: the verify pass could not be captured"
        assert mx.array_equal(logits, target.forward(fed, replayed)), "recording changed the verify pass"
        take_back(captured_cache, a, len(fed), kept, replay=None, captured=capture)
        take_back(replayed, b, len(fed), kept, replay=lambda: target.forward(fed[:kept], replayed))
        if then is not None:
            take_back(captured_cache, a, kept, then, replay=None, captured=capture)
            take_back(replayed, b, kept, then, replay=lambda: target.forward(fed[:then], replayed))
        _assert_same_states(target, captured_cache, replayed, f"{family} kept {kept} then {then}")


def test_bind_refuses_what_it_cannot_explain(models):
    """A recurrence the capture didn't see, or a conv it can't place, means no capture
    (the round replays): never a guess."""
    target = load_target(models("qwen3_next"))
    fed = list(range(20, 28))

    def recorded():
        cache = target.make_cache()
        target.forward(list(range(3, 15)), cache)
        with recording() as tape:
            target.forward(fed, cache)
        return tape, cache

    tape, cache = recorded()
    assert bind(tape, cache, len(fed)) is not None
    assert bind(None, cache, len(fed)) is None  # nothing recorded
    assert bind(tape, cache, len(fed) + 1) is None  # another width than was fed
    tape.states.pop(next(iter(tape.states)))  # a Gated DeltaNet layer unseen
    assert bind(tape, cache, len(fed)) is None
    tape, cache = recorded()
    tape.convs.append(tape.convs[0])  # a conv no cache slot explains
    assert bind(tape, cache, len(fed)) is None
    with recording(False) as nothing:
        assert nothing is None


@pytest.mark.parametrize("family", [f for f in FAMILY_PARAMS if f.values[0] in SCALAR_GATES])
def test_closed_form_capture_restores_what_replay_restores(family, models):
    """Gated DeltaNet recorded through the chunked form (no step loop): after a verify pass of
    11 or 70 tokens (two chunks), keeping j of them, every layer's state equals what a replay
    of the j tokens builds, to float32 rounding; nothing was kept per position."""
    target = load_target(models(family))
    context = list(range(5, 5 + WINDOW + 7))
    for fed, kept_ones in [(list(range(60, 71)), (1, 4, 10)), (list(range(100, 170)), (1, 63, 64, 65, 69))]:
        for kept in kept_ones:
            captured_cache, replayed, a, b, capture, _ = _recorded_beside_plain(target, context, fed)
            assert isinstance(capture, Capture) and capture.per_position_bytes == 0, family
            take_back(captured_cache, a, len(fed), kept, replay=None, captured=capture)
            take_back(replayed, b, len(fed), kept, replay=lambda: target.forward(fed[:kept], replayed))
            _assert_same_states(target, captured_cache, replayed, f"{family}: {len(fed)} fed, kept {kept}")


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_capture_and_replay_decode_the_same(family, models, monkeypatch):
    """Both ways give mlx-lm's greedy tokens with drafts accepted in full and rejected at
    several positions; replay runs more forwards (so each way really ran). Over a memory budget
    of one byte, with Gated DeltaNet stepping, the capture replays; layers that keep nothing
    per position (Mamba 2's closed form, short convs) still capture."""
    with Engine(str(models(family)), prefix_cache=False) as engine:
        rng = random.Random(11)
        vocab = engine.target.vocab_size
        prompt = [rng.randrange(vocab) for _ in range(WINDOW + 9)]
        ref = mlx_lm_greedy(engine, prompt, 24)
        corpora = [prompt + ref, corrupt(prompt + ref, 4, vocab)]
        for bad in (0, 5):
            wrong = list(ref)
            wrong[bad] = (wrong[bad] + 1) % vocab
            corpora.append(prompt + wrong)
        forwards = {}
        plain_forward = engine.target.forward
        for mode in ("capture", "replay", "over budget"):
            calls = [0]
            if mode == "over budget":
                monkeypatch.setattr(state_capture, "CAPTURE_BYTES", 1)
                routed = gated_delta.gated_delta_ops  # the chunked router over the step loop
                monkeypatch.setattr(gated_delta, "gated_delta_ops", getattr(routed, "__wrapped__", routed))

            def counting(tokens, cache, calls=calls):
                calls[0] += 1
                return plain_forward(tokens, cache)

            engine.target.forward, engine.target.state_rollback = counting, mode.replace("over budget", "capture")
            try:
                for j, corpus in enumerate(corpora):
                    for cap in (12, 3):
                        ids, _ = lookup_ids(engine, prompt, cap, [corpus], max_tokens=24)
                        assert ids == ref, f"{family} {mode}: corpus {j}, cap {cap}"
            finally:
                del engine.target.forward
                engine.target.state_rollback = None
            forwards[mode] = calls[0]
        assert forwards["replay"] > forwards["capture"], forwards
        assert forwards["over budget"] == forwards["replay" if family in GATED_DELTA else "capture"], forwards


@pytest.mark.parametrize("family", ["nemotron_h"])
def test_sampling_with_capture_matches_target(family, tmp_path):
    """Chi-square with capture on a Mamba 2 hybrid (qwen3_next's Gated DeltaNet is covered by
    test_lossless_families, where capture is the default), prompt past the window."""
    path = build_family_model(tmp_path / family, family, seed=7, scale=2.0)
    with Engine(str(path)) as engine:
        engine.target.state_rollback = "capture"
        rng = random.Random(3)
        prompt = [rng.randrange(engine.target.vocab_size) for _ in range(WINDOW + 5)]
        check_engine_sampling(engine, prompt, SamplingParams(temperature=1.0, top_k=4), seeds=1200)


# -- the pick ------------------------------------------------------------------------------


def test_pick_follows_the_measured_costs():
    cheap, dear = [[1.0, 1.2, 1.5]], [[1.0, 1.6, 2.5]]
    assert pick_rollback({"capture": cheap, "replay": dear}) == "capture"
    assert pick_rollback({"capture": dear, "replay": cheap}) == "replay"
    assert pick_rollback({"capture": cheap, "replay": cheap}) == "capture"  # a tie: no replay in the loop
    assert pick_rollback({"replay": dear}) == "replay"  # the model can't be captured


def test_measured_curve_records_both_ways_and_uses_the_cheaper(models, tiny_model_dir, cache_home):
    """`tune` times a recurrent model both ways: the curve's seconds (what `auto` plans with)
    are the cheaper way's, and decoding then takes back drafts that way; a saved curve that
    found replay cheaper makes the engine replay. An attention-only model has no choice."""
    target = load_target(models("nemotron_h"))
    curve = measure_cost_curve(target, widths=(1, 2, 4, 8), depths=(24,), repeats=1, key=curve_key(target))
    assert set(curve.rollback_seconds) == {"capture", "replay"}
    assert curve.rollback == pick_rollback(curve.rollback_seconds)
    assert curve.seconds == curve.rollback_seconds[curve.rollback]
    assert CostCurve.from_dict(curve.to_dict()).rollback_seconds == curve.rollback_seconds

    for found in ("capture", "replay"):
        other = "replay" if found == "capture" else "capture"
        rows = {found: [[0.01, 0.011, 0.012, 0.014]], other: [[0.01, 0.02, 0.04, 0.08]]}
        saved = CostCurve([1, 2, 4, 8], [24], rows[found], key=curve_key(target), rollback=pick_rollback(rows),
                          rollback_seconds=rows)
        save_cost_curve(saved)
        assert state_rollback(target) == found
        target.state_rollback = other  # an explicit choice wins over the curve
        assert state_rollback(target) == other
        target.state_rollback = None

    plain = load_target(tiny_model_dir)
    curve = measure_cost_curve(plain, widths=(1, 2, 4), depths=(16,), repeats=1)
    assert curve.rollback == "" and curve.rollback_seconds == {}


def test_roofline_reports_the_pick(models, cache_home):
    from engine.tuning.roofline import roofline

    target = load_target(models("lfm2"))
    rows = {"capture": [[0.01, 0.012, 0.02]], "replay": [[0.01, 0.02, 0.05]]}
    curve = CostCurve([1, 4, 16], [64], rows["capture"], rollback="capture", rollback_seconds=rows)
    report = roofline(target, curve, bandwidth=1e10)
    assert report["rollback"] == "capture"
    assert report["rollback_cost"] == {"capture": {"4": 1.2, "16": 2.0}, "replay": {"4": 2.0, "16": 5.0}}
    assert "rollback" not in roofline(target, CostCurve([1, 4], [64], [[0.01, 0.02]]), bandwidth=1e10)


def test_a_pass_over_the_capture_budget_replays_and_the_curve_keeps_capture(models, monkeypatch):
    """A layer that steps (kimi's per-key gates) keeps a state per position: a pass wider than the
    budget allows stops capturing and replays, as the verify loop's round would, and the curve
    still times capture (it is no model that can't be captured); a narrower pass captures."""
    target = load_target(models("kimi_linear"))
    cache = target.make_cache()
    target.forward(list(range(3, 30)), cache)
    with recording() as tape:
        target.forward(list(range(40, 42)), cache)
    per_position = tape.per_position_bytes
    assert per_position > 0
    monkeypatch.setattr(state_capture, "CAPTURE_BYTES", 4 * per_position)
    for width, captured in ((4, True), (5, False)):
        with recording() as tape:
            target.forward(list(range(50, 50 + width)), cache)
        assert (bind(tape, cache, width) is not None) == captured and tape.over_budget == (not captured)
    curve = measure_cost_curve(target, widths=(1, 2, 4, 8), depths=(16,), repeats=1)
    assert set(curve.rollback_seconds) == {"capture", "replay"}


def test_a_model_that_cannot_be_captured_replays(models, monkeypatch):
    """Where no verify pass of the model binds (a recurrence the capture doesn't route), the
    curve measures replay alone and picks it."""
    monkeypatch.setattr(state_capture, "bind", lambda tape, cache, fed: None)
    target = load_target(models("lfm2"))
    curve = measure_cost_curve(target, widths=(1, 2, 4), depths=(16,), repeats=1)
    assert curve.rollback == "replay" and set(curve.rollback_seconds) == {"replay"}
