"""Where models live: the bundled reference model is the default; others come from the hub cache."""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "reference_model"


def default_model_path() -> Path:
    return REFERENCE_MODEL_DIR


def _describe(path: Path, name: str) -> dict:
    config = json.loads((path / "config.json").read_text())
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {
        "name": name,
        "path": str(path),
        "model_type": config.get("model_type", "?"),
        "quantization": (config.get("quantization") or {}).get("bits"),
        "weights_mb": round(size / 2**20, 1),
    }


def local_models() -> list[dict]:
    """The bundled model, then every model with a config.json in the Hugging Face cache (no network)."""
    from .heads.registry import PUBLISHED, REFERENCE_DRAFTERS, Entry, base_name

    bundled = _describe(REFERENCE_MODEL_DIR, "reference (bundled, default)")
    bundled["drafters"] = sorted(p.name for p in REFERENCE_DRAFTERS.glob("*") if (p / "config.json").exists())
    found = [bundled]
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception:  # no cache yet, or an unreadable one: nothing to list
        repos = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)[:1]:
            if (revision.snapshot_path / "config.json").exists():
                info = _describe(revision.snapshot_path, repo.repo_id)
                info["drafters"] = sorted(PUBLISHED.get(base_name(repo.repo_id), Entry()).heads)
                found.append(info)
    return found
