"""Verify cost of real-size targets on a GPU (random weights), and the perfect-drafter ceiling.

For each configuration below, built from mlx-lm's own model classes with random weights and
quantised like the published MLX conversions, this times one verify forward of `width` tokens
on a cache `context` tokens deep, for widths 1-64 and contexts 2k-32k. Random weights make the
costs real even though no draft would be accepted: a forward costs the same whatever the
numbers are.

The caches are filled with random keys and values (and random recurrent states) instead of a
prefill: a forward's cost depends on how deep the attention caches are, not on what they hold,
and a 32k prefill through mlx-lm's per-step Gated DeltaNet ops (no CUDA kernel yet) would take
longer than the whole table.

    ceiling(width) = width * t(1) / t(width)

is the speedup a drafter whose every token is accepted would reach at that width (each round
commits `width` tokens for the price of one forward of that width). For the hybrid, a rejected
draft is taken back by restoring the state from before the round and replaying the kept tokens
(engine/caches/rollback.py); `replay` is that cost for half the width kept.

    python scripts/gpu_cost_table.py --out results/            # on the GPU machine
    python scripts/gpu_cost_table.py --tiny --out /tmp/t       # a check of the script on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss, qwen3, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import rollback  # noqa: E402

# Shapes of the published models (config.json values). qwen3-8b: Qwen/Qwen3-8B. The hybrid MoE
# is Qwen3.6-35B-A3B's shape (hidden size, vocabulary and 40 layers as in its DFlash head's
# published config; Gated DeltaNet with one full-attention layer in four, 256 experts, 8 routed
# + 1 shared, as in the Qwen3-Next/3.5 MoE family), built with mlx-lm's qwen3_next class.
# gpt-oss-20b: openai/gpt-oss-20b (24 layers, 32 experts, 4 active, window 128 every other layer).
CONFIGS = {
    "qwen3-8b": (qwen3, dict(
        model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        tie_word_embeddings=False)),
    "qwen3.6-35b-a3b-shape": (qwen3_next, dict(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=40, intermediate_size=5120,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
        num_experts_per_tok=8, decoder_sparse_step=1, shared_expert_intermediate_size=512,
        mlp_only_layers=[], moe_intermediate_size=512, rms_norm_eps=1e-6, vocab_size=248320,
        rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144,
        norm_topk_prob=True, full_attention_interval=4)),
    "gpt-oss-20b": (gpt_oss, dict(
        model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
        num_attention_heads=64, num_key_value_heads=8, sliding_window=128, rope_theta=150000,
        layer_types=["sliding_attention", "full_attention"] * 12)),
}

TINY = {
    "qwen3-tiny": (qwen3, dict(CONFIGS["qwen3-8b"][1], hidden_size=64, num_hidden_layers=2,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=512)),
    "qwen3-next-tiny": (qwen3_next, dict(
        CONFIGS["qwen3.6-35b-a3b-shape"][1], hidden_size=64, num_hidden_layers=4,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, moe_intermediate_size=32, vocab_size=512)),
    "gpt-oss-tiny": (gpt_oss, dict(
        CONFIGS["gpt-oss-20b"][1], num_hidden_layers=2, num_local_experts=4, vocab_size=512,
        hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
}


def build(module, args: dict, bits: int, dtype) -> tuple[nn.Module, int]:
    """The model with random weights, quantised; and its parameter count."""
    model = module.Model(module.ModelArgs.from_dict(args))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    params = n_params(model)

    def quantisable(path, m):
        return hasattr(m, "to_quantized") and getattr(m, "weight", None) is not None \
            and m.weight.shape[-1] % 64 == 0 and "router" not in path and not path.endswith("gate")

    if bits:
        nn.quantize(model, group_size=64, bits=bits, class_predicate=quantisable)
    mx.eval(model.parameters())
    return model, params


def n_params(model) -> int:
    from mlx.utils import tree_flatten
    total = 0
    for _, v in tree_flatten(model.parameters()):
        total += v.size
    return total


def fill(model, context: int, dtype) -> list:
    """A cache `context` tokens deep: random keys/values, random recurrent states."""
    cache = make_prompt_cache(model)
    # Attention caches: one update with random keys/values of the layer's own shape, learnt from
    # a one-token forward (shapes differ per family: heads, head dim, window).
    probe = make_prompt_cache(model)
    model(mx.array([[1]]), cache=probe)
    for c, p in zip(rollback.leaves(cache), rollback.leaves(probe)):
        if hasattr(p, "keys") and p.keys is not None:
            _, kv_heads, _, dk = p.keys.shape
            dv = p.values.shape[-1]
            k = mx.random.normal((1, kv_heads, context, dk)).astype(dtype)
            v = mx.random.normal((1, kv_heads, context, dv)).astype(dtype)
            c.update_and_fetch(k, v)
        elif hasattr(p, "cache"):  # ArraysCache: conv and recurrent states
            c.cache = [None if s is None else mx.random.normal(s.shape).astype(s.dtype) * 0.1
                       for s in p.cache]
    mx.eval([x for c in rollback.leaves(cache) for x in _arrays(c)])
    return cache


def _arrays(c):
    if hasattr(c, "keys") and c.keys is not None:
        return [c.keys, c.values]
    if hasattr(c, "cache"):
        return [s for s in c.cache if s is not None]
    return []


def time_forward(model, cache, width: int, reps: int, vocab: int) -> float:
    """Median seconds of one width-token forward, the cache returned to its state each time."""
    times = []
    for i in range(reps + 2):
        tokens = mx.random.randint(0, vocab, (1, width))
        mx.eval(tokens)
        before = rollback.mark(cache)
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(logits)
        mx.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        rollback.take_back(cache, before, fed=width, kept=0, replay=None)
    times.sort()
    return times[len(times) // 2]


def time_replay(model, cache, width: int, reps: int, vocab: int) -> float:
    """Median seconds to take back a width-token round that kept half its tokens (hybrid)."""
    kept = max(1, width // 2)
    times = []
    for i in range(reps + 1):
        tokens = mx.random.randint(0, vocab, (1, width))
        before = rollback.mark(cache)
        mx.eval(model(tokens, cache=cache))
        mx.synchronize()
        t0 = time.perf_counter()
        rollback.take_back(cache, before, fed=width, kept=kept,
                           replay=lambda: model(tokens[:, :kept], cache=cache))
        mx.eval([x for c in rollback.leaves(cache) for x in _arrays(c)])
        mx.synchronize()
        if i >= 1:
            times.append(time.perf_counter() - t0)
        rollback.take_back(cache, before, fed=kept, kept=0, replay=None)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for cost_table.json and cost_table.md")
    ap.add_argument("--tiny", action="store_true", help="tiny configurations (a CPU check)")
    ap.add_argument("--models", default="", help="comma-separated subset of the configurations")
    ap.add_argument("--widths", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--bits", type=int, default=4, help="weight bits (0: unquantised)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    widths = [int(w) for w in args.widths.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    configs = TINY if args.tiny else CONFIGS
    names = [n for n in configs if not args.models or n in args.models.split(",")]
    results = {"device": str(mx.default_device()), "mlx": mx.__version__, "bits": args.bits,
               "dtype": str(dtype), "models": {}}
    try:
        results["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # older MLX, or a backend without device information
        pass
    for name in names:
        module, cfg = configs[name]
        t0 = time.perf_counter()
        model, params = build(module, cfg, args.bits, dtype)
        built = time.perf_counter() - t0
        row = {"params": params, "build_s": round(built, 1),
               "hybrid": rollback.needs_replay(make_prompt_cache(model)), "contexts": {}}
        print(f"{name}: {params / 1e9:.3f}B parameters, built in {built:.0f} s", flush=True)
        vocab = cfg["vocab_size"]
        for context in contexts:
            cache = fill(model, context, dtype)
            per_width = {}
            for w in widths:
                t = time_forward(model, cache, w, args.reps, vocab)
                per_width[w] = {"ms": round(t * 1e3, 3)}
                if row["hybrid"] and w > 1:
                    per_width[w]["replay_ms"] = round(time_replay(model, cache, w, 2, vocab) * 1e3, 3)
            t1 = per_width[widths[0]]["ms"] / widths[0] if widths[0] == 1 else None
            for w, cell in per_width.items():
                if t1:
                    cell["ceiling"] = round(w * t1 / cell["ms"], 2)
            row["contexts"][context] = per_width
            print(f"  context {context}: " + ", ".join(
                f"w{w} {c['ms']:.2f} ms" + (f" (x{c['ceiling']})" if "ceiling" in c else "")
                for w, c in per_width.items()), flush=True)
            del cache
        results["models"][name] = row
        (out / "cost_table.json").write_text(json.dumps(results, indent=1))
        del model
        mx.clear_cache()
    (out / "cost_table.md").write_text(markdown(results, widths, contexts))
    print(markdown(results, widths, contexts))


def markdown(results: dict, widths: list, contexts: list) -> str:
    lines = [f"Verify forward on {results['device']} (MLX {results['mlx']}, "
             f"{results['bits']}-bit weights, {results['dtype']} activations): "
             "ms per forward, and in brackets the perfect-drafter ceiling width x t(1)/t(width).", "",
             "| model | context | " + " | ".join(f"w={w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for name, row in results["models"].items():
        for context in contexts:
            cells = row["contexts"].get(context) or row["contexts"].get(str(context))
            if not cells:
                continue
            vals = []
            for w in widths:
                c = cells.get(w) or cells.get(str(w))
                vals.append(f"{c['ms']:.1f} ({c.get('ceiling', '-')}x)")
            lines.append(f"| {name} | {context / 1024:g}k | " + " | ".join(vals) + " |")
    hybrid = [(n, r) for n, r in results["models"].items() if r["hybrid"]]
    for name, row in hybrid:
        lines += ["", f"{name}: taking back a round that kept half its tokens (state restored, kept "
                  "tokens replayed), ms:", "",
                  "| context | " + " | ".join(f"w={w}" for w in widths if w > 1) + " |",
                  "|---|" + "---|" * len([w for w in widths if w > 1])]
        for context in contexts:
            cells = row["contexts"].get(context) or row["contexts"].get(str(context)) or {}
            vals = [f"{(cells.get(w) or cells.get(str(w)) or {}).get('replay_ms', '-')}"
                    for w in widths if w > 1]
            lines.append(f"| {context / 1024:g}k | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
