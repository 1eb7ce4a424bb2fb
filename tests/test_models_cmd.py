"""`mlx-dspark models` lists the bundled model and what the local hub cache holds, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


def make_hub_cache(root, repo_id: str, model_dir) -> None:
    """The Hugging Face cache layout: blobs, a snapshot of symlinks, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    for f in model_dir.iterdir():
        blob = repo / "blobs" / f.name.replace(".", "_")
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)


def test_models_lists_bundled_and_cached(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "mlx-community/Qwen3-4B-4bit", tiny_model_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "models", "--json"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    models = json.loads(r.stdout)
    assert models[0]["name"] == "reference" and set(models[0]["drafters"]) == {"dflash", "dspark"}
    cached = {m["name"]: m for m in models[1:]}
    assert cached["mlx-community/Qwen3-4B-4bit"]["model_type"] == "qwen3"
    assert sorted(cached["mlx-community/Qwen3-4B-4bit"]["drafters"]) == ["dflash", "dspark"]  # from the registry
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "models"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "mlx-community/Qwen3-4B-4bit" in r.stdout
