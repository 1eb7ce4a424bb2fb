"""Where models live: the bundled reference model is the default; `model_catalog` finds the rest."""

from __future__ import annotations

from pathlib import Path

REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "reference_model"


def default_model_path() -> Path:
    return REFERENCE_MODEL_DIR


def local_models(extra_dirs: list = ()) -> list[dict]:
    """Every model on this machine as dicts (engine/model_catalog.py), the bundled one first."""
    from .model_catalog import find_models

    return [m.to_dict() for m in find_models(extra_dirs)]
