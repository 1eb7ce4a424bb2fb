"""Write heads in their published layouts (config.json + model.safetensors).

Used to save randomly initialised heads built from a config (tests, experiments) and
to re-save loaded ones; the PyTorch trainer (training/heads/) writes the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.drafting.heads.loading import build_head, kind_of, parse_config


def dflash_config(target_config: dict, *, layers: int = 1, block_size: int = 16, mask_token_id: int,
                  target_layer_ids: list[int], intermediate_size: int | None = None, version: int = 1,
                  conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 16,
                  selector_top_k: int = 8) -> dict:
    """A z-lab style DFlashDraftModel (version 2: DFlash2DraftModel) config.json for a head on this target."""
    c = {k: target_config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta")
         if k in target_config}
    c.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        head_dim=target_config.get("head_dim") or target_config["hidden_size"] // target_config["num_attention_heads"],
        intermediate_size=intermediate_size or target_config["intermediate_size"],
        num_hidden_layers=layers,
        num_target_layers=target_config["num_hidden_layers"],
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * layers,
        dflash_config={"block_size": block_size, "mask_token_id": mask_token_id,
                       "target_layer_ids": list(target_layer_ids)},
        block_size=block_size,
    )
    if version == 2:
        c["architectures"] = ["DFlash2DraftModel"]
        c["is_causal"] = False
        c["dflash_config"].update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                  selector_rank=selector_rank, selector_top_k=selector_top_k)
    return c


def dspark_config(target_config: dict, *, layers: int = 1, block_size: int = 7, mask_token_id: int,
                  target_layer_ids: list[int], markov_rank: int = 32, markov_head_type: str = "vanilla",
                  confidence: bool = True, intermediate_size: int | None = None) -> dict:
    """A DeepSpec style Qwen3DSparkModel config.json (fields at the top level)."""
    c = dflash_config(target_config, layers=layers, block_size=block_size, mask_token_id=mask_token_id,
                      target_layer_ids=target_layer_ids, intermediate_size=intermediate_size)
    del c["dflash_config"]
    c.update(
        architectures=["Qwen3DSparkModel"],
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        num_anchors=512,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=confidence,
    )
    if confidence:
        c["confidence_head_with_markov"] = True
    return c


def random_head_checkpoint(out: Path, config: dict, seed: int = 0, scale: float = 1.0,
                           extra: dict[str, mx.array] | None = None) -> Path:
    """Save a randomly initialised head of this config in the published layout."""
    kind = kind_of(config)
    mx.random.seed(seed)
    head = build_head(parse_config(config, kind), kind)
    weights = dict(tree_flatten(head.parameters()))
    if scale != 1.0:
        weights = {k: v * scale if k.endswith("proj.weight") else v for k, v in weights.items()}
    weights.update(extra or {})
    return save_checkpoint(out, config, weights)


def save_checkpoint(out: Path, config: dict, weights: dict[str, mx.array]) -> Path:
    if (config.get("architectures") or [None])[0] == "DFlash2DraftModel":  # z-lab names these bare
        weights = {k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out
