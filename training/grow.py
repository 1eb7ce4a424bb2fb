"""Grow an exported qwen3 model by whole layers that start as the identity.

    python training/grow.py --init engine/reference_model --out /tmp/grown --layers 8

Each new layer is a copy of the layer before it with its two output projections (attention's
`o_proj`, the MLP's `down_proj`) zeroed, so it adds nothing to the residual stream: the grown
model computes exactly what the old one did, and training starts from the old model's loss
instead of from a random layer's noise. New layers are spread evenly through the stack (8 from
6: after old layers 2 and 5). Everything else (embeddings, norms, tokenizer, drafters'
directory excluded: heads must be trained again for the new model) is copied as it is.

Runs with MLX (here, on the CPU), so the grown model travels to the training machine as `--init`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def layer_plan(old: int, new: int) -> list[tuple[int, bool]]:
    """For each layer of the grown model: (the old layer it comes from, whether it is a new copy).
    The new layers follow old layers at even spacing, the last one after the last old layer."""
    if new < old:
        raise ValueError(f"can't grow {old} layers to {new}")
    extra = new - old
    # 6 -> 8: one copy after old layers 5 and 2; past doubling, some layers get several copies
    copies = Counter(old - 1 - (i * old) // extra for i in range(extra))
    plan = []
    for i in range(old):
        plan += [(i, False)] + [(i, True)] * copies[i]
    return plan


def grow(init: Path, out: Path, layers: int) -> dict:
    """Write the grown model to `out`; returns its config."""
    config = json.loads((init / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        raise ValueError(f"grow handles qwen3 models, not {config.get('model_type')!r}")
    old = int(config["num_hidden_layers"])
    plan = layer_plan(old, layers)
    weights: dict[str, mx.array] = {}
    for f in sorted(init.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    prefix = "model.layers."
    grown = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    for new_index, (src, is_new) in enumerate(plan):
        for k, v in weights.items():
            if k.startswith(f"{prefix}{src}."):
                name = k[len(f"{prefix}{src}."):]
                grown[f"{prefix}{new_index}.{name}"] = mx.zeros_like(v) if is_new and name in ZEROED else v
    config["num_hidden_layers"] = layers
    if "max_window_layers" in config:
        config["max_window_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][src] for src, _ in plan]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), grown, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (init / name).exists():
            shutil.copy2(init / name, out / name)
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, type=Path, help="exported model directory to grow")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", required=True, type=int, help="layers of the grown model")
    args = ap.parse_args()
    config = grow(args.init, args.out, args.layers)
    n = sum(v.size for v in mx.load(str(args.out / "model.safetensors")).values())
    print(f"{args.out}: {config['num_hidden_layers']} layers, {n / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
