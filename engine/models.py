"""Where models live: the bundled reference model is the default."""

from __future__ import annotations

from pathlib import Path

REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "reference_model"


def default_model_path() -> Path:
    return REFERENCE_MODEL_DIR
