"""Drafter checkpoints in the published layouts: they load; a wrong tensor name, shape or
pairing is refused with an error naming it; the registry and modes resolve."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine import Engine, ModelLoadError
from engine.drafting.heads import DrafterLoadError, load_head
from engine.drafting.heads.export import dflash_config, dspark_config, random_head_checkpoint, save_checkpoint
from engine.drafting.heads.registry import base_name
from engine.drafting.modes import auto_candidates


@pytest.fixture(scope="module")
def tc(tiny_model_dir):
    return json.loads((tiny_model_dir / "config.json").read_text())


def _weights(path):
    return dict(mx.load(str(path / "model.safetensors")))


def test_zlab_dflash_layout_loads(target, tc, tmp_path):
    cfg = dflash_config(tc, mask_token_id=3, target_layer_ids=[0, 1], block_size=16, layers=2)
    path = random_head_checkpoint(tmp_path / "d", cfg)
    names = set(_weights(path))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    head = load_head(path, target)
    assert head.kind == "dflash" and head.cfg.block_size == 16 and head.max_draft == 15
    assert head.cfg.mask_token_id == 3 and head.cfg.target_layer_ids == (0, 1)
    assert head.fc.weight.dtype == mx.float32  # cast to the target's compute dtype


def test_deepspec_dspark_layout_loads_with_or_without_shared_tensors(target, tc, tmp_path):
    cfg = dspark_config(tc, mask_token_id=0, target_layer_ids=[-1, 0, 1], markov_rank=8)
    path = random_head_checkpoint(tmp_path / "s", cfg)
    names = set(_weights(path))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= names
    head = load_head(path, target)
    assert head.kind == "dspark" and "lm_head" not in head and head.cfg.enable_confidence_head
    # DeepSpec saves frozen copies of the target's embedding and LM head: those load too
    w = _weights(path)
    w["embed_tokens.weight"] = target.model.model.embed_tokens.weight
    w["lm_head.weight"] = target.model.lm_head.weight
    w["rotary_emb.inv_freq"] = mx.zeros((4,))  # a non-persistent buffer some exports keep
    full = save_checkpoint(tmp_path / "s_full", cfg, w)
    head = load_head(full, target)
    assert "lm_head" in head and "embed_tokens" in head


@pytest.mark.parametrize("mutate,match", [
    (lambda w: w.pop("layers.0.self_attn.k_norm.weight"), r"missing tensor 'layers.0.self_attn.k_norm.weight'"),
    (lambda w: w.update({"layers.0.mlp.up_proj.weight": mx.zeros((3, 3))}),
     r"tensor 'layers.0.mlp.up_proj.weight' has shape \(3, 3\), expected"),
    (lambda w: w.update({"layers.0.self_attn.qproj.weight": w.pop("layers.0.self_attn.q_proj.weight")}),
     r"missing tensor 'layers.0.self_attn.q_proj.weight'"),
    (lambda w: w.update({"model.fc.weight": w["fc.weight"]}), r"unexpected tensor 'model.fc.weight'"),
])
def test_wrong_tensor_is_named(target, tc, tmp_path, mutate, match):
    cfg = dflash_config(tc, mask_token_id=0, target_layer_ids=[0, 1])
    w = _weights(random_head_checkpoint(tmp_path / "ok", cfg))
    mutate(w)
    bad = save_checkpoint(tmp_path / "bad", cfg, w)
    with pytest.raises(DrafterLoadError, match=match):
        load_head(bad, target)


def test_pairing_errors_are_clear(target, tc, tmp_path, tiny_llama_dir):
    wide = dict(tc, hidden_size=96, num_attention_heads=4, head_dim=24)
    path = random_head_checkpoint(tmp_path / "wide", dflash_config(wide, mask_token_id=0, target_layer_ids=[0]))
    with pytest.raises(DrafterLoadError, match="hidden size: the head's is 96, the model's 64"):
        load_head(path, target)
    deep = dflash_config(tc, mask_token_id=0, target_layer_ids=[0, 5])
    deep["num_target_layers"] = None
    with pytest.raises(DrafterLoadError, match=r"layer taps: the head reads layers \[0, 5\], this model has 2"):
        load_head(random_head_checkpoint(tmp_path / "deep", deep), target)
    other = dflash_config(dict(tc, num_hidden_layers=36), mask_token_id=0, target_layer_ids=[0, 1])
    with pytest.raises(DrafterLoadError, match="trained on a 36-layer model, this one has 2"):
        load_head(random_head_checkpoint(tmp_path / "other", other), target)
    vocab = dflash_config(dict(tc, vocab_size=tc["vocab_size"] + 1), mask_token_id=0, target_layer_ids=[0])
    with pytest.raises(DrafterLoadError, match="vocabulary"):
        load_head(random_head_checkpoint(tmp_path / "vocab", vocab), target)
    masked = dflash_config(tc, mask_token_id=10**6, target_layer_ids=[0])
    with pytest.raises(DrafterLoadError, match="mask_token_id"):
        load_head(random_head_checkpoint(tmp_path / "mask", masked), target)


def test_zlab_dflash2_layout_loads(target, tc, tmp_path):
    cfg = dflash_config(tc, mask_token_id=0, target_layer_ids=[0, 1], version=2, conv_kernel_size=2,
                        conv_group_size=16, selector_rank=8, selector_top_k=4)
    path = random_head_checkpoint(tmp_path / "v2", cfg)
    names = set(_weights(path))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= names  # z-lab's names, codebooks bare
    head = load_head(path, target)
    assert type(head).__name__ == "DFlash2Head" and head.candidate_selector.top_k == 4
    broken = dict(cfg, dflash_config=dict(cfg["dflash_config"], conv_group_size=0))
    (tmp_path / "v2b").mkdir()
    (tmp_path / "v2b" / "config.json").write_text(json.dumps(broken))
    with pytest.raises(DrafterLoadError, match="DFlash 2 config needs"):
        load_head(tmp_path / "v2b")


def test_unsupported_architectures_are_refused(tc, tmp_path):
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(DrafterLoadError, match="unknown drafter architecture 'LlamaForCausalLMEagle3'"):
        load_head(tmp_path / "eagle")
    with pytest.raises(DrafterLoadError, match="drafter not found"):
        load_head(tmp_path / "nowhere")


def test_modes_registry_and_engine_option(tiny_model_dir, tc, tmp_path):
    assert base_name("mlx-community/Qwen3-4B-4bit") == "qwen3-4b"
    assert base_name("/models/Qwen3-8B-MLX-bf16/") == "qwen3-8b"
    assert base_name("Qwen/Qwen3-14B") == "qwen3-14b"
    path = random_head_checkpoint(tmp_path / "h", dspark_config(tc, mask_token_id=0, target_layer_ids=[1]))
    with Engine(str(tiny_model_dir), drafter=str(path)) as engine:
        assert engine.call(auto_candidates) == ["lookup", "dspark"]  # auto weighs the given head
        with pytest.raises(Exception, match="not dflash|no dflash drafter"):
            engine.call(lambda t: __import__("engine.drafting.heads", fromlist=["head_for"]).head_for(t, "dflash"))
    with Engine(str(tiny_model_dir)) as engine:  # nothing registered for this model: auto is lookup
        assert engine.call(auto_candidates) == ["lookup"]
        with pytest.raises(Exception, match="no dspark drafter is registered"):
            list(engine.generate(__import__("engine").GenerationRequest([5, 6, 7], max_tokens=2, mode="dspark")))
    bad = dflash_config(tc, mask_token_id=0, target_layer_ids=[0, 9])
    bad["num_target_layers"] = None
    with pytest.raises(ModelLoadError, match=r"layer taps: the head reads layers \[0, 9\]"):
        Engine(str(tiny_model_dir), drafter=str(random_head_checkpoint(tmp_path / "bad", bad)))


def test_cli_generate_with_a_drafter(tiny_model_dir, tc, tmp_path):
    path = random_head_checkpoint(tmp_path / "h", dflash_config(tc, mask_token_id=0, target_layer_ids=[0, 1]))
    cmd = [sys.executable, "-m", "agent_bridge.cli", "generate", "--model", str(tiny_model_dir), "--drafter",
           str(path), "--mode", "dflash", "--max-tokens", "12", "--json", "--no-chat-template", "--prompt", "def f(x):"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["mode"] == "dflash" and report["generated_tokens"] > 0
    cmd[cmd.index(str(path))] = str(tmp_path / "missing")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "drafter not found" in out.stderr and "Traceback" not in out.stderr
