"""Issue 13 item 7: a hub model's cache identity follows its snapshot revision and weights
digests, so a re-upload with the same config never reuses KV of the old weights."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from tiny_models import build_tiny_model


def publish(cache, repo: str, model_dir, revision: str) -> None:
    """Lay `model_dir` out as the Hugging Face cache does: blobs by digest, snapshot links, refs."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)


def test_reuploaded_hub_model_gets_a_new_identity(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from engine.caches.prefix_cache import cache_identity
    from engine.model.target import load_target

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    old = build_tiny_model(tmp_path / "old", seed=0)
    new = build_tiny_model(tmp_path / "new", seed=1)  # same config, other weights
    assert (old / "config.json").read_text() == (new / "config.json").read_text()

    publish(cache, "someone/tiny", old, "a" * 40)
    first = load_target("someone/tiny")
    id_old = cache_identity(first, None)
    assert id_old == cache_identity(load_target("someone/tiny"), None)  # stable across loads
    publish(cache, "someone/tiny", new, "b" * 40)  # the re-upload: refs/main moves
    second = load_target("someone/tiny")
    assert first.identity == second.identity  # path, config and dtype alike...
    assert cache_identity(second, None) != id_old  # ...but the weights differ
