"""Widen the bundled qwen3 model to a real model's shape, computing exactly what it did.

    python training/widen.py engine/reference_model /tmp/q8b --shape qwen3-8b --q-bits 8
    python training/widen.py engine/reference_model /tmp/moe --shape qwen3-30b-a3b --q-bits 8
    python training/widen.py SRC OUT --hidden 512 --layers 8 --experts 8 --experts-per-token 2 --dtype float32
    python training/widen_hybrid.py HYBRID_SRC /tmp/q36 --shape qwen3.6-35b-a3b --q-bits 8

A yardstick at real cost: every matrix has the big model's shape (so a forward pass reads as
many bytes and does as many FLOPs), yet the output is the small model's, so drafting accepts
what it accepts on the small model. Nothing is downloaded; it runs on any machine with MLX.

- Hidden size: the source's d dims are the first d of D, the rest zero in every embedding row
  and every matrix that writes the residual, so they stay zero. RMSNorm over D sees a mean
  square d/D of the real one: norm weights are scaled by sqrt(d/D) and `rms_norm_eps` by d/D,
  which makes the hidden norms exact.
- Heads: source KV head k goes to target KV head k * (K'/K), its query heads to the first slots
  of that head's group (so each keeps its KV head); other heads are zero (o_proj ignores them).
- Head dim (a multiple of the source's): RoPE (non-traditional) rotates dim j with j + hd/2 at
  frequency base^(-2j/hd); in a head of s*hd, pair s*j has the same frequency, so source dim j
  goes to s*j and hd/2 + j to hd'/2 + s*j, the rest zero. The per-head q/k RMSNorm then sees a
  mean square 1/s of the real one and the score scale is hd'^-1/2: both cancel when k_norm's
  weight is scaled by sqrt(1/s) (q_norm's is kept); keys and values hold the source's numbers.
  (q/k norms' effective eps becomes eps * (d/D) * s: 0.19e-6 instead of 1e-6 for qwen3-8b.)
- Intermediate: the first I units are the source's, the rest zero (silu(0) * 0 = 0).
- Layers: grow.layer_plan spreads the extra layers; each is a copy of the layer before it with
  o_proj and down_proj zeroed, so the residual passes through (its attention still runs).
- Mixture of experts (`--experts E`, qwen3_moe): every expert is the widened dense MLP and the
  router (`gate`) small random values, so tokens spread over experts as in a real MoE while the
  normalised top-k mix (norm_topk_prob) of identical experts is the dense MLP. Experts must be
  at least the source's MLP wide: Qwen3-30B-A3B's are 768, the source's 1024, so the named shape
  has experts of 1024 (its expert bytes 4/3 of the real model's; heads, layers, hidden, 128
  experts with 8 routed as the real one).
- Vocabulary stays the tokenizer's (8192) and embeddings tied, as the source's: Qwen3-8B's own
  151936-row embedding and head would add 1.2B parameters that no token here can use.

Weights are written one shard per layer (never the whole model in memory). `--q-bits 4|8`
quantises each tensor as it is written, with mx.quantize in mlx-lm's affine format (group 64,
the router at 8 bits as mlx-lm's qwen3_moe asks), so `mlx_lm convert -q` is not needed and a
30B-parameter MoE never exists in bf16 on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grow import COPIED, layer_plan  # noqa: E402

# Target shapes (hidden, layers, heads, KV heads, head dim, MLP; experts for MoE shapes)
SHAPES = {
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288),
    "qwen3-30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                          experts=128, experts_per_token=8,
                          moe_intermediate=1024),  # the real one's 768 can't hold the source's 1024-unit MLP
}
SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
              "experts", "experts_per_token", "moe_intermediate")
GROUP_SIZE = 64
ROUTER_BITS = 8  # mlx-lm's qwen3_moe quant_predicate keeps the router at 8 bits
GATES = ("mlp.gate.weight", "shared_expert_gate.weight")  # routers, and qwen3_5_moe's shared-expert gates
FLOAT32 = ("A_log",)  # Gated DeltaNet's decay: mlx-lm's qwen3_5 cast_predicate never casts it
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def source_shape(config: dict) -> dict:
    return dict(hidden=config["hidden_size"], layers=config["num_hidden_layers"],
                heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                intermediate=config["intermediate_size"], experts=0, experts_per_token=0, moe_intermediate=0)


def target_shape(src: dict, name: str | None = None, **overrides) -> dict:
    """The source's shape, then the named shape's, then any explicit sizes (None: not given)."""
    shape = dict(src)
    if name is not None:
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        shape.update(SHAPES[name])
    shape.update({k: v for k, v in overrides.items() if v is not None})
    if shape["experts"] and not shape["moe_intermediate"]:
        shape["moe_intermediate"] = shape["intermediate"]
    if shape["experts"] and not shape["experts_per_token"]:
        shape["experts_per_token"] = min(2, shape["experts"])
    check_shape(src, shape)
    return shape


def need(ok: bool, what: str) -> None:
    """A shape check: ValueError saying `what` unless `ok`."""
    if not ok:
        raise ValueError(f"can't widen to this shape: {what}")


def need_at_least(src: dict, t: dict, keys: tuple[str, ...]) -> None:
    """Every one of `keys` of the target at least the source's."""
    for key in keys:
        need(t[key] >= src[key], f"{key} {t[key]} is below the source's {src[key]}")


def check_shape(src: dict, t: dict) -> None:
    need_at_least(src, t, ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"))
    need(t["heads"] % t["kv_heads"] == 0, f"{t['heads']} heads don't split into {t['kv_heads']} KV groups")
    need(t["heads"] // t["kv_heads"] >= src["heads"] // src["kv_heads"],
         f"a KV group of {t['heads'] // t['kv_heads']} query heads can't hold the source's "
         f"{src['heads'] // src['kv_heads']}")
    need(t["head_dim"] % src["head_dim"] == 0,
         f"head_dim {t['head_dim']} is not a multiple of the source's {src['head_dim']} (RoPE frequencies)")
    if t["experts"]:
        need(0 < t["experts_per_token"] <= t["experts"], "experts_per_token must be 1..experts")
        need(t["moe_intermediate"] >= src["intermediate"],
             f"experts of {t['moe_intermediate']} units can't hold the source's MLP of {src['intermediate']}")


def widened_config(src_config: dict, src: dict, t: dict, dtype: str, q_bits: int | None) -> dict:
    c = dict(src_config)
    c.update(hidden_size=t["hidden"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
             num_key_value_heads=t["kv_heads"], head_dim=t["head_dim"], intermediate_size=t["intermediate"],
             rms_norm_eps=src_config["rms_norm_eps"] * src["hidden"] / t["hidden"], torch_dtype=dtype)
    if "max_window_layers" in c:
        c["max_window_layers"] = t["layers"]
    if t["experts"]:
        c.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=t["experts"],
                 num_experts_per_tok=t["experts_per_token"], moe_intermediate_size=t["moe_intermediate"],
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    if q_bits:
        q = {"group_size": GROUP_SIZE, "bits": q_bits, "mode": "affine"}
        if t["experts"]:  # recorded per layer, as mlx_lm's quantize_model does
            for i in range(t["layers"]):
                q[f"model.layers.{i}.mlp.gate"] = {"group_size": GROUP_SIZE, "bits": ROUTER_BITS}
        c["quantization"] = q
        c["quantization_config"] = q
    return c


def param_count(config: dict) -> dict:
    """Parameters from a qwen3 / qwen3_moe config: total, non-embedding, and active per token."""
    D, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    H, K, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = D * H * hd * 2 + D * K * hd * 2 + 2 * hd
    norms = 2 * D
    if config.get("num_experts"):
        E, k, Im = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
        mlp, mlp_active = D * E + 3 * D * Im * E, D * E + 3 * D * Im * k
    else:
        mlp = mlp_active = 3 * D * config["intermediate_size"]
    embedding = V * D * (1 if config.get("tie_word_embeddings") else 2)
    body = L * (attention + norms + mlp) + D
    active = L * (attention + norms + mlp_active) + D
    return {"total": body + embedding, "non_embedding": body, "active": active + embedding}


# ---- where the source's numbers go


def head_dim_slots(hd: int, hd2: int) -> np.ndarray:
    """Positions of a source head's dims in a wider head, keeping each RoPE pair's frequency."""
    s, j = hd2 // hd, np.arange(hd // 2)
    return np.concatenate([s * j, hd2 // 2 + s * j])


def head_places(src: dict, t: dict) -> tuple[list[int], list[int]]:
    """Target index of each source query head and each source KV head."""
    group, group2 = src["heads"] // src["kv_heads"], t["heads"] // t["kv_heads"]
    kv = [k * (t["kv_heads"] // src["kv_heads"]) for k in range(src["kv_heads"])]
    q = [kv[h // group] * group2 + h % group for h in range(src["heads"])]
    return q, kv


def head_rows(heads: list[int], src: dict, t: dict) -> np.ndarray:
    slots = head_dim_slots(src["head_dim"], t["head_dim"])
    return np.concatenate([h * t["head_dim"] + slots for h in heads])


def placed(w: np.ndarray, shape: tuple[int, int], rows=None, cols=None) -> np.ndarray:
    """A zero matrix of `shape` with w at the given rows/cols (default: the first ones)."""
    out = np.zeros(shape, np.float32)
    r = np.arange(w.shape[0]) if rows is None else rows
    c = np.arange(w.shape[1]) if cols is None else cols
    out[np.ix_(r, c)] = w
    return out


def padded(v: np.ndarray, n: int, at=None, scale: float = 1.0) -> np.ndarray:
    out = np.zeros(n, np.float32)
    out[np.arange(v.size) if at is None else at] = v * scale
    return out


def widened_layer(w: dict, src: dict, t: dict, identity: bool, rng: np.random.Generator,
                  router_std: float) -> dict:
    """One layer's tensors (float32 numpy, names below the layer), from source layer `w`."""
    D, hd, hd2 = t["hidden"], src["head_dim"], t["head_dim"]
    q_heads, kv_heads = head_places(src, t)
    q_rows, kv_rows = head_rows(q_heads, src, t), head_rows(kv_heads, src, t)
    slots = head_dim_slots(hd, hd2)
    norm_scale = math.sqrt(src["hidden"] / D)
    out = {
        "input_layernorm.weight": padded(w["input_layernorm.weight"], D, scale=norm_scale),
        "post_attention_layernorm.weight": padded(w["post_attention_layernorm.weight"], D, scale=norm_scale),
        "self_attn.q_norm.weight": padded(w["self_attn.q_norm.weight"], hd2, at=slots),
        "self_attn.k_norm.weight": padded(w["self_attn.k_norm.weight"], hd2, at=slots, scale=math.sqrt(hd / hd2)),
        "self_attn.q_proj.weight": placed(w["self_attn.q_proj.weight"], (t["heads"] * hd2, D), rows=q_rows),
        "self_attn.k_proj.weight": placed(w["self_attn.k_proj.weight"], (t["kv_heads"] * hd2, D), rows=kv_rows),
        "self_attn.v_proj.weight": placed(w["self_attn.v_proj.weight"], (t["kv_heads"] * hd2, D), rows=kv_rows),
        "self_attn.o_proj.weight": placed(w["self_attn.o_proj.weight"], (D, t["heads"] * hd2), cols=q_rows),
    }
    units = t["moe_intermediate"] if t["experts"] else t["intermediate"]
    mlp = {
        "gate_proj": placed(w["mlp.gate_proj.weight"], (units, D)),
        "up_proj": placed(w["mlp.up_proj.weight"], (units, D)),
        "down_proj": placed(w["mlp.down_proj.weight"], (D, units)),
    }
    if identity:  # the residual passes through: nothing is written back
        out["self_attn.o_proj.weight"][:] = 0
        mlp["down_proj"][:] = 0
    if t["experts"]:
        out["mlp.gate.weight"] = rng.normal(0.0, router_std, (t["experts"], D)).astype(np.float32)
        for name, m in mlp.items():
            out[f"mlp.switch_mlp.{name}.weight"] = m  # stacked E times when written
    else:
        out.update({f"mlp.{name}.weight": m for name, m in mlp.items()})
    return out


# ---- writing


class ShardWriter:
    """One safetensors file per call of `write`, quantised as mlx-lm would, plus the index."""

    def __init__(self, out: Path, shards: int, dtype, q_bits: int | None, experts: int):
        self.out, self.shards, self.dtype, self.q_bits, self.experts = out, shards, dtype, q_bits, experts
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.count = 0

    def tensors(self, name: str, v: np.ndarray) -> dict[str, mx.array]:
        a = mx.array(v).astype(mx.float32 if name.endswith(FLOAT32) else self.dtype)
        stacked = ".switch_mlp." in name
        prefix = name[: -len(".weight")]
        quantise = self.q_bits and v.ndim == 2 and name.endswith(".weight") and v.shape[-1] % GROUP_SIZE == 0
        if not quantise:
            return {name: self.stack(a) if stacked else a}
        bits = ROUTER_BITS if name.endswith(GATES) else self.q_bits
        wq, scales, biases = mx.quantize(a, group_size=GROUP_SIZE, bits=bits)
        parts = {f"{prefix}.weight": wq, f"{prefix}.scales": scales, f"{prefix}.biases": biases}
        return {k: self.stack(p) for k, p in parts.items()} if stacked else parts

    def stack(self, a: mx.array) -> mx.array:
        """Identical experts: one copy quantised, then repeated (what quantising the stack gives)."""
        return mx.repeat(a[None], self.experts, axis=0)

    def write(self, named: dict[str, np.ndarray]) -> None:
        self.count += 1
        fname = f"model-{self.count:05d}-of-{self.shards:05d}.safetensors"
        arrays: dict[str, mx.array] = {}
        for name, v in named.items():
            arrays.update(self.tensors(name, v))
        mx.eval(arrays)
        mx.save_safetensors(str(self.out / fname), arrays, metadata={"format": "mlx"})
        for k, a in arrays.items():
            self.weight_map[k] = fname
            self.total_bytes += a.nbytes

    def finish(self) -> None:
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_source(src_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((src_dir / "config.json").read_text())
    if config.get("model_type") != "qwen3" or "quantization" in config:
        raise ValueError(f"widen takes an unquantised qwen3 model, not {src_dir} "
                         f"({config.get('model_type')!r}{', quantised' if 'quantization' in config else ''})")
    weights = {}
    for f in sorted(src_dir.glob("model*.safetensors")):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return config, weights


def widen(src_dir: Path, out: Path, shape: dict, dtype: str = "bfloat16", q_bits: int | None = None,
          seed: int = 0, router_std: float = 0.02) -> dict:
    """Write the widened model to `out`; returns its config."""
    src_config, weights = load_source(Path(src_dir))
    src = source_shape(src_config)
    check_shape(src, shape)
    if q_bits not in (None, 4, 8):
        raise ValueError(f"--q-bits is 4 or 8, not {q_bits}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()  # a previous build's shards would be loaded beside the new ones
    config = widened_config(src_config, src, shape, dtype, q_bits)
    D = shape["hidden"]
    writer = ShardWriter(out, shape["layers"] + 1, DTYPES[dtype], q_bits, shape["experts"])
    top = {"model.embed_tokens.weight": placed(weights["model.embed_tokens.weight"], (src_config["vocab_size"], D)),
           "model.norm.weight": padded(weights["model.norm.weight"], D, scale=math.sqrt(src["hidden"] / D))}
    if "lm_head.weight" in weights:
        top["lm_head.weight"] = placed(weights["lm_head.weight"], (src_config["vocab_size"], D))
    writer.write(top)
    rng = np.random.default_rng(seed)
    for i, (old, identity) in enumerate(layer_plan(src["layers"], shape["layers"])):
        prefix = f"model.layers.{old}."
        w = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        layer = widened_layer(w, src, shape, identity, rng, router_std)
        writer.write({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    writer.finish()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        if (Path(src_dir) / name).exists():
            shutil.copy2(Path(src_dir) / name, out / name)
    return config


def add_common_flags(ap: argparse.ArgumentParser) -> None:
    """The output's flags, shared with widen_hybrid.py's command."""
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--q-bits", type=int, choices=(4, 8), help="quantise as written (mlx-lm affine, group 64)")
    ap.add_argument("--seed", type=int, default=0, help="the routers' random weights")
    ap.add_argument("--router-std", type=float, default=0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="A qwen3_5 hybrid is widened by training/widen_hybrid.py.")
    ap.add_argument("src", type=Path, help="unquantised qwen3 model directory (e.g. engine/reference_model)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a named target shape; the flags below override it")
    for key in SHAPE_KEYS:
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    add_common_flags(ap)
    args = ap.parse_args()
    src_config = json.loads((args.src / "config.json").read_text())
    if src_config.get("model_type") == "qwen3_5":
        raise SystemExit(f"widen: {args.src} is a qwen3_5 hybrid: use training/widen_hybrid.py")
    try:
        shape = target_shape(source_shape(src_config), args.shape, **{k: getattr(args, k) for k in SHAPE_KEYS})
        config = widen(args.src, args.out, shape, args.dtype, args.q_bits, args.seed, args.router_std)
    except ValueError as e:
        raise SystemExit(f"widen: {e}")
    counts = param_count(config)
    print(f"{args.out}: {config['model_type']}, hidden {shape['hidden']}, {shape['layers']} layers, "
          f"{shape['heads']}/{shape['kv_heads']} heads of {shape['head_dim']}"
          + (f", {shape['experts']} experts ({shape['experts_per_token']} routed) of {shape['moe_intermediate']}"
             if shape["experts"] else f", MLP {shape['intermediate']}")
          + f"; {counts['total'] / 1e9:.2f}B parameters ({counts['active'] / 1e9:.2f}B active), "
          f"{args.dtype}{f', {args.q_bits}-bit' if args.q_bits else ''}")


if __name__ == "__main__":
    main()
