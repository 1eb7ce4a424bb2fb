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
