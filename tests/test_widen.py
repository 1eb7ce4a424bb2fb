"""training/widen.py: the bundled model widened to a bigger dense or MoE shape computes what it did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, quantize_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
from widen import param_count, source_shape, target_shape, widen, widened_config  # noqa: E402

SOURCE = ROOT / "engine" / "reference_model"
PROMPTS = [
    "def rename_symbol(path, old, new):\n    text = path.read_text()\n",
    "<|im_start|>user\nRename total to count in:\nfor x in items:\n    total += x\n<|im_end|>\n"
    "<|im_start|>assistant\n",
]
# small widths that still move every axis: hidden, heads, KV heads, head dim (RoPE remap), MLP, layers
SMALL = dict(hidden=512, layers=8, heads=16, kv_heads=4, head_dim=128, intermediate=1536)
SMALL_MOE = dict(SMALL, experts=8, experts_per_token=2, moe_intermediate=1024)


def src_config() -> dict:
    return json.loads((SOURCE / "config.json").read_text())


def shape(**sizes) -> dict:
    return target_shape(source_shape(src_config()), **sizes)


def float32(model):
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    return model


def greedy(model, ids: list[int], n: int = 40) -> list[int]:
    return [t for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=n), range(n))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The source in float32, a widened dense model, and a widened MoE built by the command line."""
    base = tmp_path_factory.mktemp("widen")
    widen(SOURCE, base / "dense", shape(**SMALL), dtype="float32")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_MOE.items()]
    subprocess.run([sys.executable, str(ROOT / "training" / "widen.py"), str(SOURCE), str(base / "moe"),
                    *flags, "--dtype", "float32"], check=True, capture_output=True)
    source, tokenizer = load(str(SOURCE))
    float32(source)
    expected = [greedy(source, tokenizer.encode(p)) for p in PROMPTS]
    return {"source": source, "expected": expected, "tokenizer": tokenizer, "dir": base,
            "dense": load(str(base / "dense"))[0], "moe": load(str(base / "moe"))[0]}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_widened_model_generates_the_source_models_tokens(models, kind):
    tok, source, wide = models["tokenizer"], models["source"], models[kind]
    assert wide.args.hidden_size == 512 and len(wide.layers) == 8  # really wider and deeper
    first = tok.encode(PROMPTS[0])
    assert greedy(wide, first) == models["expected"][0]  # decoding with its KV cache
    for prompt, expected in zip(PROMPTS, models["expected"]):
        # one pass over prompt + the source's 40 tokens: greedy picks each of them again
        ids = tok.encode(prompt) + expected
        logits = wide(mx.array([ids]))[0]
        assert mx.argmax(logits[-len(expected) - 1:-1], axis=-1).tolist() == expected
        assert mx.allclose(logits, source(mx.array([ids]))[0], atol=2e-3, rtol=1e-4).item()


def router_logits(moe, ids: list[int]) -> list[mx.array]:
    """Each layer's router logits for `ids` (the real routers, wrapped for one forward pass)."""
    seen = []

    class Router(nn.Module):  # the real router, its logits kept
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            seen.append(self.inner(x))
            return seen[-1]

    gates = [layer.mlp.gate for layer in moe.layers]
    try:
        for layer in moe.layers:
            layer.mlp.gate = Router(layer.mlp.gate)
        moe(mx.array([ids]))
    finally:
        for layer, gate in zip(moe.layers, gates):
            layer.mlp.gate = gate
    return seen


def test_the_moe_is_a_real_moe_whose_tokens_spread_over_the_experts(models):
    moe, tok = models["moe"], models["tokenizer"]
    ids = tok.encode(PROMPTS[0] + "    return text.replace(old, new)\n")
    seen = router_logits(moe, ids)
    assert len(seen) == 8
    experts = moe.layers[0].mlp.switch_mlp.gate_proj.weight
    assert experts.shape == (8, 1024, 512) and mx.array_equal(experts[0], experts[7]).item()  # identical experts
    for logits in seen:
        top2 = mx.argpartition(-logits[0], kth=1, axis=-1)[:, :2].tolist()
        chosen = {frozenset(t) for t in top2}
        assert len(chosen) >= len(ids) // 4, f"{len(chosen)} distinct expert pairs over {len(ids)} tokens"
        assert len({e for t in top2 for e in t}) >= 6  # most experts see some token


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_parameter_count_from_the_config_is_the_written_models(models, kind):
    config = json.loads((models["dir"] / kind / "config.json").read_text())
    written = sum(v.size for _, v in tree_flatten(models[kind].parameters()))
    assert param_count(config)["total"] == written


def test_the_named_shapes_have_their_models_parameter_counts():
    src = source_shape(src_config())
    dense = widened_config(src_config(), src, shape(name="qwen3-8b"), "bfloat16", 8)
    moe = widened_config(src_config(), src, shape(name="qwen3-30b-a3b"), "bfloat16", 8)
    # with Qwen's own vocabulary and untied head the formula gives the published figures
    real_vocab = {"vocab_size": 151936, "tie_word_embeddings": False}
    real_8b = param_count(dict(dense, **real_vocab))
    assert (round(real_8b["total"] / 1e9, 2), round(real_8b["non_embedding"] / 1e9, 2)) == (8.19, 6.95)
    real_moe = param_count(dict(moe, **real_vocab, moe_intermediate_size=768))
    assert (round(real_moe["total"] / 1e9, 1), round(real_moe["non_embedding"] / 1e9, 1),
            round(real_moe["active"] / 1e9, 1)) == (30.5, 29.9, 3.4)
    # the yardsticks: the same bodies on the bundled 8192-token vocabulary (the MoE's experts 1024 wide)
    assert round(param_count(dense)["total"] / 1e9, 2) == 6.98
    assert dense["num_key_value_heads"] * dense["head_dim"] == 1024  # Qwen3-8B's KV bytes per token
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (128, 8, 1024)
    assert round(param_count(moe)["total"] / 1e9, 1) == 39.6 and round(param_count(moe)["active"] / 1e9, 2) == 3.35


def test_quantised_as_written_is_what_mlx_lm_quantize_makes(models, tmp_path):
    widen(SOURCE, tmp_path / "q4", shape(**SMALL_MOE), dtype="float32", q_bits=4)
    mine, tok = load(str(tmp_path / "q4"))
    config = json.loads((models["dir"] / "moe" / "config.json").read_text())
    float_model, _ = load(str(models["dir"] / "moe"))
    theirs, their_config = quantize_model(float_model, config, 64, 4)
    mine_config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert mine_config["quantization"] == their_config["quantization"]  # the router at 8 bits, recorded per layer
    ours, reference = dict(tree_flatten(mine.parameters())), dict(tree_flatten(theirs.parameters()))
    assert ours.keys() == reference.keys()
    assert all(mx.array_equal(ours[k], reference[k]).item() for k in ours)
    assert len(greedy(mine, tok.encode(PROMPTS[0]), 8)) == 8


@pytest.mark.parametrize("sizes, complaint", [
    (dict(experts=8, moe_intermediate=768), "can't hold the source's MLP of 1024"),
    (dict(head_dim=96), "not a multiple"),
    (dict(heads=8, kv_heads=4), "KV group of 2"),
    (dict(hidden=256), "below the source's"),
])
def test_shapes_that_cant_hold_the_source_are_refused(sizes, complaint):
    with pytest.raises(ValueError, match=complaint):
        shape(**dict(SMALL, **sizes))


# ---- the qwen3_5 hybrid (training/widen_hybrid.py), from a tiny random source: no trained one is bundled

from tiny_models import FAMILIES, build_family_model, build_tiny_model  # noqa: E402
from widen_hybrid import (hybrid_layer_plan, hybrid_param_count, hybrid_source_shape,  # noqa: E402
                          hybrid_target_shape, layer_kinds, widen_hybrid, widened_hybrid_config)

# the source: hidden 64, 2 layers (Gated DeltaNet, then gated attention), attention 4/2 heads of 16,
# Gated DeltaNet 2 key heads and 4 value heads of 16, MLP 128. Every axis moves, and the layer pattern too.
HYBRID_SMALL = dict(hidden=192, layers=6, full_attention_interval=3, heads=8, kv_heads=4, head_dim=32,
                    intermediate=256, linear_key_heads=4, linear_key_head_dim=32, linear_value_heads=8,
                    linear_value_head_dim=32)
HYBRID_MOE = dict(HYBRID_SMALL, experts=8, experts_per_token=2, moe_intermediate=128, shared_intermediate=64)
HYBRID_TOKENS = 24


def hybrid_shape(src_dir: Path, name: str | None = None, **sizes) -> dict:
    return hybrid_target_shape(hybrid_source_shape(json.loads((src_dir / "config.json").read_text())), name, **sizes)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """A tiny random qwen3_5, a wider dense qwen3_5, and a qwen3_5_moe built by the command line."""
    base = tmp_path_factory.mktemp("widen_hybrid")
    source_dir = build_family_model(base / "source", "qwen3_5", seed=7)
    widen_hybrid(source_dir, base / "dense", hybrid_shape(source_dir, **HYBRID_SMALL), dtype="float32")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in HYBRID_MOE.items()]
    subprocess.run([sys.executable, str(ROOT / "training" / "widen_hybrid.py"), str(source_dir), str(base / "moe"),
                    *flags, "--dtype", "float32"], check=True, capture_output=True)
    source, tokenizer = load(str(source_dir))
    float32(source)
    expected = [greedy(source, tokenizer.encode(p), HYBRID_TOKENS) for p in PROMPTS]
    return {"source": source, "source_dir": source_dir, "expected": expected, "tokenizer": tokenizer, "dir": base,
            "dense": load(str(base / "dense"))[0], "moe": load(str(base / "moe"))[0]}


def assert_same_function(wide, source, tok, expected):
    first = tok.encode(PROMPTS[0])
    assert greedy(wide, first, HYBRID_TOKENS) == expected[0]  # decoding with its caches (conv, recurrent state, KV)
    for prompt, tokens in zip(PROMPTS, expected):
        ids = tok.encode(prompt) + tokens  # one pass: greedy picks each of them again
        logits = wide(mx.array([ids]))[0]
        assert mx.argmax(logits[-len(tokens) - 1:-1], axis=-1).tolist() == tokens
        assert mx.allclose(logits, source(mx.array([ids]))[0], atol=1e-3, rtol=1e-4).item()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_widened_hybrid_generates_the_source_models_tokens(hybrids, kind):
    wide = hybrids[kind]
    args = wide.language_model.args
    assert (args.hidden_size, len(wide.layers), args.linear_num_value_heads) == (192, 6, 8)  # really wider and deeper
    assert [layer.is_linear for layer in wide.layers] == [True, True, False] * 2
    assert_same_function(wide, hybrids["source"], hybrids["tokenizer"], hybrids["expected"])


def test_a_tied_source_with_both_layer_kinds_in_a_new_pattern(tmp_path):
    """6 layers with full attention every 3rd into 10 with every 4th; tied embeddings, as the hybrid reference."""
    extra = dict(FAMILIES["qwen3_5"][1], num_hidden_layers=6, full_attention_interval=3, tie_word_embeddings=True)
    source_dir = build_tiny_model(tmp_path / "source", arch="qwen3_5", seed=3, extra=extra)
    shape = hybrid_shape(source_dir, **dict(HYBRID_MOE, layers=10, full_attention_interval=4))
    assert [i for i, (_, copy) in enumerate(hybrid_layer_plan(hybrid_source_shape(json.loads(
        (source_dir / "config.json").read_text())), shape)) if not copy] == [0, 1, 3, 5, 6, 7]  # in order, own kind
    widen_hybrid(source_dir, tmp_path / "wide", shape, dtype="float32")
    source, tok = load(str(source_dir))
    expected = [greedy(source, tok.encode(p), HYBRID_TOKENS) for p in PROMPTS]
    assert_same_function(load(str(tmp_path / "wide"))[0], source, tok, expected)


def test_the_hybrid_moe_routes_tokens_over_several_experts(hybrids):
    moe, tok = hybrids["moe"], hybrids["tokenizer"]
    ids = tok.encode(PROMPTS[0] + "    return text.replace(old, new)\n")
    seen = router_logits(moe, ids)
    assert len(seen) == 6
    mlp = moe.layers[0].mlp
    assert mlp.switch_mlp.gate_proj.weight.shape == (8, 128, 192)
    assert mx.array_equal(mlp.switch_mlp.up_proj.weight[0], mlp.switch_mlp.up_proj.weight[7]).item()
    for logits in seen:
        top2 = mx.argpartition(-logits[0], kth=1, axis=-1)[:, :2].tolist()
        assert len({frozenset(t) for t in top2}) >= len(ids) // 4
        assert len({e for t in top2 for e in t}) >= 6  # most experts see some token


def test_the_hybrid_flags_make_the_config_mlx_lm_loads(hybrids):
    config = json.loads((hybrids["dir"] / "moe" / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5_moe" and text["model_type"] == "qwen3_5_moe_text"
    assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"],
            text["shared_expert_intermediate_size"]) == (8, 2, 128, 64)
    args = hybrids["moe"].language_model.args
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.linear_num_key_heads,
            args.linear_key_head_dim, args.linear_value_head_dim, args.full_attention_interval) == (8, 4, 32, 4, 32, 32, 3)
    # the source's Gated DeltaNet layer is layer 0, its attention layer 2; the rest pass the residual through
    for i, layer in enumerate(hybrids["moe"].layers):
        mixer = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
        copy = i not in (0, 2)
        assert (mx.abs(mixer.weight).max().item() == 0) == copy
        assert (mx.abs(layer.mlp.switch_mlp.down_proj.weight).max().item() == 0) == copy
        assert mx.abs(layer.mlp.shared_expert.down_proj.weight).max().item() == 0  # the shared expert adds 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_hybrid_parameter_count_from_the_config_is_the_written_models(hybrids, kind):
    config = json.loads((hybrids["dir"] / kind / "config.json").read_text())
    written = sum(v.size for _, v in tree_flatten(hybrids[kind].parameters()))
    assert hybrid_param_count(config)["total"] == written


def test_the_named_hybrid_shape_has_qwen3_6_35b_a3bs_size(hybrids):
    source_config = json.loads((hybrids["source_dir"] / "config.json").read_text())
    src = hybrid_source_shape(source_config)
    shape = hybrid_target_shape(src, "qwen3.6-35b-a3b")
    config = widened_hybrid_config(source_config, src, shape, "bfloat16", 8)
    text = config["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_experts"], text["num_experts_per_tok"],
            text["moe_intermediate_size"], text["shared_expert_intermediate_size"]) == (40, 2048, 256, 8, 512, 512)
    assert layer_kinds(40, text["full_attention_interval"]).count("full_attention") == 10
    real = dict(config, text_config=dict(text, vocab_size=248320, tie_word_embeddings=False))
    counts = hybrid_param_count(real)  # Qwen's own vocabulary: the published 35B total, 3B active
    assert (round(counts["total"] / 1e9), round(counts["active"] / 1e9)) == (35, 3)
    # the hybrid reference (6 layers at 384, MLP 896, full attention every 3rd): experts widened to hold its MLP,
    # its layers in order on layers of their own kind
    reference = dict(src, hidden=384, layers=6, full_attention_interval=3, heads=6, kv_heads=2, head_dim=64,
                     intermediate=896, linear_key_heads=4, linear_key_head_dim=64, linear_value_heads=8,
                     linear_value_head_dim=32)
    wide = hybrid_target_shape(reference, "qwen3.6-35b-a3b")
    assert (wide["moe_intermediate"], wide["experts_widened_from"]) == (896, 512)
    plan = hybrid_layer_plan(reference, wide)
    assert [(i, old) for i, (old, copy) in enumerate(plan) if not copy] == [(0, 0), (6, 1), (11, 2), (20, 3),
                                                                          (26, 4), (31, 5)]


def test_hybrid_quantised_as_written_is_what_mlx_lm_quantize_makes(hybrids, tmp_path):
    widen_hybrid(hybrids["source_dir"], tmp_path / "q8", hybrid_shape(hybrids["source_dir"], **HYBRID_MOE),
                 dtype="float32", q_bits=8)
    mine, tok = load(str(tmp_path / "q8"))
    config = json.loads((hybrids["dir"] / "moe" / "config.json").read_text())
    float_model, _ = load(str(hybrids["dir"] / "moe"))
    theirs, their_config = quantize_model(float_model, config, 64, 8)
    mine_config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert mine_config["quantization"] == their_config["quantization"]  # routers and shared gates at 8, per layer
    ours, reference = dict(tree_flatten(mine.parameters())), dict(tree_flatten(theirs.parameters()))
    assert ours.keys() == reference.keys()
    assert all(mx.array_equal(ours[k], reference[k]).item() for k in ours)
    # it runs (a random tiny model's near-tied logits make 8-bit tokens differ from float ones after a few)
    assert len(greedy(mine, tok.encode(PROMPTS[0]), 8)) == 8


def test_norm_eps_only_nearly_right_would_change_the_hybrids_output(hybrids, tmp_path, monkeypatch):
    """widen.py's way (eps * d/D, no rescaled residual) leaves the gated norm's eps off by (dv'/dv)(dk'/dk)
    times, and q/k norms' by hd'/hd: next to this model's small activations that moves the logits."""
    import widen_hybrid

    monkeypatch.setattr(widen_hybrid, "norm_scales", lambda src, t: {
        "eps": src["hidden"] / t["hidden"], "residual": 1.0, "qk": 1.0})
    widen_hybrid.widen_hybrid(hybrids["source_dir"], tmp_path / "near",
                              hybrid_shape(hybrids["source_dir"], **HYBRID_SMALL), dtype="float32")
    ids = mx.array([hybrids["tokenizer"].encode(PROMPTS[0])])
    near = load(str(tmp_path / "near"))[0](ids)
    assert mx.abs(near - hybrids["source"](ids)).max().item() > 0.05


@pytest.mark.parametrize("sizes, complaint", [
    (dict(linear_key_heads=8, linear_value_heads=8), "group of 1 value heads can't hold the source's 2"),
    (dict(linear_value_head_dim=8), "below the source's"),
    (dict(head_dim=24), "not a multiple"),
    (dict(layers=2, full_attention_interval=1), "don't fit in order"),
    (dict(experts=8, moe_intermediate=64), "can't hold the source's MLP of 128"),
])
def test_hybrid_shapes_that_cant_hold_the_source_are_refused(hybrids, sizes, complaint):
    with pytest.raises(ValueError, match=complaint):
        hybrid_shape(hybrids["source_dir"], **dict(HYBRID_SMALL, **sizes))


REAL_HYBRID = ROOT / "engine" / "reference_model_hybrid"
# the bundled 8-bit hybrid (6 layers at 384, attention 6/2 heads of 64, Gated DeltaNet 4/8 heads of 64/32,
# MLP 896) widened every way at a small size, with experts
REAL_HYBRID_MOE = dict(hidden=512, layers=8, full_attention_interval=4, heads=8, kv_heads=2, head_dim=128,
                       linear_key_heads=4, linear_key_head_dim=128, linear_value_heads=16, linear_value_head_dim=32,
                       experts=4, experts_per_token=2, moe_intermediate=896, shared_intermediate=64)


@pytest.mark.skipif(not (REAL_HYBRID / "model.safetensors").exists(),
                    reason="dspark-ref-hybrid weights not in this checkout")
def test_the_bundled_8_bit_hybrid_widens_to_a_yardstick_computing_it(tmp_path):
    """From its dequantized values: greedy tokens of the widened MoE equal the bundled model's,
    which here runs on the same dequantized values in float32."""
    from mlx_lm.utils import dequantize_model

    widen_hybrid(REAL_HYBRID, tmp_path / "wide", hybrid_shape(REAL_HYBRID, **REAL_HYBRID_MOE), dtype="float32")
    wide = load(str(tmp_path / "wide"))[0]
    assert wide.language_model.args.hidden_size == 512 and len(wide.layers) == 8
    source, tok = load(str(REAL_HYBRID))
    source = float32(dequantize_model(source))
    expected = [greedy(source, tok.encode(p), HYBRID_TOKENS) for p in PROMPTS]
    assert_same_function(wide, source, tok, expected)
