"""Export a trained model (``Qwen3ForCausalLM`` or ``Qwen35ForCausalLM``) in the Hugging Face
layout: bf16 safetensors shards (< 14 MB each) + index + config.json + generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def export_model(model, out_dir, max_shard_bytes: int = 14_000_000, dtype=torch.bfloat16) -> list[str]:
    """``model`` has ``cfg.hf_config()``; ``dtype`` float32 for exact checks. Gated DeltaNet's
    decay parameters (A_log, dt_bias) stay float32 as in the published Qwen3.5 checkpoints."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep32 = ("A_log", "dt_bias")
    sd = {k: v.detach().to("cpu", torch.float32 if k.endswith(keep32) else dtype).contiguous()
          for k, v in model.state_dict().items()}
    assert "lm_head.weight" not in sd
    shards: list[dict] = [{}]
    size = 0
    for k in sorted(sd, key=_order):
        n = sd[k].numel() * sd[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += n
    total = len(shards)
    weight_map, files = {}, []
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        for k in shard:
            weight_map[k] = name
    total_size = sum(v.numel() * v.element_size() for v in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (out / "config.json").write_text(json.dumps(model.cfg.hf_config(), indent=2) + "\n")
    gen = {"eos_token_id": model.cfg.eos_token_id, "pad_token_id": model.cfg.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return files


def _order(k: str):
    parts = k.split(".")
    return (0 if "embed" in k else 2 if k == "model.norm.weight" else 1,
            int(parts[2]) if parts[1] == "layers" else 0, k)
