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


def quantization_of(config: dict) -> str | None:
    """A quantised checkpoint's scheme as its user knows it ("8-bit (group 64)", "mxfp4 4-bit"),
    from the config's quantization block; None for float weights."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    mode = q.get("mode") or q.get("quant_method")
    if mode and mode != "affine":
        return str(mode) if not q.get("bits") else f"{mode} {q['bits']}-bit"
    return f"{q.get('bits', '?')}-bit (group {q.get('group_size', '?')})"


def dtype_name(config: dict, compute_dtype: str) -> str:
    """What a loaded model runs in, as its user knows it: the compute dtype of a float model
    ("float32"), the quantisation with the dtype of its scales and activations ("8-bit (group 64),
    float32"), or a quantised checkpoint run on dequantized weights ("float32, dequantized from
    8-bit (group 64)"). Never the packed weights' uint32."""
    if (scheme := quantization_of(config)) is not None:
        return f"{scheme}, {compute_dtype}"
    if (was := quantization_of({"quantization": config.get("dequantized_from")})) is not None:
        return f"{compute_dtype}, dequantized from {was}"
    return compute_dtype
