"""Widen a qwen3_5 hybrid (Gated DeltaNet + gated attention) to a real model's shape, computing what it did.

    python training/widen_hybrid.py SRC /tmp/q36 --shape qwen3.6-35b-a3b --q-bits 8
    python training/widen_hybrid.py SRC OUT --hidden 192 --layers 6 --full-attention-interval 3 --experts 8 ...

SRC is any qwen3_5 directory (mlx-lm's or Hugging Face's layout: it is read through mlx-lm's own
loader; a quantised one, as the bundled 8-bit `engine/reference_model_hybrid`, is widened from its
dequantized values, so the yardstick computes what its kernels did). The target is a `qwen3_5_moe`
with `--experts`, else a wider `qwen3_5`. widen.py's placements hold (read its docstring first):
the source's hidden dims are the first d of D, a source head keeps its KV group, extra heads,
units and dims are zero where they would write to the residual. What is new here:

- Every RMSNorm's eps is exact, not only nearly so. One `rms_norm_eps` serves all norms, and the
  Gated DeltaNet's gated norm fixes it (below): eps' = eps * (dv/dv')(dk/dk'). A norm over n' dims
  whose input is b times the source's n dims, zero-padded, computes the source's norm exactly when
  b^2 = (eps'/eps)(n'/n); its weight then sets the output scale. So the residual stream carries b
  times the source's numbers (the embedding and every matrix writing to it, o_proj / out_proj /
  down_proj, scaled by b = sqrt((eps'/eps)(D/d)); norm weights by sqrt(d/D); a tied head gets its
  1/b back from the final norm's weight), and q_proj / k_proj scale queries and keys into q_norm /
  k_norm by sqrt((eps'/eps)(hd'/hd)) (q_norm's weight kept and k_norm's scaled by sqrt(hd/hd')
  cancel the score scale hd'^-1/2, as widen.py). Nothing else reads the residual or those q/k.
  Equal up to float rounding (the scaled weights are rounded), as the MoE's mix of equal experts.

- Gated attention: q_proj holds, per head, the query then its output gate (hd each); both go to
  the same slots of the wider head, and the gate's extra dims are zero (sigmoid(0) times a zero
  value). Partial RoPE rotates only the first rd = hd * partial_rotary_factor dims, pairing j with
  j + rd/2. widen.py's head_dim_slots (x -> s*x in the first half, hd/2 + i -> hd'/2 + s*i)
  keeps every such pair a pair of the target's rd' = s*rd rotated dims at the same frequency,
  and sends unrotated dims to unrotated ones, so it serves here unchanged. The factor is the
  source's, so the target's rotated width must be s times the source's.
- Gated DeltaNet: value head h reads key head h // (Hv/Hk) (mlx-lm repeats q and k per group), so
  key heads are placed as KV heads and value heads as the query heads of their group. The
  depthwise conv1d over the concatenated [q | k | v] channels is per channel: each source
  channel's kernel goes to its channel's new place, the others are zero (silu(conv(0)) = 0).
  q and k are L2-normalised over the key head dim with a fixed eps (1e-6 on the sum of squares),
  so zero-padding a key head changes neither; only q's readout scale dk^-1/2 becomes dk'^-1/2,
  scaling the output by sqrt(dk/dk'). Nothing can undo that before the gated RMSNorm that
  follows (v passes silu, q and k are normalised), and that norm sees dv/dv' of the mean square
  of its input: it is exact with eps' = eps * (dv/dv')(dk/dk') (the config's, see above) and
  its weight scaled by sqrt(dv/dv'). (In a random tiny model that norm's input has a mean square
  near 1e-5, so an eps merely near the source's changes the logits by ~1.) Zero heads stay
  zero, not NaN: q = k = v = 0 gives state 0, and the norm divides 0 by sqrt(eps). Extra heads'
  A_log and dt_bias are 0 (any finite value would do).
- Layers: the target has full attention every `full_attention_interval`-th layer. The source's
  layers keep their order and each lands on a layer of its own kind, as near its proportional
  place as leaves room for the rest; every other layer is an identity copy of the nearest earlier
  source layer of its kind (the first one, if none is earlier) with out_proj / o_proj and the MLP's
  down_proj zero. The source must have a layer of each kind the target needs.
- Mixture of experts: every routed expert is the widened dense MLP and the router small random
  values, as widen.py. The shared expert is all zeros: it adds sigmoid(gate) * down_proj(...) = 0
  exactly, whatever its gate (the simplest exact choice; a copy with a gate would need the sum
  arranged, and could not be bit-exact anyway). Experts narrower than the source's MLP can't hold
  it: the named shape widens them to the source's MLP (the command says so); explicit
  `--moe-intermediate` below it is refused.

Named shape `qwen3.6-35b-a3b` (Qwen3.6-35B-A3B = Qwen3.5-35B-A3B's architecture, model_type
qwen3_5_moe). Published: 256 experts, 8 routed plus 1 shared, 3:1 Gated DeltaNet to gated
attention, partial RoPE 0.25, 35B total / 3B active. Assumed (not checked against the released
config.json, which can't be downloaded here): hidden 2048, 40 layers with full attention every 4th,
attention 16 query / 2 KV heads of 256, Gated DeltaNet 16 key heads of 128 and 32 value heads of
128, conv kernel 4, experts of 512, shared expert 512. With Qwen's 248320-token untied vocabulary
these give 34.7B parameters, 3.4B active (without the MTP layer), matching the published sizes.
Vocabulary, tied or untied head, RoPE base and factor stay the source's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grow import COPIED  # noqa: E402
from widen import (DTYPES, GROUP_SIZE, ROUTER_BITS, SHAPE_KEYS, ShardWriter, add_common_flags,  # noqa: E402
                   check_shape, head_dim_slots, head_places, need, need_at_least, padded, placed)

HYBRID_SHAPES = {
    "qwen3.6-35b-a3b": dict(hidden=2048, layers=40, full_attention_interval=4, heads=16, kv_heads=2, head_dim=256,
                            linear_key_heads=16, linear_key_head_dim=128, linear_value_heads=32,
                            linear_value_head_dim=128, conv_kernel=4, experts=256, experts_per_token=8,
                            moe_intermediate=512, shared_intermediate=512),
}
HYBRID_KEYS = SHAPE_KEYS + ("full_attention_interval", "linear_key_heads", "linear_key_head_dim",
                            "linear_value_heads", "linear_value_head_dim", "shared_intermediate")
LINEAR, FULL = "linear_attention", "full_attention"  # Hugging Face's layer_types names
PREFIX = "language_model.model."


def text_config_of(config: dict) -> dict:
    return config.get("text_config", config)


def hybrid_source_shape(config: dict) -> dict:
    """The source's sizes, read through mlx-lm's own arguments (which derive head_dim and the RoPE factor)."""
    from mlx_lm.models.qwen3_5 import TextModelArgs

    args = TextModelArgs.from_dict(copy.deepcopy(text_config_of(config)))
    return dict(hidden=args.hidden_size, layers=args.num_hidden_layers, heads=args.num_attention_heads,
                kv_heads=args.num_key_value_heads, head_dim=args.head_dim, intermediate=args.intermediate_size,
                experts=0, experts_per_token=0, moe_intermediate=0, shared_intermediate=0,
                full_attention_interval=args.full_attention_interval,
                linear_key_heads=args.linear_num_key_heads, linear_key_head_dim=args.linear_key_head_dim,
                linear_value_heads=args.linear_num_value_heads, linear_value_head_dim=args.linear_value_head_dim,
                conv_kernel=args.linear_conv_kernel_dim, rotary_factor=args.partial_rotary_factor)


def rotary_dims(shape: dict, rotary_factor: float) -> int:
    return int(shape["head_dim"] * rotary_factor)  # as mlx-lm's attention sizes its RoPE


def hybrid_target_shape(src: dict, name: str | None = None, **overrides) -> dict:
    """The source's shape, then the named shape's, then any explicit sizes (None: not given)."""
    shape = dict(src)
    if name is not None:
        if name not in HYBRID_SHAPES:
            raise ValueError(f"unknown hybrid shape {name!r}; known: {', '.join(HYBRID_SHAPES)}")
        shape.update(HYBRID_SHAPES[name])
    given = {k: v for k, v in overrides.items() if v is not None}
    shape.update(given)
    if shape["experts"]:
        if not shape["moe_intermediate"]:
            shape["moe_intermediate"] = shape["intermediate"]
        if name is not None and "moe_intermediate" not in given and shape["moe_intermediate"] < src["intermediate"]:
            # the named shape's experts can't hold the source's MLP: widen them (reported by the command)
            shape["experts_widened_from"] = shape["moe_intermediate"]
            shape["moe_intermediate"] = src["intermediate"]
        shape["shared_intermediate"] = shape["shared_intermediate"] or shape["moe_intermediate"]
        shape["experts_per_token"] = shape["experts_per_token"] or min(2, shape["experts"])
    check_hybrid_shape(src, shape)
    return shape


def check_hybrid_shape(src: dict, t: dict) -> None:
    check_shape(src, t)  # hidden, attention heads and head dim, MLP, experts: as for qwen3
    need_at_least(src, t, ("linear_key_heads", "linear_key_head_dim", "linear_value_heads", "linear_value_head_dim"))
    need(t["linear_value_heads"] % t["linear_key_heads"] == 0,
         f"{t['linear_value_heads']} value heads don't split into {t['linear_key_heads']} key-head groups")
    group, group2 = (src["linear_value_heads"] // src["linear_key_heads"],
                     t["linear_value_heads"] // t["linear_key_heads"])
    need(group2 >= group, f"a key head's group of {group2} value heads can't hold the source's {group}")
    need(t["conv_kernel"] == src["conv_kernel"],
         f"conv kernel {t['conv_kernel']} is not the source's {src['conv_kernel']}")
    s = t["head_dim"] // src["head_dim"]
    need(rotary_dims(t, src["rotary_factor"]) == s * rotary_dims(src, src["rotary_factor"]),
         f"head_dim {t['head_dim']} doesn't rotate {s} times the source's {rotary_dims(src, src['rotary_factor'])} "
         f"dims at partial_rotary_factor {src['rotary_factor']}")
    need(t["full_attention_interval"] >= 1, "full_attention_interval must be at least 1")
    hybrid_layer_plan(src, t)  # raises if the source's layers don't fit in order


# ---- layers


def layer_kinds(layers: int, interval: int) -> list[str]:
    """mlx-lm's rule: layer i has full attention when (i + 1) is a multiple of the interval."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


def fits_in_order(kinds: list[str], start: int, wanted: list[str]) -> bool:
    """Can layers of the `wanted` kinds be placed, in order, on `kinds` from `start` on?"""
    for kind in wanted:
        start = next((p for p in range(start, len(kinds)) if kinds[p] == kind), None)
        if start is None:
            return False
        start += 1
    return True


def source_positions(src_kinds: list[str], kinds: list[str]) -> list[int]:
    """The target layer of each source layer: its own kind, in order, nearest its proportional
    place (source layer i of n near i * L'/n) among the places that leave room for the rest."""
    positions, after = [], 0
    for i, kind in enumerate(src_kinds):
        ideal = i * len(kinds) // len(src_kinds)
        fitting = [p for p in range(after, len(kinds))
                   if kinds[p] == kind and fits_in_order(kinds, p + 1, src_kinds[i + 1:])]
        if not fitting:
            raise ValueError(f"can't widen to this shape: the source's {len(src_kinds)} layers don't fit in order "
                             f"into {len(kinds)} layers of which {kinds.count(FULL)} have full attention")
        positions.append(min(fitting, key=lambda p: abs(p - ideal)))
        after = positions[-1] + 1
    return positions


def hybrid_layer_plan(src: dict, t: dict) -> list[tuple[int, bool]]:
    """For each target layer: (the source layer it comes from, whether it is an identity copy)."""
    src_kinds = layer_kinds(src["layers"], src["full_attention_interval"])
    kinds = layer_kinds(t["layers"], t["full_attention_interval"])
    placed_at = {p: i for i, p in enumerate(source_positions(src_kinds, kinds))}
    plan = []
    for p, kind in enumerate(kinds):
        if p in placed_at:
            plan.append((placed_at[p], False))
            continue
        earlier = [placed_at[q] for q in range(p) if q in placed_at and kinds[q] == kind]
        same_kind = earlier or [i for i, k in enumerate(src_kinds) if k == kind]
        if not same_kind:
            raise ValueError(f"can't widen to this shape: the source has no {kind} layer to copy")
        plan.append((same_kind[-1] if earlier else same_kind[0], True))
    return plan


# ---- where the source's numbers go


def norm_scales(src: dict, t: dict) -> dict:
    """eps'/eps, and the factors on the residual stream and on the queries and keys that make
    every RMSNorm exact with eps' (module docstring)."""
    eps = ((src["linear_value_head_dim"] / t["linear_value_head_dim"])
           * (src["linear_key_head_dim"] / t["linear_key_head_dim"]))
    return {"eps": eps, "residual": math.sqrt(eps * t["hidden"] / src["hidden"]),
            "qk": math.sqrt(eps * t["head_dim"] / src["head_dim"])}


def spread(heads: list[int], width: int, dims: np.ndarray) -> np.ndarray:
    """Flat positions of `dims` within each of `heads`, heads `width` apart."""
    return np.concatenate([h * width + dims for h in heads])


def widened_self_attn(w: dict, src: dict, t: dict, identity: bool) -> dict:
    D, hd, hd2 = t["hidden"], src["head_dim"], t["head_dim"]
    scales = norm_scales(src, t)
    slots = head_dim_slots(hd, hd2)  # right for partial RoPE too (module docstring)
    q_heads, kv_heads = head_places(src, t)
    # q_proj: per head the query's hd rows, then its output gate's hd rows; both to the same slots
    q_rows = np.concatenate([np.concatenate([h * 2 * hd2 + slots, h * 2 * hd2 + hd2 + slots]) for h in q_heads])
    kv_rows, out_cols = spread(kv_heads, hd2, slots), spread(q_heads, hd2, slots)
    # queries (not their gates) and keys enter q_norm / k_norm scaled so that eps' is exact there
    query_scale = np.tile(np.repeat([scales["qk"], 1.0], hd), src["heads"])[:, None]
    out = {
        "q_norm.weight": padded(w["q_norm.weight"], hd2, at=slots),
        "k_norm.weight": padded(w["k_norm.weight"], hd2, at=slots, scale=math.sqrt(hd / hd2)),
        "q_proj.weight": placed(w["q_proj.weight"] * query_scale, (t["heads"] * 2 * hd2, D), rows=q_rows),
        "k_proj.weight": placed(w["k_proj.weight"] * scales["qk"], (t["kv_heads"] * hd2, D), rows=kv_rows),
        "v_proj.weight": placed(w["v_proj.weight"], (t["kv_heads"] * hd2, D), rows=kv_rows),
        "o_proj.weight": placed(w["o_proj.weight"] * scales["residual"], (D, t["heads"] * hd2), cols=out_cols),
    }
    if identity:
        out["o_proj.weight"][:] = 0
    return {f"self_attn.{k}": v for k, v in out.items()}


def linear_attn_places(src: dict, t: dict) -> tuple[list[int], list[int]]:
    """Target index of each source value head and key head: value heads are grouped by key head
    as query heads by KV head (value head h reads key head h // (Hv/Hk))."""
    return head_places(dict(heads=src["linear_value_heads"], kv_heads=src["linear_key_heads"]),
                       dict(heads=t["linear_value_heads"], kv_heads=t["linear_key_heads"]))


def widened_linear_attn(w: dict, src: dict, t: dict, identity: bool) -> dict:
    D = t["hidden"]
    dk, dk2, dv, dv2 = (src["linear_key_head_dim"], t["linear_key_head_dim"],
                        src["linear_value_head_dim"], t["linear_value_head_dim"])
    v_heads, k_heads = linear_attn_places(src, t)
    key_dims = spread(k_heads, dk2, np.arange(dk))  # a key head's dims are its first dk
    value_dims = spread(v_heads, dv2, np.arange(dv))
    key_width, value_width = t["linear_key_heads"] * dk2, t["linear_value_heads"] * dv2
    # in_proj_qkv and the depthwise conv share the channel layout [q | k | v]
    channels = np.concatenate([key_dims, key_width + key_dims, 2 * key_width + value_dims])
    conv = np.zeros((2 * key_width + value_width, *w["conv1d.weight"].shape[1:]), np.float32)
    conv[channels] = w["conv1d.weight"]
    out = {
        "in_proj_qkv.weight": placed(w["in_proj_qkv.weight"], (conv.shape[0], D), rows=channels),
        "conv1d.weight": conv,
        "in_proj_z.weight": placed(w["in_proj_z.weight"], (value_width, D), rows=value_dims),
        "in_proj_b.weight": placed(w["in_proj_b.weight"], (t["linear_value_heads"], D), rows=v_heads),
        "in_proj_a.weight": placed(w["in_proj_a.weight"], (t["linear_value_heads"], D), rows=v_heads),
        "A_log": padded(w["A_log"], t["linear_value_heads"], at=v_heads),
        "dt_bias": padded(w["dt_bias"], t["linear_value_heads"], at=v_heads),
        # the gated RMSNorm over a value head sees dv/dv' of the mean square (q's readout scale cancels)
        "norm.weight": padded(w["norm.weight"], dv2, scale=math.sqrt(dv / dv2)),
        "out_proj.weight": placed(w["out_proj.weight"] * norm_scales(src, t)["residual"], (D, value_width),
                                  cols=value_dims),
    }
    if identity:
        out["out_proj.weight"][:] = 0
    return {f"linear_attn.{k}": v for k, v in out.items()}


def widened_mlp(w: dict, src: dict, t: dict, identity: bool, rng: np.random.Generator, router_std: float) -> dict:
    D = t["hidden"]
    units = t["moe_intermediate"] if t["experts"] else t["intermediate"]
    mlp = {
        "gate_proj": placed(w["mlp.gate_proj.weight"], (units, D)),
        "up_proj": placed(w["mlp.up_proj.weight"], (units, D)),
        "down_proj": placed(w["mlp.down_proj.weight"] * norm_scales(src, t)["residual"], (D, units)),
    }
    if identity:
        mlp["down_proj"][:] = 0
    if not t["experts"]:
        return {f"mlp.{name}.weight": m for name, m in mlp.items()}
    out = {"mlp.gate.weight": rng.normal(0.0, router_std, (t["experts"], D)).astype(np.float32)}
    out.update({f"mlp.switch_mlp.{name}.weight": m for name, m in mlp.items()})  # stacked E times when written
    # the shared expert is all zeros: down_proj = 0 makes sigmoid(gate(x)) * shared(x) exactly 0
    shared = t["shared_intermediate"]
    out.update({"mlp.shared_expert.gate_proj.weight": np.zeros((shared, D), np.float32),
                "mlp.shared_expert.up_proj.weight": np.zeros((shared, D), np.float32),
                "mlp.shared_expert.down_proj.weight": np.zeros((D, shared), np.float32),
                "mlp.shared_expert_gate.weight": np.zeros((1, D), np.float32)})
    return out


def widened_hybrid_layer(w: dict, src: dict, t: dict, identity: bool, rng: np.random.Generator,
                         router_std: float) -> dict:
    """One layer's tensors (float32 numpy, names below the layer), from source layer `w`."""
    norm_scale = math.sqrt(src["hidden"] / t["hidden"])
    out = {name: padded(w[name], t["hidden"], scale=norm_scale)
           for name in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    if "linear_attn.A_log" in w:
        out.update(widened_linear_attn(strip(w, "linear_attn."), src, t, identity))
    else:
        out.update(widened_self_attn(strip(w, "self_attn."), src, t, identity))
    out.update(widened_mlp(w, src, t, identity, rng, router_std))
    return out


def strip(w: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}


# ---- config and size


def widened_hybrid_config(src_config: dict, src: dict, t: dict, dtype: str, q_bits: int | None) -> dict:
    quantized = ("quantization", "quantization_config")  # a flat source holds them beside its text fields
    text = {k: v for k, v in text_config_of(src_config).items() if k not in quantized}
    text.update(hidden_size=t["hidden"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                num_key_value_heads=t["kv_heads"], head_dim=t["head_dim"], intermediate_size=t["intermediate"],
                full_attention_interval=t["full_attention_interval"],
                linear_num_key_heads=t["linear_key_heads"], linear_key_head_dim=t["linear_key_head_dim"],
                linear_num_value_heads=t["linear_value_heads"], linear_value_head_dim=t["linear_value_head_dim"],
                rms_norm_eps=text["rms_norm_eps"] * norm_scales(src, t)["eps"])
    if "layer_types" in text:
        text["layer_types"] = layer_kinds(t["layers"], t["full_attention_interval"])
    top = {k: v for k, v in src_config.items() if k not in ("text_config", *quantized)}
    if "text_config" not in src_config:  # a flat source: its text fields move under text_config
        top = {k: top[k] for k in ("tie_word_embeddings", "eos_token_id") if k in top}
    if t["experts"]:
        text.update(model_type="qwen3_5_moe_text", num_experts=t["experts"], num_experts_per_tok=t["experts_per_token"],
                    moe_intermediate_size=t["moe_intermediate"], shared_expert_intermediate_size=t["shared_intermediate"],
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        top.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"])
    else:
        top["model_type"] = src_config["model_type"]
    top.update(text_config=text, torch_dtype=dtype)
    if q_bits:
        q = {"group_size": GROUP_SIZE, "bits": q_bits, "mode": "affine"}
        if t["experts"]:  # mlx-lm's qwen3_5 quant_predicate: routers and shared-expert gates at 8 bits, per layer
            for i in range(t["layers"]):
                for gate in ("mlp.gate", "mlp.shared_expert_gate"):
                    q[f"{PREFIX}layers.{i}.{gate}"] = {"group_size": GROUP_SIZE, "bits": ROUTER_BITS}
        top["quantization"] = q
        top["quantization_config"] = q
    return top


def hybrid_param_count(config: dict) -> dict:
    """Parameters from a qwen3_5 / qwen3_5_moe config: total, non-embedding, and active per token."""
    c = text_config_of(config)
    D, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    H, K, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attention = D * H * hd * 2 + D * K * hd * 2 + H * hd * D + 2 * hd  # q_proj holds the output gate too
    Hk, dk, Hv, dv = (c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_num_value_heads"],
                      c["linear_value_head_dim"])
    conv_dim = 2 * Hk * dk + Hv * dv
    linear = (D * conv_dim + D * Hv * dv + 2 * D * Hv  # in_proj_qkv, in_proj_z, in_proj_b and _a
              + conv_dim * c["linear_conv_kernel_dim"] + 2 * Hv + dv + Hv * dv * D)  # conv, A_log, dt_bias, norm, out
    if c.get("num_experts"):
        E, k, Im, Is = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], \
            c["shared_expert_intermediate_size"]
        shared = 3 * D * Is + D  # the shared expert and its gate
        mlp, mlp_active = D * E + 3 * D * Im * E + shared, D * E + 3 * D * Im * k + shared
    else:
        mlp = mlp_active = 3 * D * c["intermediate_size"]
    full = sum(kind == FULL for kind in layer_kinds(L, c["full_attention_interval"]))
    mixers = full * attention + (L - full) * linear
    embedding = V * D * (1 if c.get("tie_word_embeddings") else 2)
    body = mixers + L * (2 * D + mlp) + D
    active = mixers + L * (2 * D + mlp_active) + D
    return {"total": body + embedding, "non_embedding": body, "active": active + embedding}


# ---- reading and writing


def check_hybrid_source(config: dict, src_dir: Path) -> None:
    if config.get("model_type") != "qwen3_5" or text_config_of(config).get("num_experts"):
        raise ValueError(f"widen_hybrid takes a dense qwen3_5 hybrid, not {src_dir} ({config.get('model_type')!r})")


def load_hybrid_source(src_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The source's config and float32 weights under mlx-lm's names (HF layouts sanitised by its loader).
    A quantised source (the bundled 8-bit hybrid) gives its dequantized values: what its kernels compute with."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load_model

    config = json.loads((src_dir / "config.json").read_text())
    check_hybrid_source(config, src_dir)
    model, _ = load_model(src_dir, lazy=True)
    if "quantization" in config or "quantization_config" in config:  # mlx-lm quantises from either
        model = dequantize_model(model)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    return config, weights


def widen_hybrid(src_dir: Path, out: Path, shape: dict, dtype: str = "bfloat16", q_bits: int | None = None,
                 seed: int = 0, router_std: float = 0.02) -> dict:
    """Write the widened hybrid to `out`; returns its config."""
    src_dir, out = Path(src_dir), Path(out)
    src_config, weights = load_hybrid_source(src_dir)
    src = hybrid_source_shape(src_config)
    check_hybrid_shape(src, shape)
    if q_bits not in (None, 4, 8):
        raise ValueError(f"--q-bits is 4 or 8, not {q_bits}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()  # a previous build's shards would be loaded beside the new ones
    config = widened_hybrid_config(src_config, src, shape, dtype, q_bits)
    D, vocab = shape["hidden"], weights[f"{PREFIX}embed_tokens.weight"].shape[0]
    writer = ShardWriter(out, shape["layers"] + 1, DTYPES[dtype], q_bits, shape["experts"])
    residual = norm_scales(src, shape)["residual"]
    untied = "language_model.lm_head.weight" in weights
    # the final norm hands the head the source's numbers; a tied head reads the scaled embedding, so 1/b of them
    final_scale = math.sqrt(src["hidden"] / D) / (1.0 if untied else residual)
    top = {f"{PREFIX}embed_tokens.weight": placed(weights[f"{PREFIX}embed_tokens.weight"] * residual, (vocab, D)),
           f"{PREFIX}norm.weight": padded(weights[f"{PREFIX}norm.weight"], D, scale=final_scale)}
    if untied:
        top["language_model.lm_head.weight"] = placed(weights["language_model.lm_head.weight"], (vocab, D))
    writer.write(top)
    rng = np.random.default_rng(seed)
    for i, (old, identity) in enumerate(hybrid_layer_plan(src, shape)):
        layer = widened_hybrid_layer(strip(weights, f"{PREFIX}layers.{old}."), src, shape, identity, rng, router_std)
        writer.write({f"{PREFIX}layers.{i}.{k}": v for k, v in layer.items()})
    writer.finish()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        if (src_dir / name).exists():
            shutil.copy2(src_dir / name, out / name)
    return config


def summary(out: Path, config: dict, shape: dict, dtype: str, q_bits: int | None) -> str:
    """The command's one line about what it wrote."""
    counts = hybrid_param_count(config)
    kinds = layer_kinds(shape["layers"], shape["full_attention_interval"])
    mlp = (f"{shape['experts']} experts ({shape['experts_per_token']} routed) of {shape['moe_intermediate']}"
           + (f" (widened from {shape['experts_widened_from']} to hold the source's MLP)"
              if "experts_widened_from" in shape else "")
           + f" + a shared expert of {shape['shared_intermediate']}" if shape["experts"]
           else f"MLP {shape['intermediate']}")
    return (f"{out}: {config['model_type']}, hidden {shape['hidden']}, {shape['layers']} layers "
            f"({kinds.count(LINEAR)} Gated DeltaNet of {shape['linear_key_heads']}/{shape['linear_value_heads']} "
            f"heads of {shape['linear_key_head_dim']}/{shape['linear_value_head_dim']}, {kinds.count(FULL)} gated "
            f"attention of {shape['heads']}/{shape['kv_heads']} heads of {shape['head_dim']}), {mlp}; "
            f"{counts['total'] / 1e9:.2f}B parameters ({counts['active'] / 1e9:.2f}B active), "
            f"{dtype}{f', {q_bits}-bit' if q_bits else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="qwen3_5 model directory (quantised ones are widened dequantized)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(HYBRID_SHAPES), help="a named target shape; the flags below override it")
    for key in HYBRID_KEYS:
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    add_common_flags(ap)
    args = ap.parse_args()
    try:
        src_config = json.loads((args.src / "config.json").read_text())
        check_hybrid_source(src_config, args.src)
        given = {k: getattr(args, k) for k in HYBRID_KEYS}
        shape = hybrid_target_shape(hybrid_source_shape(src_config), args.shape, **given)
        config = widen_hybrid(args.src, args.out, shape, args.dtype, args.q_bits, args.seed, args.router_std)
    except (ValueError, OSError) as e:
        raise SystemExit(f"widen_hybrid: {e}")
    print(summary(args.out, config, shape, args.dtype, args.q_bits))


if __name__ == "__main__":
    main()
