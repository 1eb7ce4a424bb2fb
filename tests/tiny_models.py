"""Tiny random models built from a config, saved as mlx-lm model directories.

Nothing is downloaded: the tokenizer is a small byte-level BPE trained here on a
few lines of code and English, with a ChatML chat template (Hermes-style tool calls).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>"]

TRAINING_TEXT = [
    "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n",
    "class Engine:\n    def __init__(self, model):\n        self.model = model\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The quick brown fox jumps over the lazy dog. Please rewrite this file.\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    '{"name": "read_file", "arguments": {"path": "a.py"}}\n',
] * 20


def build_tokenizer(out: Path, vocab_size: int = 384) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def build_tiny_model(out: Path, arch: str = "qwen3", seed: int = 0, layers: int = 2,
                     hidden: int = 64, context: int = 4096, scale: float = 4.0,
                     extra: dict | None = None) -> Path:
    """A random model directory that mlx_lm.load reads. `scale` sharpens the logits
    (random tiny models are otherwise nearly uniform, which makes greedy decoding a
    coin-toss between near-equal logits). `extra` adds or replaces config fields
    (sliding windows, layer types, recurrent-layer sizes of hybrid families)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
    }
    if arch == "llama":
        config.pop("head_dim")
    config.update(extra or {})
    if config.pop("text_config_from_top", False):  # qwen3_5: the text model's fields nest
        config = {"model_type": arch, "text_config": dict(config), "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=1))

    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    for name in [k for k in params if k.endswith("lm_head.weight")]:
        params[name] = params[name] * scale
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


# Extra config fields per family: the smallest model with one layer of each kind
# (recurrent and attention, sliding and full, MoE) that mlx-lm builds from its own classes.
WINDOW = 16
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 32, "norm_topk_prob": True}
_GDN = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
        "partial_rotary_factor": 0.25}
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_expand": 2,
           "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True}
FAMILIES: dict[str, tuple[str, dict]] = {  # name -> (model_type, extra config)
    "qwen3_next": ("qwen3_next", {**_GDN, **_MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_5": ("qwen3_5", {**_GDN, "text_config_from_top": True}),
    "qwen3_5_moe": ("qwen3_5_moe", {**_GDN, **_MOE, "shared_expert_intermediate_size": 32,
                                    "text_config_from_top": True}),
    "lfm2": ("lfm2", {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
                      "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
                      "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
                      "layer_types": ["conv", "full_attention"]}),
    "nemotron_h": ("nemotron_h", {"attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
                                  "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
                                  "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
                                  "use_bias": False, "use_conv_bias": True,
                                  "hybrid_override_pattern": ["M", "*", "-"]}),
    "granitemoehybrid": ("granitemoehybrid", {**_MAMBA2, "attention_bias": False, "embedding_multiplier": 1.0,
                                              "attention_multiplier": 0.25, "logits_scaling": 1.0,
                                              "residual_multiplier": 1.0, "layer_types": ["mamba", "attention"],
                                              "shared_intermediate_size": 64, "num_local_experts": 0,
                                              "position_embedding_type": "rope"}),
    "falcon_h1": ("falcon_h1", {"head_dim": 16, "mamba_d_head": 16, "mamba_n_heads": 4, "mamba_d_ssm": 64,
                                "mamba_d_state": 16, "mamba_chunk_size": 16, "num_hidden_layers": 1}),
    "lfm2_moe": ("lfm2_moe", {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                              "norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 0,
                              "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
                              "layer_types": ["conv", "full_attention"]}),
    "kimi_linear": ("kimi_linear", {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                    "v_head_dim": 16, "num_key_value_heads": 4, "model_max_length": 4096,
                                    "num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_token": 2,
                                    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2],
                                                           "num_heads": 4, "head_dim": 16,
                                                           "short_conv_kernel_size": 4}}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "sliding_window_pattern": 2,
                               "query_pre_attn_scalar": 16}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3_moe": ("qwen3_moe", dict(_MOE)),
    "glm4_moe": ("glm4_moe", {"moe_intermediate_size": 32, "norm_topk_prob": True, "n_group": 1,
                              "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4,
                              "routed_scaling_factor": 1.0, "num_experts_per_tok": 2,
                              "first_k_dense_replace": 1, "rope_scaling": None, "use_qk_norm": True,
                              "attention_bias": False, "partial_rotary_factor": 0.5}),
    "llama_swa": ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}),
}


def family_installed(family: str) -> bool:
    """Does this mlx-lm have the family's model class?"""
    import importlib

    try:
        importlib.import_module(f"mlx_lm.models.{FAMILIES[family][0]}")
    except ImportError:
        return False
    return True


def build_family_model(out: Path, family: str, seed: int = 0, scale: float = 4.0) -> Path:
    arch, extra = FAMILIES[family]
    return build_tiny_model(out, arch=arch, seed=seed, scale=scale, extra=extra)
