"""A tiny random Gemma 3 vision-language model built from mlx-vlm's own classes.

Nothing is downloaded: a byte-level BPE tokenizer trained here with Gemma 3's special
tokens and a chat template in the shape of Gemma 3's (image parts render as
<start_of_image>), a Gemma 3 image processor config (56x56 images, 4 tokens each),
and random weights saved under mlx-vlm's parameter names, so that mlx_vlm.load and
mlx_lm.load (the text model, vision weights dropped) both read the directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
           "<start_of_image>", "<end_of_image>", "<image_soft_token>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message.role == 'assistant' else message.role %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message.content is string %}{{ message.content | trim }}"
    "{% else %}{% for item in message.content %}"
    "{% if item.type == 'image' %}<start_of_image>"
    "{% elif item.type == 'text' %}{{ item.text | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

TEXT = [
    "Describe this picture. It shows a red square on a white background.\n",
    "def area(w, h):\n    return w * h\n",
    "The quick brown fox jumps over the lazy dog. What is in the image?\n",
] * 20

IMAGE_TOKENS = 4  # per image: a 56x56 image, 14-pixel patches (4x4), pooled 2x2


def train_bpe(out: Path, special: list[str], text: list[str], vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on `text`, `special` tokens first (ids 0..), saved as
    out/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def build_tokenizer(out: Path, vocab_size: int = 320) -> tuple[int, dict]:
    tok = train_bpe(out, SPECIAL, TEXT, vocab_size)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                 "eoi_token": "<end_of_image>"},
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "processor_class": "Gemma3Processor",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(), {s: SPECIAL.index(s) for s in SPECIAL}


def build_tiny_gemma3_vlm(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2,
                          sliding_window_pattern: int = 2, scale: float = 4.0) -> Path:
    """A random Gemma 3 VLM directory (mlx-vlm's layout). `scale` sharpens the logits, so
    greedy decoding isn't a coin-toss between near-equal ones."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = build_tokenizer(out)
    text = {
        "model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": hidden // 2, "query_pre_attn_scalar": hidden // 2, "vocab_size": vocab,
        "sliding_window": 512, "sliding_window_pattern": sliding_window_pattern,
        "mm_tokens_per_image": IMAGE_TOKENS, "max_position_embeddings": 4096,
        "rope_global_base_freq": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    }
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 14, "image_size": 56}
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": vision, "vocab_size": vocab, "hidden_size": hidden,
        "image_token_index": ids["<image_soft_token>"], "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "mm_tokens_per_image": IMAGE_TOKENS,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": 56, "width": 56}, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    }, indent=1))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": IMAGE_TOKENS}, indent=1))

    from mlx_vlm.models import gemma3

    mx.random.seed(seed)
    model = gemma3.Model(gemma3.ModelConfig.from_dict(
        {**config, "text_config": gemma3.TextConfig.from_dict(text),
         "vision_config": gemma3.VisionConfig.from_dict(vision)}))
    params = dict(tree_flatten(model.parameters()))
    # Gemma 3 ties its output head to the embeddings (mlx-vlm always does): no lm_head saved
    del params["language_model.lm_head.weight"]
    # and the final norm (Gemma's scales by 1 + weight) sharpens the logits instead
    norm = "language_model.model.norm.weight"
    params[norm] = mx.full(params[norm].shape, scale - 1.0)
    # the projector's weight starts as ones (mlx-vlm's init): random, so images matter
    name = "multi_modal_projector.mm_input_projection_weight"
    params[name] = mx.random.normal(params[name].shape) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


def tiny_image(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (40, 30)):
    """A small PIL image: one colour with a square of another, so two colours differ everywhere."""
    from PIL import Image

    img = Image.new("RGB", size, color)
    img.paste(tuple(255 - c for c in color), (5, 5, 20, 20))
    return img


# -- Gemma 4: an image's tokens attend to each other both ways (use_bidirectional_attention) ----

GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]

GEMMA4_TEMPLATE = CHAT_TEMPLATE.replace("<start_of_image>", "<|image|>")


def build_tiny_gemma4_vlm(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, scale: float = 4.0,
                          per_layer_input: int = 8, kv_shared_layers: int = 0, sliding_window: int = 512) -> Path:
    """A random Gemma 4 VLM directory (mlx-vlm's layout): bidirectional attention over each
    image's tokens, per-layer inputs, alternating sliding and full attention layers. Images are
    resized to fit 16 soft tokens (8-pixel patches pooled 2x2): a 40x30 image gets 12.
    `kv_shared_layers`: the last layers reuse earlier layers' keys and values (as E2B/E4B do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=320, special_tokens=GEMMA4_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    ids = {s: GEMMA4_SPECIAL.index(s) for s in GEMMA4_SPECIAL}
    vocab = tok.get_vocab_size()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
                                 "video_token": "<|video|>"},
        "chat_template": GEMMA4_TEMPLATE, "model_max_length": 4096, "processor_class": "Gemma4Processor",
    }, indent=1))
    text = {
        "model_type": "gemma4_text", "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": hidden // 2, "global_head_dim": hidden // 2, "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": per_layer_input,
        "num_kv_shared_layers": kv_shared_layers, "sliding_window": sliding_window, "sliding_window_pattern": 2,
        "layer_types": (["sliding_attention", "full_attention"] * layers)[:layers],
        "use_bidirectional_attention": "vision", "use_double_wide_mlp": False,
        "max_position_embeddings": 4096, "final_logit_softcapping": 30.0,
        "rope_parameters": {  # Gemma 4's own (mlx-lm's and mlx-vlm's defaults differ)
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0, "rope_type": "default"}},
    }
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
              "patch_size": 8, "pooling_kernel_size": 2, "position_embedding_size": 64,
              "default_output_length": 16}
    config = {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text, "vision_config": vision, "audio_config": None, "vocab_size": vocab,
        "hidden_size": hidden, "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"], "audio_token_id": ids["<|audio|>"], "boa_token_id": ids["<|audio>"],
        "eoa_token_id": ids["<audio|>"], "video_token_id": ids["<|video|>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "vision_soft_tokens_per_image": 16,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor",
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 8,
                            "max_soft_tokens": 16, "pooling_kernel_size": 2},
    }, indent=1))

    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import update_module_configs

    loaded = json.loads(json.dumps(config))  # the config as mlx_vlm.load reads it
    model_config = update_module_configs(gemma4.ModelConfig.from_dict(loaded), gemma4, loaded, ["text", "vision"])
    mx.random.seed(seed)
    model = gemma4.Model(model_config)
    params = {k: v for k, v in tree_flatten(model.parameters()) if "rotary" not in k}
    for name in params:  # sharper logits; the layers' outputs outweigh the embedding they add to
        if name == "language_model.model.norm.weight" or name.endswith(("post_attention_layernorm.weight",
                                                                        "post_feedforward_layernorm.weight")):
            params[name] = params[name] * scale
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out
