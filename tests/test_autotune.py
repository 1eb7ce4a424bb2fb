"""Auto-tune: the cost-curve cache is keyed and invalidated correctly, the static cap
follows the curve, and the adaptive controller converges on synthetic acceptance."""

from __future__ import annotations

import json

import pytest

from engine import (
    CostCurve,
    DraftController,
    GenerationRequest,
    best_draft_cap,
    cache_dir,
    curve_for_requests,
    curve_key,
    load_cost_curve,
    tune,
)
from engine.tuning.cost_curve import curve_path
from engine.tuning.draft_control import expected_tokens

SMALL = dict(widths=(1, 2, 4, 8), depths=(16, 64), repeats=1)


def knee_curve(knee: int = 16) -> CostCurve:
    """Nearly free up to width `knee`, steep after: at full acceptance the best cap is knee - 1."""
    widths = list(range(1, 65))
    row = [1.0 + 0.01 * (w - 1) if w <= knee else 1.0 + 0.01 * (knee - 1) + 0.5 * (w - knee) for w in widths]
    return CostCurve(widths, [0], [row])


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_DSPARK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mlx-dspark"
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_tune_measures_once_then_reads_the_cache(cache_home, target):
    curve = tune(target, **SMALL)
    assert curve.measured and curve.widths == [1, 2, 4, 8] and curve.depths == [16, 64]
    assert all(s > 0 for row in curve.seconds for s in row)
    path = curve_path(curve_key(target))
    assert path.parent == cache_home and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["key"] == curve_key(target)
    again = tune(target, **SMALL)
    assert again.measured_at == curve.measured_at and again.seconds == curve.seconds  # read, not remeasured
    refreshed = tune(target, refresh=True, **SMALL)
    assert refreshed.seconds != curve.seconds or refreshed.measure_s != curve.measure_s


@pytest.mark.parametrize(
    "change", [{"model": "another-model-identity"}, {"mlx": "0.0.1"}, {"kv_bits": 4},
               {"dtype": "bfloat16"}, {"device": "gpu:Apple M9"}, {"quantization": {"bits": 4, "group_size": 64}}]
)
def test_a_different_key_misses_and_remeasures(cache_home, target, change):
    measured = tune(target, **SMALL)
    other_key = curve_key(target, **change)
    assert other_key != measured.key
    assert curve_path(other_key) != curve_path(measured.key)
    assert load_cost_curve(other_key) is None
    assert load_cost_curve(measured.key) is not None


def test_a_new_mlx_version_remeasures(cache_home, target, monkeypatch):
    import mlx.core as mx

    tune(target, **SMALL)
    old = curve_for_requests(target)  # re-checked at first use (re-measured if it no longer holds)
    assert old.measured is True
    with monkeypatch.context() as m:
        m.setattr(mx, "__version__", "99.0.0-test")
        # The request path falls back to the conservative default until a tune for this version...
        assert curve_for_requests(target).measured is False
        new = tune(target, **SMALL)
        assert new.key["mlx"] == "99.0.0-test" and curve_path(new.key) != curve_path(old.key)
        assert curve_path(new.key).is_file()
        assert curve_for_requests(target).measured is True  # ...which replaces the default at once
    assert load_cost_curve(old.key).seconds == old.seconds  # the other version's curve is untouched


def test_a_tampered_or_foreign_file_is_ignored(cache_home, target):
    curve = tune(target, **SMALL)
    path = curve_path(curve.key)
    data = json.loads(path.read_text())
    data["key"]["mlx"] = "9.9"  # a file whose key doesn't match where it lies
    path.write_text(json.dumps(data))
    assert load_cost_curve(curve.key) is None
    path.write_text("{not json")
    assert load_cost_curve(curve.key) is None


def test_static_cap_follows_the_curve_and_acceptance():
    curve = knee_curve(16)
    assert best_draft_cap(curve, 1.0)[0] == 15
    assert best_draft_cap(curve, 0.0) == (0, 1.0)  # nothing ever accepted: don't draft
    caps = [best_draft_cap(curve, a)[0] for a in (0.3, 0.6, 0.8, 0.95)]
    assert caps == sorted(caps) and caps[0] < caps[-1]
    flat = CostCurve.default()
    k, gain = best_draft_cap(flat, 0.9)
    assert 0 < k < 63 and gain == pytest.approx(expected_tokens(k, 0.9) / flat.relative(k + 1, 0))


def test_controller_grows_to_the_optimum_under_full_acceptance():
    curve = knee_curve(16)
    c = DraftController(curve, depth=100)
    first = c()
    caps = []
    for _ in range(40):
        k = c()
        c.observe(k, k)  # every drafted token holds
        caps.append(c())
    assert caps[-1] == best_draft_cap(curve, 1.0, depth=100)[0] == 15
    assert first < 15 and max(caps) == 15  # grew to it, never past it
    assert c.acceptance > 0.95


def test_controller_turns_drafting_off_then_probes():
    c = DraftController(knee_curve(16), probe_every=8, probe_max=32, probe_cap=4)
    rounds_to_off = None
    for i in range(30):
        k = c()
        c.observe(k, 0)
        if c() == 0:
            rounds_to_off = i + 1
            break
    assert rounds_to_off is not None and rounds_to_off <= 15
    # Off: mostly width-1 rounds, with probes whose spacing backs off while they fail.
    probes = []
    for i in range(200):
        k = c()
        if k:
            probes.append(i)
        c.observe(k, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and c.off
    assert gaps == sorted(gaps) and gaps[-1] <= 33 and gaps[0] < gaps[-1]
    # A probe that is fully accepted turns drafting back on.
    while (k := c()) == 0:
        c.observe(0, 0)
    c.observe(k, k)
    assert not c.off and c() > 0


def test_controller_ignores_rounds_without_a_draft():
    c = DraftController(knee_curve(16))
    before = (c(), c.acceptance)
    for _ in range(50):
        c.observe(0, 0)  # the drafter found nothing: no evidence
    assert (c(), c.acceptance) == before


def test_hysteresis_keeps_the_cap_steady_under_noise():
    c = DraftController(CostCurve.default(), hysteresis=0.05)
    for _ in range(30):
        k = c()
        c.observe(k, k)
    changes, last = 0, c()
    for i in range(60):  # acceptance wobbling around a high rate
        k = c()
        c.observe(k, k if i % 7 else k // 2)
        if c() != last:
            changes, last = changes + 1, c()
    assert changes <= 10


def test_engine_auto_cap_is_lossless_and_adapts(tiny_engine, cache_home):
    text = "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n" * 6
    ids = tiny_engine.encode(text)
    base = tiny_engine.generate(GenerationRequest(ids, max_tokens=60, mode="baseline"))
    base = list(base)[-1]
    auto = list(tiny_engine.generate(GenerationRequest(ids, max_tokens=60, mode="lookup", max_draft="auto")))[-1]
    assert auto.token_ids == base.token_ids
    assert auto.stats.rounds <= auto.stats.generated_tokens


def test_machine_route_reports_the_roofline(tiny_engine, cache_home):
    from starlette.testclient import TestClient

    from agent_bridge.app import create_app

    with TestClient(create_app(tiny_engine)) as client:
        r = client.get("/machine")
        assert r.status_code == 200
        body = r.json()
    roof = body["roofline"]
    assert body["backend"] and roof["bandwidth_gb_s"] > 0 and roof["model_bytes"] > 0
    assert roof["plain_decode_ceiling_tok_s"] > 0
    (depth,) = roof["by_depth"].values()  # no cached curve: one quick depth
    assert depth["best_width"] >= 1 and depth["best_speedup_perfect_drafter"] >= 1.0
    assert set(depth["cost"]) == {"2", "4", "8", "16", "32", "64"}
    assert "quick" in roof["curve"]


def test_tune_command_prints_its_report(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`mlx-dspark tune` as a user runs it (the text report, not --json): the report is printed
    after the engine has closed, so nothing in it may ask the closed engine."""
    from agent_bridge.cli import main

    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["tune", "--model", str(tiny_model_dir), "--depths", "64", "--repeats", "1", "--no-prefill"]) == 0
    out = capsys.readouterr().out
    assert "verify cost curve for" in out and "dtype float32" in out and "best perfect-drafter speedup" in out
