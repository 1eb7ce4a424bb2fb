"""The target model: the one whose output we must reproduce exactly.

Wraps an mlx-lm model and tokenizer: loading (local directory or hub id),
the compute dtype, forward passes of k tokens against a KV cache, and
rolling back a rejected tail of that cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from engine.base.errors import ModelLoadError
from engine.base.platform import physical_memory_bytes
from engine.base.ranks import Ranks, world
from engine.caches.rollback import supports_drafts
from engine.kernels import cpu_swiglu, gated_delta_chunked, gpu_attention, quantized_route
from engine.kernels.attention_crossover import install_for
from engine.model.config import dtype_name
from engine.model.split import check_parts_agree, split_model
from engine.model.vision import ImageFeatures, position_view

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
    drafter: str | None = None  # a drafter checkpoint chosen by the user (--drafter), else the registry's
    drafter_bits: int | None = None  # quantise drafter heads at load (4: 4-bit)
    heads: dict = field(default_factory=dict, repr=False)  # loaded drafter heads, by mode (engine/heads)
    # how recurrent layers take back a draft, "capture" or "replay"; None: the cost curve's pick
    state_rollback: str | None = None
    split: str | None = None  # "pipeline" or "tensor" over `ranks` (engine/model/split.py); None: whole here
    ranks: Ranks = field(default_factory=Ranks, repr=False)

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
    def dtype_name(self) -> str:
        """The dtype as the user knows it ("float32", "8-bit (group 64), float32")."""
        return dtype_name(self.config, self.dtype)

    @property
    def identity(self) -> str:
        """A short fingerprint of weights' location, config and dtype (cache keys use it); of a
        split model, this rank's part (its KV and its costs are its own)."""
        part = {"split": self.split, "rank": self.ranks.rank, "ranks": self.ranks.size} if self.split else {}
        blob = json.dumps({"path": self.path, "config": self.config, "dtype": self.dtype, **part}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def forward(self, tokens: list[int] | mx.array, cache: list, embeddings: ImageFeatures | None = None) -> mx.array:
        """Logits for each of `tokens` appended to the cache: shape (len(tokens), vocab).
        `embeddings`: a VLM prompt's image-merged inputs for these tokens (engine/model/vision.py), fed
        instead of the tokens' own. A cache after an M-RoPE image continues at shifted positions."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        with quantized_route.engine_forward():
            if embeddings is not None:
                return embeddings.forward(x, cache)
            return self.model(x[None], cache=position_view(cache))[0]

    def forward_batch(self, tokens: mx.array, caches: list) -> mx.array:
        """Logits (batch, k, vocab) for rows of `tokens` (batch, k), each on its own cache
        (engine/caches/batch_cache.py's per-layer views)."""
        with quantized_route.engine_forward():
            return self.model(tokens, cache=caches)

    # -- hidden-state taps (drafter heads read the residual stream) ---------------

    @property
    def family(self) -> str:
        """The mlx-lm model module's name (qwen3, llama, gemma2, ...): what forward_tapped keys on."""
        return type(self.model).__module__.rsplit(".", 1)[-1]

    @property
    def num_layers(self) -> int:
        return int(self.config.get("num_hidden_layers") or len(self.model.model.layers))

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size") or self.model.model.embed_tokens.weight.shape[-1])

    @property
    def tappable(self) -> bool:
        """Does forward_tapped (and a batched forward's per-row positions) know this family?
        Not over a pipeline: no rank walks every layer."""
        return self.family in TAPPABLE_FAMILIES and self.split != "pipeline"

    def check_tappable(self, layers: tuple[int, ...] = ()) -> None:
        """Raise ValueError unless forward_tapped supports this model and these layer ids."""
        if self.split == "pipeline":
            raise ValueError("hidden-state taps (drafter heads) don't run over a pipeline split yet: use lookup, "
                             "or split by tensor")
        if self.family not in TAPPABLE_FAMILIES:
            raise ValueError(
                f"hidden-state taps are not supported for model type {self.family!r} "
                f"(supported: {', '.join(sorted(TAPPABLE_FAMILIES))})"
            )
        bad = [i for i in layers if not -1 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"tapped layers {bad} do not exist in this {self.num_layers}-layer model")

    def embed(self, tokens: mx.array) -> mx.array:
        """The raw token embeddings (no model-specific scaling): drafter heads reuse them."""
        return self.model.model.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        """The output head on already-normalised states (tied or not, softcapped where the model is)."""
        # qwen3_5 wraps its text model (and its head) in `language_model`
        text = self.model.language_model if "language_model" in self.model else self.model
        if "lm_head" in text:
            out = text.lm_head(h)
        else:
            out = self.model.model.embed_tokens.as_linear(h)
        cap = getattr(self.model, "final_logit_softcapping", None)
        return mx.tanh(out / cap) * cap if cap else out

    def forward_tapped(
        self, tokens: list[int] | mx.array, cache: list, layers: tuple[int, ...]
    ) -> tuple[mx.array, mx.array]:
        """Logits (k, vocab) and the residual stream after each of `layers`, concatenated
        on the last axis (k, len(layers) * hidden), from the one forward that fills the cache.
        Layer id -1 is the embedding output. Same maths as the mlx-lm model's own __call__,
        re-walked here layer by layer so no second pass is needed."""
        self.check_tappable(layers)
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        with quantized_route.engine_forward():
            return self._forward_tapped(x, cache, layers)

    def _forward_tapped(self, x: mx.array, cache: list, layers: tuple[int, ...]) -> tuple[mx.array, mx.array]:
        batched = x.ndim == 2  # (batch, k) tokens: batched verify (engine/decoding/batch_verify.py)
        inner = self.model.model
        h = inner.embed_tokens(x if batched else x[None])
        scale = _EMBED_SCALE[self.family](self.hidden_size)
        if scale is not None:
            h = h * scale.astype(h.dtype) if isinstance(scale, mx.array) else h * scale
        masks = _LAYER_MASKS[self.family](inner, h, cache)
        want = {int(i): n for n, i in enumerate(layers)}
        taps: list = [None] * len(layers)
        if -1 in want:
            taps[want[-1]] = h
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            h = layer(h, masks[i], c)
            if i in want:
                taps[want[i]] = h
        logits = self.lm_head(inner.norm(h))
        hidden = mx.concatenate(taps, axis=-1)
        return (logits, hidden) if batched else (logits[0], hidden[0])

    @staticmethod
    def can_rollback(cache: list) -> bool:
        """Can a rejected draft be taken back (engine/caches/rollback.py)? Every mlx-lm
        attention, sliding-window and recurrent cache can; exotic kinds can't."""
        return supports_drafts(cache)

    @staticmethod
    def rollback(cache: list, n: int) -> None:
        """Drop the last n tokens from an attention-only cache (mlx-lm's trim); the
        verify loop uses engine/caches/rollback.py, which serves every cache type."""
        if n > 0:
            trimmed = trim_prompt_cache(cache, n)
            if trimmed != n:
                raise RuntimeError(f"cache rollback trimmed {trimmed} of {n} tokens")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _same_mask(return_array: bool = False):
    def masks(inner, h, cache):
        return [create_attention_mask(h, cache[0], return_array=return_array)] * len(inner.layers)

    return masks


def _llama_masks(inner, h, cache):
    full = create_attention_mask(h, cache[inner.fa_idx])
    swa = None
    if inner.swa_idx is not None:
        swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [swa if layer.use_sliding else full for layer in inner.layers]


def _gemma3_masks(inner, h, cache):
    pattern = inner.sliding_window_pattern
    full = create_attention_mask(h, cache[pattern - 1])
    local = create_attention_mask(h, cache[0], window_size=inner.window_size) if pattern > 1 else None
    return [full if i % pattern == pattern - 1 else local for i in range(len(inner.layers))]


def _gpt_oss_masks(inner, h, cache):
    full = create_attention_mask(h, cache[inner.ga_idx])
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if kind == "full_attention" else swa for kind in inner.layer_types]


def _hybrid_masks(inner, h, cache):
    """Gated DeltaNet hybrids: one mask for the attention layers, one for the linear ones."""
    fa = create_attention_mask(h, cache[inner.fa_idx])
    ssm = create_ssm_mask(h, cache[inner.ssm_idx])
    return [ssm if layer.is_linear else fa for layer in inner.layers]


# Per family: how mlx-lm's model builds its masks and scales its embeddings (mistral loads as llama).
_LAYER_MASKS = {
    "llama": _llama_masks,
    "qwen2": _same_mask(),
    "qwen3": _same_mask(),
    "qwen3_moe": _same_mask(),
    "gemma": _same_mask(),
    "gemma2": _same_mask(return_array=True),
    "gemma3_text": _gemma3_masks,
    "gpt_oss": _gpt_oss_masks,
    "qwen3_next": _hybrid_masks,
    "qwen3_5": _hybrid_masks,
    "qwen3_5_moe": _hybrid_masks,
}
_EMBED_SCALE = {
    "llama": lambda d: None,
    "qwen2": lambda d: None,
    "qwen3": lambda d: None,
    "qwen3_moe": lambda d: None,
    "gemma": lambda d: d**0.5,
    "gemma2": lambda d: d**0.5,
    "gemma3_text": lambda d: mx.array(d**0.5, mx.bfloat16),
    "gpt_oss": lambda d: None,
    "qwen3_next": lambda d: None,
    "qwen3_5": lambda d: None,
    "qwen3_5_moe": lambda d: None,
}
TAPPABLE_FAMILIES = frozenset(_LAYER_MASKS)


def load_target(path_or_id: str | Path, dtype: str | None = None, dequantize: bool | None = None,
                split: str | None = None, ranks: Ranks | None = None) -> Target:
    """Load an mlx-lm model directory (offline) or hub id, in the device's compute dtype.

    `dequantize`: run a quantised model on its dequantized weights (None: `dequantize_here`).
    Under a launcher (`ranks`: this process's group), this rank's part of it, split by
    `split` ("pipeline" or "tensor"; None: mlx-lm's pick), engine/model/split.py."""
    ranks = ranks or world()
    path = str(path_or_id)
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelLoadError(f"{local} is not a model directory (no config.json)")
        path = str(local.resolve())
    elif path.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory not found: {path}")
    try:
        model, tokenizer, config = mlx_lm_load(path, return_config=True, lazy=ranks.split)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        raise ModelLoadError(f"could not load model {path!r}: {e}") from e
    config = dict(config)
    split = split_model(model, config, split, ranks)  # before the weights are read: each rank reads its part
    if dequantize_here(model, config, dequantize):
        # MLX's CPU quantized matmul is far slower than BLAS (14.8 ms against 6.4 ms for one
        # token through a 4096x4096 weight, 26x at 16 tokens): a small model runs on its
        # dequantized weights (the same values), so verify passes cost what float ones do
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        config["dequantized_from"] = config.pop("quantization", None)
        config.pop("quantization_config", None)
    want = getattr(mx, dtype) if dtype else compute_dtype_for_device()
    if want is not None:
        model.set_dtype(want)
    mx.eval(model.parameters())
    actual = str(want or _weights_dtype(model)).replace("mlx.core.", "")
    target = Target(model=model, tokenizer=tokenizer, path=path, config=config, dtype=actual, split=split, ranks=ranks)
    if split:
        check_parts_agree(target)
    if install_for(target) is not None:  # long prefill chunks on CPU: blockwise attention (engine/kernels/cpu_attention.py)
        cpu_swiglu.install_for(target)  # and the MLP's activation in a compiled kernel (engine/kernels/cpu_swiglu.py)
    gated_delta_chunked.install()  # many positions of Gated DeltaNet at once (no Metal kernel)
    gpu_attention.install()  # MLX CUDA: verify forwards' attention without a cuDNN graph per shape
    quantized_route.install()  # MLX CUDA: quantised layers by width (dequantized wide, MLX or narrow_qmm narrow)
    quantized_route.build_for(model)  # narrow_qmm's kernels compiled now (seconds), not in the first requests
    return target


# Dequantized float32 weights may take up to this share of the machine's memory.
DEQUANTIZE_MEMORY_SHARE = 1 / 8


def dequantize_here(model: nn.Module, config: dict, wanted: bool | None = None) -> bool:
    """Should this quantised model run on dequantized weights? `wanted` decides when given;
    else MLX_DSPARK_DEQUANTIZE (0/1); else yes on a CPU when the float32 weights fit in
    DEQUANTIZE_MEMORY_SHARE of memory (on a GPU the quantized kernels are the fast path)."""
    quant = config.get("quantization")
    if not quant:
        return False
    if wanted is not None:
        return wanted
    env = os.environ.get("MLX_DSPARK_DEQUANTIZE")
    if env in ("0", "1"):
        return env == "1"
    if mx.default_device() != mx.cpu:
        return False
    from mlx.utils import tree_flatten

    bits = int(quant.get("bits", 4))
    packed = sum(v.size for k, v in tree_flatten(model.parameters()) if k.endswith("weight") and v.dtype == mx.uint32)
    plain = sum(v.size for k, v in tree_flatten(model.parameters()) if not k.endswith(("scales", "biases")))
    float_bytes = 4 * (plain - packed + packed * 32 // bits)
    return float_bytes <= DEQUANTIZE_MEMORY_SHARE * (physical_memory_bytes() or 8 << 30)  # unknown: assume 8 GiB


def _weights_dtype(model: nn.Module) -> mx.Dtype:
    """The checkpoint's float dtype (a quantised model's scales and activations), never the
    packed uint32 of its quantised weights."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
