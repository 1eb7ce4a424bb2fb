"""A model folder's config.json, read the one way every part uses."""

from __future__ import annotations

import json
from pathlib import Path


def read_config(path: Path) -> dict | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None



def text_config(config: dict) -> dict:
    """VLM packs keep the language model's fields under text_config."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config
