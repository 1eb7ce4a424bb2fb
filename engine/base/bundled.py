"""Where models live: the bundled reference models (the qwen3 one is the default; the hybrid
`dspark-ref-hybrid`, a qwen3_5 with Gated DeltaNet layers, where its weights are present: a checkout
keeps them);
`engine/catalog/model_catalog.py` finds the rest."""

from __future__ import annotations

from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parents[1]
REFERENCE_MODEL_DIR = ENGINE_DIR / "reference_model"
HYBRID_REFERENCE_MODEL_DIR = ENGINE_DIR / "reference_model_hybrid"
HYBRID_REFERENCE_NAME = "dspark-ref-hybrid"
# name -> folder; `--model NAME` and the model list use these names
BUNDLED_MODELS = {"reference": REFERENCE_MODEL_DIR, HYBRID_REFERENCE_NAME: HYBRID_REFERENCE_MODEL_DIR}


def default_model_path() -> Path:
    return REFERENCE_MODEL_DIR


def has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def bundled_models() -> list[tuple[str, Path]]:
    """(name, folder) of the bundled models whose weights are here (the default one always)."""
    return [(name, path) for name, path in BUNDLED_MODELS.items()
            if path == REFERENCE_MODEL_DIR or has_weights(path)]


def resolve_model(model: str | Path | None) -> str:
    """A bundled model's name -> its folder; anything else (a folder, a hub id) unchanged."""
    if model is None:
        return str(default_model_path())
    return str(BUNDLED_MODELS.get(str(model), model))
