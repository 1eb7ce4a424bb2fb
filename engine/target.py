"""The target model: the one whose output we must reproduce exactly.

Wraps an mlx-lm model and tokenizer: loading (local directory or hub id),
the compute dtype, forward passes of k tokens against a KV cache, and
rolling back a rejected tail of that cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from .errors import ModelLoadError

DEFAULT_CONTEXT_WINDOW = 32768


def compute_dtype_for_device() -> mx.Dtype | None:
    """float32 on CPU (bf16/fp16 matmuls don't use BLAS there); None keeps the checkpoint's."""
    return mx.float32 if mx.default_device().type == mx.cpu else None


@dataclass
class Target:
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    path: str
    config: dict = field(default_factory=dict)
    dtype: str = "float32"

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.model.model.embed_tokens.weight.shape[0])

    @property
    def context_window(self) -> int:
        return int(self.config.get("max_position_embeddings") or DEFAULT_CONTEXT_WINDOW)

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids or [])

    @property
    def identity(self) -> str:
        """A short fingerprint of weights' location, config and dtype (cache keys use it)."""
        blob = json.dumps({"path": self.path, "config": self.config, "dtype": self.dtype}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def forward(self, tokens: list[int] | mx.array, cache: list) -> mx.array:
        """Logits for each of `tokens` appended to the cache: shape (len(tokens), vocab)."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        return self.model(x[None], cache=cache)[0]

    @staticmethod
    def can_rollback(cache: list) -> bool:
        return can_trim_prompt_cache(cache)

    @staticmethod
    def rollback(cache: list, n: int) -> None:
        """Drop the last n tokens from the cache (caller checked can_rollback)."""
        if n > 0:
            trimmed = trim_prompt_cache(cache, n)
            if trimmed != n:
                raise RuntimeError(f"cache rollback trimmed {trimmed} of {n} tokens")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_target(path_or_id: str | Path, dtype: str | None = None) -> Target:
    """Load an mlx-lm model directory (offline) or hub id, in the device's compute dtype."""
    path = str(path_or_id)
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelLoadError(f"{local} is not a model directory (no config.json)")
        path = str(local.resolve())
    elif path.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory not found: {path}")
    try:
        model, tokenizer, config = mlx_lm_load(path, return_config=True)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        raise ModelLoadError(f"could not load model {path!r}: {e}") from e
    want = getattr(mx, dtype) if dtype else compute_dtype_for_device()
    if want is not None:
        model.set_dtype(want)
    mx.eval(model.parameters())
    actual = str(want or _weights_dtype(model)).replace("mlx.core.", "")
    return Target(model=model, tokenizer=tokenizer, path=path, config=dict(config), dtype=actual)


def _weights_dtype(model: nn.Module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        return p.dtype
    return mx.float32
