"""A qwen3 of another size with random weights and the bundled model's tokenizer (no download).

    .venv/bin/python scripts/make_random_model.py OUT_DIR [--hidden 768 --layers 8 --heads 12
        --kv-heads 4 --head-dim 64 --intermediate 2048] [--seed 0]

The defaults give 56.6M parameters, about 4.5x the bundled 12.6M model, with the same
64-wide heads and 3:1 grouping. Its outputs mean nothing, but they are the same for every
server in greedy decoding, so timings against `mlx_lm.server` stay a fair comparison:
`scripts/replay_agent.py --model OUT_DIR`. Weights are saved in bfloat16, as the bundled
model's are (servers convert to their compute dtype).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_config(base: dict, args) -> dict:
    return {**base, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "max_window_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
            "intermediate_size": args.intermediate}


def make_model(out: Path, args) -> int:
    """Write the model to `out`; returns its parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen3

    from engine.base.bundled import default_model_path

    base_dir = Path(default_model_path())
    config = make_config(json.loads((base_dir / "config.json").read_text()), args)
    mx.random.seed(args.seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(base_dir / name, out / name)
    return sum(w.size for w in weights.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write (created)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = make_model(Path(args.out), args)
    print(f"{args.out}: qwen3, {n / 1e6:.1f}M parameters (the bundled model has 12.6M)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
