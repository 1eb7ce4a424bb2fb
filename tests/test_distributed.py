"""A model split over ranks (issue 32): `mlx.launch --backend ring` starts 2 or 4 processes on
this machine, each holding part of a tiny random model (tests/split_child.py), and rank 0's
generations must be the ones the whole model gives on one process.

A pipeline split computes every layer whole, on one rank, so its tokens equal one process's
exactly, sampled ones too. A tensor split sums partial matmuls across ranks, in another order
than one process's matmul: equal away from near-ties (tests/greedy_ties.py). Models: random
weights (scripted by nothing), which proves the ranks keep in step, not any task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.greedy_ties import assert_same_greedy_away_from_ties
from tests.tiny_models import FAMILIES, build_tiny_model
from server_harness import free_port

CHILD = Path(__file__).with_name("split_child.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
ROOT = CHILD.parent.parent
TEXT = "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n" * 3

pytestmark = pytest.mark.skipif(not (mx.distributed.is_available() and LAUNCH.exists()),
                                reason="MLX distributed (the ring backend) or mlx.launch is absent")

# name -> (model_type, extra config, layers): 4 layers, so a pipeline over 2 ranks gives each a
# recurrent and an attention layer of the hybrid
MODELS = {
    "dense": ("qwen3", {}, 4),
    "moe": ("qwen3_moe", FAMILIES["qwen3_moe"][1], 4),
    "hybrid": ("qwen3_5", FAMILIES["qwen3_5"][1], 4),
    "window": ("gpt_oss", FAMILIES["gpt_oss"][1], 2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split-models")
    return {name: build_tiny_model(root / name, arch=arch, layers=layers, extra=extra)
            for name, (arch, extra, layers) in MODELS.items()}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("split-cache")


def child_env(cache_dir: Path) -> dict:
    return {**os.environ, "MLX_DSPARK_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"}


def run_launch(cfg: dict, cache_dir: Path, ranks: int = 2, timeout: float = 240) -> tuple[int, str]:
    """mlx.launch's exit code and output for split_child.py as `ranks` ranks. Past `timeout`
    every rank is killed with the launcher (its own session), so a hung rank outlives no test."""
    proc = subprocess.Popen([str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--", sys.executable, str(CHILD),
                             json.dumps(cfg)], cwd=ROOT, env=child_env(cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def launch(cfg: dict, tmp_path: Path, cache_dir: Path, ranks: int = 2, timeout: float = 240) -> tuple[dict, str]:
    """Run split_child.py as `ranks` ranks under mlx.launch; rank 0's results and the log."""
    cfg = {**cfg, "out": str(tmp_path / "out.json")}
    code, log = run_launch(cfg, cache_dir, ranks, timeout)
    assert code == 0, log[-3000:]
    return json.loads(Path(cfg["out"]).read_text()), log


def one_process(model: Path, runs: list[dict], cache_dir: Path, monkeypatch) -> tuple[list[list[int]], object]:
    from engine import Engine, GenerationRequest
    from engine.base.sampling import SamplingParams

    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(cache_dir))
    engine = Engine(str(model), prefix_cache=False)
    out = []
    for r in runs:
        sampling = SamplingParams(temperature=r.get("temperature", 0.0), seed=r.get("seed"))
        done = engine.submit(GenerationRequest(r["prompt"], max_tokens=r.get("max_tokens", 24), mode=r.get("mode"),
                                               max_draft=r.get("max_draft"), sampling=sampling)).result()
        out.append(done.token_ids)
    return out, engine


def prompt_for(model: Path) -> list[int]:
    from engine.model.target import load_target

    return load_target(str(model)).encode(TEXT)


@pytest.mark.parametrize("name,split,ranks", [
    ("dense", "tensor", 2),
    ("moe", "pipeline", 2),
    ("moe", "tensor", 2),
    ("hybrid", "pipeline", 2),
    ("hybrid", "tensor", 2),
    ("window", "tensor", 2),
    ("moe", "pipeline", 4),
])
def test_split_greedy_equals_one_process(models, cache_dir, tmp_path, monkeypatch, name, split, ranks):
    """Undrafted, drafted (lookup, two caps) and batched (all three at once, max_batch 3): the
    split model's tokens are one process's; lookup's drafts run through the split verify."""
    model = models[name]
    prompt = prompt_for(model)
    runs = [{"prompt": prompt, "mode": "baseline"}, {"prompt": prompt, "mode": "lookup"},
            {"prompt": prompt, "mode": "lookup", "max_draft": 2}]
    want, engine = one_process(model, runs, cache_dir, monkeypatch)
    got, _ = launch({"model": str(model), "split": split, "runs": runs, "together": True,
                     "engine": {"max_batch": 3}}, tmp_path, cache_dir, ranks)
    assert got["ranks"] == ranks and got["split"] == split
    rows = got["runs"]
    assert [r["error"] for r in rows] == [None] * len(rows)
    assert rows[1]["drafted"] > 0  # drafts were verified across the ranks
    for w, r in zip(want, rows):
        if split == "pipeline":
            assert r["tokens"] == w
        else:
            assert_same_greedy_away_from_ties(engine, prompt, w, r["tokens"])
    engine.close()


def test_split_heads_draft_over_a_tensor_split(cache_dir, tmp_path, monkeypatch):
    """The bundled model's drafter heads (DSpark, DFlash) over a tensor split: every rank holds
    the whole hidden state after each layer's all-sum, so the taps are whole; their drafts are
    verified across the ranks and the tokens are one process's. Model: the bundled 12.6M qwen3
    and its bundled heads, deciding for themselves."""
    from engine.base.bundled import default_model_path

    model = default_model_path()
    prompt = prompt_for(model)
    runs = [{"prompt": prompt, "mode": "baseline"}]
    want, engine = one_process(model, runs, cache_dir, monkeypatch)
    got, _ = launch({"model": str(model), "split": "tensor", "engine": {"prefix_cache": False},
                     "runs": [{"prompt": prompt, "mode": m} for m in ("dspark", "dflash")]}, tmp_path, cache_dir)
    for row in got["runs"]:
        assert row["error"] is None and row["drafted"] > 0
        assert_same_greedy_away_from_ties(engine, prompt, want[0], row["tokens"])
    engine.close()


def test_split_drafts_accepted_and_rejected(models, cache_dir, tmp_path, monkeypatch):
    """The dense model copies the repeated prompt (drafts accepted) and the hybrid doesn't
    (drafts rejected: its recurrent state taken back on every rank); sequential, with the
    prefix cache on, the second request of each starting from the cached prompt."""
    for name, accepts in (("dense", True), ("hybrid", False)):
        model = models[name]
        prompt = prompt_for(model)
        runs = [{"prompt": prompt, "mode": "lookup"}, {"prompt": prompt, "mode": "lookup"}]
        want, engine = one_process(model, runs, cache_dir, monkeypatch)
        engine.close()
        got, _ = launch({"model": str(model), "split": "pipeline" if name == "hybrid" else "tensor", "runs": runs},
                        tmp_path, cache_dir)
        first, second = got["runs"]
        assert first["error"] is None and second["error"] is None
        assert first["drafted"] > 0
        assert (first["accepted"] > 0) == accepts
        assert second["tokens"] == first["tokens"]  # from the prefix cache, on both ranks alike
        if name == "hybrid":
            assert first["tokens"] == want[0]


def test_split_sampling_equals_one_process(models, cache_dir, tmp_path, monkeypatch):
    """A seeded sampled generation over a pipeline: the same logits on every rank and the
    same draws, so the same tokens as one process, drafted or not (the distribution kept)."""
    model = models["moe"]
    prompt = prompt_for(model)
    runs = [{"prompt": prompt, "mode": m, "temperature": 0.8, "seed": s} for s in (1, 2) for m in ("baseline", "lookup")]
    want, engine = one_process(model, runs, cache_dir, monkeypatch)
    engine.close()
    got, _ = launch({"model": str(model), "split": "pipeline", "runs": runs}, tmp_path, cache_dir)
    assert [r["tokens"] for r in got["runs"]] == want
    assert want[0] != want[2]  # the seeds matter: this is sampling


def test_split_unseeded_sampling_keeps_the_ranks_in_step(models, cache_dir, tmp_path, monkeypatch):
    """Sampled with drafts and no seed (what agents send): every rank must accept the same
    drafts, so rank 0 draws the seed and shares it. The ranks stay in step: the greedy run
    after equals one process's."""
    model = models["dense"]
    prompt = prompt_for(model)
    greedy = {"prompt": prompt, "mode": "lookup"}
    want, engine = one_process(model, [greedy], cache_dir, monkeypatch)
    runs = [{"prompt": prompt, "mode": "lookup", "temperature": 0.9, "max_tokens": 48}] * 2 + [greedy]
    got, _ = launch({"model": str(model), "split": "tensor", "runs": runs}, tmp_path, cache_dir)
    first, second, last = got["runs"]
    assert [r["error"] for r in got["runs"]] == [None] * 3 and got["failure"] is None
    assert first["drafted"] > 0 and len(first["tokens"]) == 48
    assert_same_greedy_away_from_ties(engine, prompt, want[0], last["tokens"])
    engine.close()


def test_split_cancel_reaches_every_rank(models, cache_dir, tmp_path):
    """A run cancelled after its first tokens ends "cancelled", and the ranks stay in step: the
    next run is the same as a fresh one."""
    model = models["moe"]
    prompt = prompt_for(model)
    runs = [{"prompt": prompt, "mode": "lookup", "max_tokens": 200, "cancel_after": 1},
            {"prompt": prompt, "mode": "baseline"}, {"prompt": prompt, "mode": "baseline"}]
    got, _ = launch({"model": str(model), "split": "pipeline", "runs": runs, "engine": {"prefix_cache": False}},
                    tmp_path, cache_dir)
    cancelled, after, again = got["runs"]
    assert cancelled["finish"] == "cancelled" and len(cancelled["tokens"]) < 200
    assert after["error"] is None and after["tokens"] == again["tokens"] and len(after["tokens"]) == 24


def test_model_that_cant_split_fails_clearly(models, cache_dir, tmp_path):
    """mlx-lm's qwen3 has no pipeline: every rank stops with one clear line, no hang."""
    cfg = {"model": str(models["dense"]), "split": "pipeline", "runs": [], "out": str(tmp_path / "out.json")}
    _, log = run_launch(cfg, cache_dir, timeout=120)
    assert not (tmp_path / "out.json").exists()  # (mlx.launch itself exits 0 whatever its ranks do)
    assert "can't split a qwen3 model by pipeline (it can: tensor)" in log


@pytest.mark.parametrize("die", [True, "decoding"])
def test_lost_rank_fails_requests_and_says_why(models, cache_dir, tmp_path, die):
    """Rank 1 gone after loading or while decoding (started by hand, so no launcher kills rank 0
    with it): rank 0's request ends with an error naming the lost rank, whether the leader
    noticed in a share or inside a forward; the engine records why, no hang."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    model = models["moe"]
    cfg = {"model": str(model), "split": "pipeline", "die": die, "out": str(tmp_path / "out.json"),
           "runs": [{"prompt": prompt_for(model), "mode": "lookup", "max_tokens": 400}]}
    procs = [subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], cwd=ROOT,
                              env={**child_env(cache_dir), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 3, logs[1][-2000:]
    assert procs[0].returncode == 0, logs[0][-2000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert "lost a rank" in got["runs"][0]["error"]
    assert "lost a rank" in got["failure"]
