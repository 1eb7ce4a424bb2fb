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


def test_the_moe_is_a_real_moe_whose_tokens_spread_over_the_experts(models):
    moe, tok = models["moe"], models["tokenizer"]
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
        ids = tok.encode(PROMPTS[0] + "    return text.replace(old, new)\n")
        moe(mx.array([ids]))
    finally:
        for layer, gate in zip(moe.layers, gates):
            layer.mlp.gate = gate
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
