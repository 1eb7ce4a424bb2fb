"""The batch cost surface (engine/tuning/batch_cost.py): measured through the scheduler's batched
forward, cached under the width curve's key, read back; what the draft controller, the
scheduler and `--max-batch auto` take from it; `benchmark --concurrency` on a tiny model.
Models: a tiny random qwen3 (real engine, real MLX forwards); synthetic surfaces where a
test needs known costs."""

from __future__ import annotations

import json
import math

import pytest

from agent_bridge.cli import main
from engine import (BatchSurface, CostCurve, DraftController, Engine, GenerationRequest, curve_key,
                    load_batch_surface, load_target, surface_for, tune_batch)
from engine.tuning.batch_cost import save_batch_surface, surface_path
from engine.decoding.batch_verify import Forward, choose_batch
from engine.tuning.cost_curve import curve_path
from greedy_ties import assert_same_greedy_away_from_ties

BATCHES, WIDTHS = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]


def synthetic(narrow_share=lambda b: 1 / math.sqrt(b), widest: int = 8, key: dict | None = None) -> BatchSurface:
    """Alone a width-w forward costs 1 + 0.05 (w - 1); b of them batched cost b times that times
    `narrow_share(b)` up to `widest`, and no less than alone beyond it."""
    alone = lambda w: 1.0 + 0.05 * (w - 1)  # noqa: E731
    rows = [[b * alone(w) * (narrow_share(b) if w <= widest or b == 1 else 1.0) for w in WIDTHS] for b in BATCHES]
    return BatchSurface(list(BATCHES), list(WIDTHS), rows, key=dict(key or {}))


def knee_curve(knee: int = 16) -> CostCurve:
    widths = list(range(1, 65))
    row = [1.0 + 0.01 * (w - 1) if w <= knee else 1.0 + 0.01 * (knee - 1) + 0.5 * (w - knee) for w in widths]
    return CostCurve(widths, [0], [row])


def test_measured_once_cached_beside_the_curve_and_read_back(cache_home, target):
    surface = tune_batch(target, batches=(1, 2), widths=(1, 2, 4), depth=32, repeats=1)
    assert surface.measured and surface.batches == [1, 2] and surface.widths == [1, 2, 4]
    assert all(s > 0 for row in surface.seconds for s in row)
    key = curve_key(target)
    path = surface_path(key)
    assert path.parent == cache_home and path.is_file() and path != curve_path(key)
    assert json.loads(path.read_text())["key"] == key
    again = tune_batch(target)  # cached: not measured again with the default (larger) grid
    assert again.to_dict() == surface.to_dict()
    assert surface_for(target).to_dict() == surface.to_dict()  # what the engine reads per round
    assert load_batch_surface(curve_key(target, kv_bits=8)) is None  # another key misses
    path.write_text("{not json")
    assert load_batch_surface(key) is None
    assert tune_batch(target, batches=(1, 2), widths=(1, 2), depth=32, repeats=1).widths == [1, 2]


def test_caches_the_scheduler_cant_merge_measure_as_unbatched(cache_home, tmp_path):
    from tiny_models import build_family_model

    sliding = load_target(build_family_model(tmp_path / "gemma3", "gemma3"))  # rotating KV layers
    surface = tune_batch(sliding, widths=(1, 2, 4), depth=32, repeats=1)
    assert surface.measured and surface.batches == [1]
    assert surface.max_batched_width() == 0 and surface.factor(4, 4) == pytest.approx(1.0)  # each runs alone
    assert surface.best_max_batch() == 4  # no throughput to gain or lose: they still take turns
    assert load_batch_surface(curve_key(sliding)).batches == [1]


def test_unmeasured_defaults_keep_issue_14s_choices():
    d = BatchSurface.default()
    assert not d.measured and d.max_batched_width() == 8 and d.best_max_batch() == 4
    assert d.factor(4, 16) == 1.0


def test_widest_batched_width_and_max_batch_follow_the_surface():
    s = synthetic(widest=8)
    assert s.max_batched_width() == 14  # 8 saves half, 16 nothing: the line between saves a tenth up to 14
    assert s.saving(2, 4) == pytest.approx(1 - 1 / math.sqrt(2)) and s.saving(4, 16) == pytest.approx(0.0)
    assert s.best_max_batch() == 8  # each doubling gains sqrt(2): more than 15%
    assert s.best_max_batch(gain=1.0) == 4  # twice batch 1 at 4; 8 is not twice 4
    assert s.best_max_batch(gain=2.0) == 1  # none is three times batch 1
    flat = synthetic(lambda b: 1.0)  # batching saves nothing: nothing batched, turns as by default
    assert flat.max_batched_width() == 0 and flat.best_max_batch() == 4
    # past 2 sequences the batch stops gaining: 2
    assert synthetic(lambda b: 1 / math.sqrt(min(b, 2))).best_max_batch() == 2


def test_a_width_between_measured_ones_batches_where_the_line_between_still_saves():
    """A lookup copy's 17-token forward (a 16-token verbatim draft) beside a surface measured at
    16, where batching saves, and 32, where it doesn't: judged by the interpolated surface, not
    sent alone for being past the widest measured width that saves."""
    fw = lambda *widths: [Forward(list(range(w)), []) for w in widths]  # noqa: E731
    s = synthetic(widest=16)
    assert s.saving(4, 16) == pytest.approx(0.5) and s.saving(4, 32) == pytest.approx(0.0)
    assert s.is_batched(17) and s.is_batched(27) and not s.is_batched(28) and s.max_batched_width() == 27
    assert [len(f.tokens) for f in choose_batch(fw(17, 17, 17, 17), s)] == [17] * 4
    assert choose_batch(fw(30, 30), s) == []  # the line between saves too little there: each alone


def test_factor_prices_a_draft_among_batched_sequences():
    s = synthetic(widest=8)
    assert s.factor(1, 32) == 1.0
    assert s.factor(4, 4) == pytest.approx(1.0)  # batched as cheaply as a plain step
    assert s.factor(4, 16) == pytest.approx(2.0)  # runs alone while plain steps cost half: sqrt(4) dearer


def test_the_scheduler_batches_what_the_surface_says_pays():
    fw = lambda *widths: [Forward(list(range(w)), []) for w in widths]  # noqa: E731
    widths = lambda fs: sorted(len(f.tokens) for f in fs)  # noqa: E731
    assert widths(choose_batch(fw(3, 2, 16, 2), synthetic(widest=8))) == [2, 2, 3]  # 16: wider than pays
    assert choose_batch(fw(2, 3), synthetic(lambda b: 1.0)) == []  # batching saves nothing: all alone
    assert widths(choose_batch(fw(2, 16), BatchSurface.default())) == [2]  # unmeasured: up to 8 wide
    # Batching pays at every width (sqrt(b) for b rows) but a batch computes every row at its
    # widest member's width: one long draft among three one-token steps is cheaper alone.
    alone = lambda w: 1.0 + 0.2 * (w - 1)  # noqa: E731
    padded = BatchSurface(BATCHES, WIDTHS, [[math.sqrt(b) * alone(w) for w in WIDTHS] for b in BATCHES])
    assert padded.max_batched_width() == 32
    assert widths(choose_batch(fw(1, 16, 1, 1), padded)) == [1, 1, 1]
    assert widths(choose_batch(fw(16, 16, 1), padded)) == [1, 16, 16]


def test_controller_drafts_shorter_while_sequences_share_the_forward():
    alone = DraftController(knee_curve(16), surface=synthetic(widest=8))
    shared = DraftController(knee_curve(16), surface=synthetic(widest=8))
    shared.batch = 4
    for _ in range(40):
        for c in (alone, shared):
            k = c()
            c.observe(k, k)  # every drafted token holds
    assert alone() == 15  # the width curve's knee
    assert shared() == 7  # a width-8 forward still batches; wider ones would run alone
    shared.batch = 1  # the others finished: back to the curve's own optimum, at once
    assert shared() == 15


def test_engine_batches_only_what_the_surface_says_pays(cache_home, tiny_model_dir):
    prompts = ["a b c a b c a b c a b", "The quick brown fox " * 6, "x y z"]
    with Engine(str(tiny_model_dir), max_batch=3, prefix_cache=False) as engine:
        ids = [engine.encode(p) for p in prompts]
        key = engine.call(lambda t: curve_key(t))
        alone = []
        engine.max_batch = 1
        for i in ids:
            alone.append(engine.submit(GenerationRequest(i, max_tokens=20, mode="lookup")).result().token_ids)
        engine.max_batch = 3
        for surface, batched in ((synthetic(lambda b: 1.0, key=key), False), (synthetic(key=key), True)):
            save_batch_surface(surface)
            before = engine.load()["batched_rounds"]
            jobs = [engine.submit(GenerationRequest(i, max_tokens=20, mode="lookup")) for i in ids]
            for i, want, j in zip(ids, alone, jobs):  # batched vs alone: other kernels' rounding
                assert_same_greedy_away_from_ties(engine, i, want, j.result().token_ids)
            assert (engine.load()["batched_rounds"] > before) is batched
    # --max-batch auto: the surface's choice (8 for the paying one, cached above)
    with Engine(str(tiny_model_dir), max_batch="auto", prefix_cache=False) as engine:
        assert engine.max_batch == 8


def test_benchmark_concurrency_on_a_tiny_model(cache_home, tiny_model_dir, capsys):
    rc = main(["benchmark", "--model", str(tiny_model_dir), "--concurrency", "1,2", "--contents", "chat,code",
               "--modes", "lookup", "--trials", "1", "--max-tokens", "12", "--no-tune", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["concurrency"] == [1, 2]
    assert report["batch_surface"]["measured"] is False and report["batch_surface"]["max_batched_width"] == 8
    rows = report["concurrency"]
    assert [(r["content"], r["requests"]) for r in rows] == [("chat", 1), ("chat", 2), ("code", 1), ("code", 2)]
    for r in rows:
        assert r["mode"] == "lookup" and r["identical"] and r["differing"] == 0 and r["ratio"] > 0
        for side in ("one_at_a_time", "together"):
            s = r[side]
            assert 0 < s["tokens"] <= 12 * r["requests"] and s["tok_s"] > 0
            assert 0 < s["ttft_mean_s"] <= s["ttft_max_s"]
        assert r["one_at_a_time"]["batched_rounds"] == 0
    assert all(r["together"]["batched_rounds"] > 0 for r in rows if r["requests"] == 2)
    assert len(rows[1]["prompt_tokens"]) == 2  # distinct requests of one content


def test_benchmark_concurrency_refuses_bad_levels_and_contents(tiny_model_dir, capsys):
    assert main(["benchmark", "--model", str(tiny_model_dir), "--concurrency", "0,2"]) != 0
    assert "--concurrency" in capsys.readouterr().err
    assert main(["benchmark", "--model", str(tiny_model_dir), "--concurrency", "2", "--contents", "agent"]) != 0
    assert "--contents" in capsys.readouterr().err
