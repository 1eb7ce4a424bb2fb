"""Registry rows for hybrid, MoE and Gemma 4 targets, and the check of a downloaded head
against the values its row pins (a warning on a mismatch; the pairing check still decides)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from engine.drafting.heads import registry
from engine.drafting.heads.export import dflash_config, random_head_checkpoint
from engine.drafting.heads.loading import load_head


def test_rows_resolve_from_quantised_repo_names():
    def entry(name):
        return registry.entry_for(SimpleNamespace(path=name, drafter=None))

    assert entry("mlx-community/Qwen3.6-35B-A3B-4bit").heads == {"dflash": "z-lab/Qwen3.6-35B-A3B-DFlash"}
    assert entry("Qwen/Qwen3.6-27B").heads == {"dflash": "z-lab/Qwen3.6-27B-DFlash"}
    assert entry("mlx-community/Qwen3.8-27B-8bit").published["dflash"]["block_size"] == 8
    assert entry("google/gemma-4-26b-a4b-it").heads == {"dspark": "makora-ai/gemma4-26b-a4b-dspark"}


def test_a_head_that_differs_from_its_published_config_is_warned_about(tiny_model_dir, tmp_path, monkeypatch, caplog):
    tc = json.loads((tiny_model_dir / "config.json").read_text())
    path = random_head_checkpoint(tmp_path / "head", dflash_config(
        tc, mask_token_id=0, target_layer_ids=[0, 1], block_size=8), seed=1)
    spec = str(path)
    monkeypatch.setitem(registry.PUBLISHED, "some-target", registry.Entry(
        {"dflash": spec}, published={"dflash": {"block_size": 8, "target_layer_ids": [0, 1], "mask_token_id": 0}}))
    with caplog.at_level(logging.WARNING, logger="engine"):
        load_head(spec)
    assert "differs from the registry" not in caplog.text
    monkeypatch.setitem(registry.PUBLISHED, "some-target", registry.Entry(
        {"dflash": spec}, published={"dflash": {"block_size": 16, "target_layer_ids": [1, 10]}}))
    with caplog.at_level(logging.WARNING, logger="engine"):
        load_head(spec)
    assert "block_size is 8, the published checkpoint has 16" in caplog.text
    assert "target_layer_ids is [0, 1], the published checkpoint has [1, 10]" in caplog.text
