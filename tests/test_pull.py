"""`mlx-dspark pull` against a local server speaking the hub's file API (tests/fake_hub.py,
through HF_ENDPOINT) for one tiny model and a drafter head: the real huggingface_hub
client downloads (weight files through our resumable fetch), an interrupted download is resumed
with a Range request (within one run, and after the process was killed), the result is checked,
and offline fails at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from engine.drafting.heads.export import dflash_config, random_head_checkpoint
from fake_hub import FakeHub

REPO = "mlx-community/Qwen3-4B-4bit"  # a registered target: its DFlash head is z-lab/Qwen3-4B-DFlash-b16
HEAD = "z-lab/Qwen3-4B-DFlash-b16"
SHARD = "model-00001-of-00002.safetensors"
WEIGHTS = f"{REPO}/{SHARD}"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """The bundled model's files (its first weight file is over huggingface_hub's 10 MB read
    chunk, so a cut download leaves a part to resume from) and a random head for it."""
    from engine import REFERENCE_MODEL_DIR

    root = tmp_path_factory.mktemp("hub-repos")
    model = root / "model"
    model.mkdir()
    for f in REFERENCE_MODEL_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, model / f.name)
    cfg = json.loads((model / "config.json").read_text())
    head = random_head_checkpoint(root / "head", dflash_config(cfg, mask_token_id=0, target_layer_ids=[1, 4]))
    return {REPO: model, HEAD: head}


def _env(hub_url: str, cache) -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    return env


def _pull(args, env, timeout=180):
    return subprocess.run([sys.executable, "-m", "agent_bridge", "pull", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _weights_gets(hub):
    return [(m, r) for m, p, r in hub.log if m == "GET" and p.endswith(f"/{REPO}/resolve/{hub.commits[REPO]}/{SHARD}")]


def _resumed_at(gets) -> int:
    assert gets[0][1] is None and gets[-1][1] and gets[-1][1].startswith("bytes="), gets
    return int(gets[-1][1][len("bytes="):].rstrip("-"))


def test_pull_with_drafter_resumes_a_dropped_connection(tmp_path, repos):
    size = (repos[REPO] / SHARD).stat().st_size
    cut = size - 2**20
    with FakeHub(repos, cut_after={WEIGHTS: cut}) as hub:
        r = _pull([REPO, "--drafter"], _env(hub.url, tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    start = _resumed_at(_weights_gets(hub))  # resumed from what the client had written
    assert 0 < start <= cut and hub.sent[WEIGHTS] == size + (cut - start)
    snap = tmp_path / "cache" / "models--mlx-community--Qwen3-4B-4bit" / "snapshots" / hub.commits[REPO]
    assert (snap / SHARD).read_bytes() == (repos[REPO] / SHARD).read_bytes()
    assert f"ok: {REPO} -> {snap}" in r.stdout and f"ok: drafter {HEAD}" in r.stdout
    # the registry's other head is not on this hub: said, and the pull still stands
    assert "note: drafter deepseek-ai/dspark_qwen3_4b_block7 not fetched: no model" in r.stdout
    # pulled models are what `models` lists, with the head found in the cache
    env = _env(hub.url, tmp_path / "cache") | {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    listed = subprocess.run([sys.executable, "-m", "agent_bridge", "models", "--json"], capture_output=True, text=True,
                            env=env, timeout=180)
    names = {m["name"]: m for m in json.loads(listed.stdout)}
    assert names[REPO]["loads"] and names[REPO]["drafters_to_download"] == ["dspark"]  # the DFlash head was pulled
    assert HEAD not in names  # a head is listed with its model, not as one


def test_pull_after_the_process_was_killed_resumes_the_cut_file(tmp_path, repos):
    """huggingface_hub 2.x resumes within a run only (each download has a temporary name of its
    own): weight files go through engine/model_pull.fetch_resumable, whose `.part` outlives a
    killed process. The next run keeps the finished file and continues the cut one with a Range."""
    first = (repos[REPO] / SHARD).stat().st_size
    second_name = "model-00002-of-00002.safetensors"
    second = f"{REPO}/{second_name}"
    size = (repos[REPO] / second_name).stat().st_size
    env = _env("", tmp_path / "cache")
    blobs = tmp_path / "cache" / "models--mlx-community--Qwen3-4B-4bit" / "blobs"
    with FakeHub(repos, cut_after={second: 2**20}, cut="stall") as hub:
        env["HF_ENDPOINT"] = hub.url
        proc = subprocess.Popen([sys.executable, "-m", "agent_bridge", "pull", REPO], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while (hub.sent.get(second, 0) < 2**20 or hub.sent.get(WEIGHTS, 0) < first) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the client writes what it received
        proc.kill()
        proc.wait(30)
        hub.release.set()
        parts = list(blobs.glob("*.part"))
        assert len(parts) == 1 and parts[0].stat().st_size == 2**20  # the cut file's bytes survived the kill
        r = _pull([REPO], env)
    assert r.returncode == 0, r.stderr
    assert len(_weights_gets(hub)) == 1 and hub.sent[WEIGHTS] == first  # the finished shard is not fetched again
    gets = [rng for m, p, rng in hub.log if m == "GET" and p.endswith(f"/resolve/{hub.commits[REPO]}/{second_name}")]
    assert gets == [None, f"bytes={2**20}-"]  # the cut one continued where the killed process stopped
    assert hub.sent[second] == size  # every byte sent once
    snap = tmp_path / "cache" / "models--mlx-community--Qwen3-4B-4bit" / "snapshots" / hub.commits[REPO]
    assert (snap / second_name).read_bytes() == (repos[REPO] / second_name).read_bytes()
    assert not list(blobs.glob("*.part"))


def test_a_corrupt_part_is_caught_by_its_sha256(tmp_path, repos):
    """A `.part` left with the right size but wrong bytes (a disk error, another tool) fails the
    SHA-256 check against the hub's ETag: refused, removed, and the next run fetches it whole."""
    import hashlib

    data = (repos[REPO] / SHARD).read_bytes()
    blobs = tmp_path / "cache" / "models--mlx-community--Qwen3-4B-4bit" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / (hashlib.sha256(data).hexdigest() + ".part")).write_bytes(b"x" * len(data))
    with FakeHub({REPO: repos[REPO]}) as hub:
        env = _env(hub.url, tmp_path / "cache")
        r = _pull([REPO], env)
        assert r.returncode == 2 and "don't match the hub's SHA-256" in r.stderr, r.stderr
        assert not list(blobs.glob("*.part"))
        r = _pull([REPO], env)
    assert r.returncode == 0, r.stderr


def test_pull_json_reports_progress(tmp_path, repos):
    """`--json`: progress events a web app can show, then the result, one JSON object a line."""
    with FakeHub({REPO: repos[REPO]}) as hub:
        r = _pull([REPO, "--json"], _env(hub.url, tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    files = [e for e in events if e.get("kind") == "files"]
    received = [e for e in events if e.get("kind") == "bytes"]  # huggingface_hub's count: the other files
    weights = [e for e in events if e.get("kind") == "weights"]  # the weight files, fetched resumably first
    total = sum(p.stat().st_size for p in repos[REPO].iterdir() if p.suffix == ".json")
    total_weights = sum(p.stat().st_size for p in repos[REPO].iterdir() if p.suffix == ".safetensors")
    assert [e["done"] for e in files] == list(range(1, len(files) + 1)) and files[-1]["total"] == len(files)
    assert received[-1]["done"] == received[-1]["total"] == total
    assert weights[-1]["done"] == weights[-1]["total"] == total_weights and len(weights) > 4
    for events_of_a_kind in (received, weights):
        assert all(a["done"] <= b["done"] for a, b in zip(events_of_a_kind, events_of_a_kind[1:]))
    assert events[-1]["ok"] and events[-1]["path"].endswith(hub.commits[REPO])


def test_pull_refuses_an_incomplete_or_foreign_repo(tmp_path, repos, tiny_llama_dir):
    broken = shutil.copytree(repos[REPO], tmp_path / "broken")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    llama_cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    foreign = random_head_checkpoint(tmp_path / "foreign",
                                     dflash_config(dict(llama_cfg, hidden_size=96), mask_token_id=0, target_layer_ids=[0]))
    with FakeHub({"me/broken": broken, REPO: repos[REPO], "me/foreign-head": foreign}) as hub:
        env = _env(hub.url, tmp_path / "cache")
        r = _pull(["me/broken"], env)
        assert r.returncode == 2 and "weights incomplete (model.safetensors)" in r.stderr, r.stderr
        r = _pull([REPO, "--drafter", "me/foreign-head"], env)
        assert r.returncode == 2 and "does not fit this model: hidden size" in r.stderr, r.stderr
        r = _pull(["me/nothing-here"], env)
        assert r.returncode == 2 and "no model 'me/nothing-here'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_offline_fails_at_once(tmp_path):
    env = _env("http://127.0.0.1:9", tmp_path / "cache")  # nothing listens on port 9
    t0 = time.monotonic()
    r = _pull([REPO], env)
    assert r.returncode == 2 and "unreachable" in r.stderr and "offline?" in r.stderr, r.stderr
    r = _pull([REPO], env | {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "offline mode is on (HF_HUB_OFFLINE=1)" in r.stderr
    assert time.monotonic() - t0 < 60  # two processes starting, no retries or waits
