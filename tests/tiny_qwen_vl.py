"""A tiny random Qwen3-VL, Qwen2.5-VL or Qwen2-VL built from mlx-vlm's own classes (M-RoPE
positions; Qwen3-VL's deepstack, Qwen2.5-VL's windowed vision attention).

Nothing is downloaded: a byte-level BPE tokenizer trained here with Qwen's special tokens and
a chat template in the shape of Qwen's (an image part renders as
<|vision_start|><|image_pad|><|vision_end|>), the image processor's config (images resized to
64x64, 8-pixel patches merged 2x2: 16 tokens on a 4x4 grid each, so the text after an image
sits 12 positions before its index), and random weights under mlx-vlm's parameter names, so
that mlx_vlm.load and mlx_lm.load (the text model, vision weights dropped) both read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny_vlm import train_bpe

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for item in message.content %}"
    "{% if item.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item.type == 'text' %}{{ item.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT = [
    "Describe this picture. It shows a red square on a white background.\n",
    "def area(w, h):\n    return w * h\n",
    "The quick brown fox jumps over the lazy dog. What is in the image?\n",
] * 20

SIDE, PATCH, MERGE = 64, 8, 2
IMAGE_TOKENS = (SIDE // PATCH // MERGE) ** 2  # 16 per image


def build_tokenizer(out: Path, vocab_size: int = 320) -> tuple[int, dict]:
    tok = train_bpe(out, SPECIAL, TEXT, vocab_size)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=1))
    return tok.get_vocab_size(), {s: SPECIAL.index(s) for s in SPECIAL}


def build_tiny_qwen3_vl(out: Path, seed: int = 0, **kw) -> Path:
    return build_tiny_qwen_vl(out, "qwen3_vl", seed, **kw)


def build_tiny_qwen2_5_vl(out: Path, seed: int = 0, **kw) -> Path:
    return build_tiny_qwen_vl(out, "qwen2_5_vl", seed, **kw)


def build_tiny_qwen2_vl(out: Path, seed: int = 0, **kw) -> Path:
    return build_tiny_qwen_vl(out, "qwen2_vl", seed, **kw)


def build_tiny_qwen_vl(out: Path, kind: str, seed: int = 0, hidden: int = 64, layers: int = 2,
                       scale: float = 4.0, bits: int | None = None) -> Path:
    """A random Qwen-VL directory of model type `kind` (mlx-vlm's layout). `scale` sharpens the
    logits, so greedy decoding isn't a coin-toss between near-equal ones. `bits`: the text
    model's linears and embeddings quantised, as in mlx-community's checkpoints."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = build_tokenizer(out)
    head_dim = hidden // 2
    text = {
        "model_type": f"{kind}_text", "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        # interleaved M-RoPE over (temporal, height, width): 16 frequency pairs
        "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
    }
    vision = {"model_type": kind, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
              "out_hidden_size": hidden, "num_heads": 2, "patch_size": PATCH, "spatial_merge_size": MERGE,
              "temporal_patch_size": 2, "in_channels": 3}
    if kind == "qwen3_vl":
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    elif kind == "qwen2_5_vl":  # windowed attention in the vision blocks but the last
        vision |= {"window_size": 2 * PATCH * MERGE, "fullatt_block_indexes": [1]}
    else:  # Qwen2-VL names its vision width embed_dim (hidden_size is the text model's)
        vision |= {"embed_dim": 32, "hidden_size": hidden, "mlp_ratio": 2}
    ids_config = {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
    }
    architecture = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                    "qwen2_vl": "Qwen2VLForConditionalGeneration"}
    if kind == "qwen3_vl":
        config = {"model_type": kind, "architectures": [architecture[kind]], "text_config": text,
                  "vision_config": vision, "vocab_size": vocab, "tie_word_embeddings": False, **ids_config}
    else:  # Qwen2/2.5-VL checkpoints keep the text model's settings at the top level
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [6, 5, 5]}
        config = {**text, "model_type": kind, "architectures": [architecture[kind]], "vision_config": vision,
                  **ids_config}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    processor = {"qwen3_vl": "Qwen3VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}[kind]
    pixels = SIDE * SIDE  # min = max: every image is resized to SIDE x SIDE
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
        "min_pixels": pixels, "max_pixels": pixels, "size": {"shortest_edge": pixels, "longest_edge": pixels},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }, indent=1))
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
        "size": {"shortest_edge": pixels, "longest_edge": pixels}}, indent=1))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor}, indent=1))

    import importlib

    from mlx_vlm.utils import update_module_configs

    family = importlib.import_module(f"mlx_vlm.models.{kind}")
    loaded = {"text_config": {}, **json.loads(json.dumps(config))}  # the config as mlx_vlm.load reads it
    model_config = update_module_configs(family.ModelConfig.from_dict(loaded), family, loaded, ["text", "vision"])
    mx.random.seed(seed)
    model = family.Model(model_config)
    norm = model.language_model.model.norm
    norm.weight = mx.full(norm.weight.shape, scale)
    for layer in model.language_model.model.layers:  # the layers' outputs outweigh the embedding they add to
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 4
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 4
    if bits:
        import mlx.nn as nn

        nn.quantize(model.language_model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
        (out / "config.json").write_text(json.dumps(config, indent=1))
    params = {k: v for k, v in tree_flatten(model.parameters()) if "rotary" not in k}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out
