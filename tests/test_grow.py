"""training/grow.py: a model grown by identity layers computes exactly what it did."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from grow import grow, layer_plan  # noqa: E402


def test_layer_plan_spreads_the_new_layers_and_never_shrinks():
    assert layer_plan(6, 8) == [(0, False), (1, False), (2, False), (2, True), (3, False), (4, False),
                                (5, False), (5, True)]
    assert layer_plan(2, 3) == [(0, False), (1, False), (1, True)]
    assert layer_plan(4, 4) == [(i, False) for i in range(4)]
    assert layer_plan(2, 6) == [(0, False), (0, True), (0, True), (1, False), (1, True), (1, True)]  # past doubling
    with pytest.raises(ValueError):
        layer_plan(6, 5)


def test_the_grown_model_gives_the_same_logits(tmp_path):
    small = build_tiny_model(tmp_path / "small", layers=2, seed=3)
    config = grow(small, tmp_path / "grown", layers=4)
    assert config["num_hidden_layers"] == 4
    old_model, _ = load(str(small))
    new_model, tokenizer = load(str(tmp_path / "grown"))
    assert len(new_model.layers) == 4
    tokens = mx.array([tokenizer.encode("def rename_symbol(path, old, new):\n    return path")])
    old_logits, new_logits = old_model(tokens), new_model(tokens)
    assert mx.array_equal(old_logits, new_logits).item()
    # the new layers are real copies, not empty: only their output projections start at zero
    new = dict(new_model.layers[3].parameters()["self_attn"])
    assert mx.array_equal(new["q_proj"]["weight"], old_model.layers[1].self_attn.q_proj.weight).item()
    assert not mx.any(new_model.layers[3].mlp.down_proj.weight).item()
