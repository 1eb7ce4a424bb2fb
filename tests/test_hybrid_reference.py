"""The bundled hybrid reference model, `dspark-ref-hybrid` (engine/reference_model_hybrid/).

Its name resolves to its folder wherever `--model` is taken (Engine), and the model list shows
it once its weights are there. The naming and listing are tested on a tiny random `qwen3_5`
put in its place; the tests on the real weights (committed: lossless copy of a rename with lookup
drafting, the `refactor` benchmark content, the package size) skip only in a checkout without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import Engine, GenerationRequest
from engine.base import bundled as models
from engine.catalog.model_catalog import find_models, model_locations
from test_lossless import lookup_ids, mlx_lm_greedy
from tiny_models import build_family_model

REAL = models.HYBRID_REFERENCE_MODEL_DIR
real_weights = pytest.mark.skipif(not models.has_weights(REAL), reason="dspark-ref-hybrid weights not in this checkout")


def test_bundled_names_resolve_to_their_folders():
    assert models.resolve_model("dspark-ref-hybrid") == str(REAL)
    assert models.resolve_model("reference") == str(models.REFERENCE_MODEL_DIR)
    assert models.resolve_model(None) == str(models.REFERENCE_MODEL_DIR)
    assert models.resolve_model("/some/folder") == "/some/folder"
    assert models.resolve_model("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"


def test_listed_only_with_weights(tmp_path, monkeypatch):
    empty = tmp_path / "reference_model_hybrid"
    empty.mkdir()
    monkeypatch.setitem(models.BUNDLED_MODELS, models.HYBRID_REFERENCE_NAME, empty)
    names = [name for name, _, _ in model_locations(include_bundled=True)]
    assert names[0] == "reference" and models.HYBRID_REFERENCE_NAME not in names


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A tiny random qwen3_5 (Gated DeltaNet + attention), as the hybrid's folder would hold."""
    return build_family_model(tmp_path_factory.mktemp("reference_model_hybrid"), "qwen3_5", seed=3)


def test_listed_and_named_with_weights(stand_in, monkeypatch):
    monkeypatch.setitem(models.BUNDLED_MODELS, models.HYBRID_REFERENCE_NAME, stand_in)
    found = {m.name: m for m in find_models(include_bundled=True)}
    info = found[models.HYBRID_REFERENCE_NAME]
    assert info.source == "bundled" and info.model_type == "qwen3_5" and info.loads
    assert info.cache_rollback == "checkpoints" and info.drafters == {}
    assert set(found["reference"].drafters) == {"dflash", "dspark"}
    with Engine(models.HYBRID_REFERENCE_NAME) as engine:  # the name, as `--model` passes it
        assert engine.model_path == str(stand_in)
        prompt = [5, 9, 13, 7, 5, 9, 13, 7, 5, 9]
        ref = mlx_lm_greedy(engine, prompt, 16)
        ids, _ = lookup_ids(engine, prompt, 8, [prompt + ref], max_tokens=16)
        assert ids == ref


# -- on the real weights (committed; skip in a checkout without them) ----------------------

@real_weights
def test_real_package_fits_and_is_listed():
    files = [p for p in REAL.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 16_000_000
    config = json.loads((REAL / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["quantization"]["bits"] == 8
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "models", "--json"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    listed = {m["name"]: m for m in json.loads(r.stdout)}
    assert listed[models.HYBRID_REFERENCE_NAME]["model_type"] == "qwen3_5"


@real_weights
def test_real_model_copies_a_rename_losslessly():
    """The `refactor` content (a stdlib module, one identifier renamed): lookup drafting gives
    mlx-lm's greedy output token for token, and drafts are accepted (it copies)."""
    from engine.bench.benchmark import build_content

    with Engine(models.HYBRID_REFERENCE_NAME) as engine:
        content = build_content(engine, "refactor")
        prompt, budget = content.prompts[0], 96
        ref = mlx_lm_greedy(engine, prompt, budget)
        done = list(engine.generate(GenerationRequest(prompt, max_tokens=budget, mode="lookup")))[-1]
        assert done.token_ids == ref
        assert done.stats.generated_tokens / done.stats.rounds > 2, "the model does not copy"
