"""Qwen3 decoder in plain PyTorch, with Hugging Face Qwen3ForCausalLM parameter names.

Used to train the bundled reference model (``training/train.py``) and reusable for
drafter-head training: ``Qwen3ForCausalLM.forward(..., output_hidden_states=True)`` returns
the hidden states of every layer. Tied embeddings (no ``lm_head``). The parameter names of
``state_dict()`` are exactly those of HF Qwen3 (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ``...q_norm.weight``, ``model.norm.weight``),
so ``training/export.py`` writes them unchanged and mlx-lm loads them natively.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Qwen3Config:
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int = 2  # <|im_end|>
    pad_token_id: int = 0  # <|endoftext|>

    def hf_config(self) -> dict:
        """config.json for the Hugging Face / mlx-lm layout."""
        d = asdict(self)
        d.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            rope_scaling=None,
            use_cache=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_hidden_layers,
            torch_dtype="bfloat16",
        )
        return dict(sorted(d.items()))

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(cfg: Qwen3Config, seq_len: int, device, offset: int = 0):
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    t = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); cos/sin: (T, D)
    return (x.float() * cos + _rotate_half(x.float()) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        dtype = v.dtype  # bf16 under autocast
        o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, targets=None, loss_mask=None, output_hidden_states=False):
        """input_ids (B, T). With ``targets`` (B, T): returns the mean cross-entropy over
        positions where ``loss_mask`` (B, T: bool, or integer weights) is set, weighted (all if None), computing logits only
        there. Without: returns logits (B, T, V). With ``output_hidden_states``: returns
        ``(result, hidden_states)`` where hidden_states[i] is the input of layer i (index 0 =
        embeddings) and hidden_states[-1] the final-normed output, as in HF.
        """
        cos, sin = rope_cos_sin(self.cfg, input_ids.shape[1], input_ids.device)
        return causal_lm_forward(self.model, input_ids, cos, sin, targets, loss_mask, output_hidden_states)


def causal_lm_forward(model, input_ids, cos, sin, targets=None, loss_mask=None, output_hidden_states=False):
    """Embed, run every decoder layer (each takes `x, cos, sin`), norm, then tied-embedding
    logits or the masked loss: the body every decoder here shares (qwen3, qwen3_5)."""
    x = model.embed_tokens(input_ids)
    hidden = [x] if output_hidden_states else None
    for layer in model.layers:
        x = layer(x, cos, sin)
        if output_hidden_states:
            hidden.append(x)
    x = model.norm(x)
    if output_hidden_states:
        hidden[-1] = x
    w = model.embed_tokens.weight
    if targets is None:
        out = x @ w.t().to(x.dtype) if x.dtype != w.dtype else F.linear(x, w)
    else:
        if loss_mask is not None:  # bool, or per-token weights (0 = not a target)
            sel = loss_mask.reshape(-1) > 0
            h = x.reshape(-1, x.shape[-1])[sel]
            t = targets.reshape(-1)[sel]
            weight = loss_mask.reshape(-1)[sel].float()
            ce = F.cross_entropy(F.linear(h, w).float(), t, reduction="none")
            out = (ce * weight).sum() / weight.sum()
        else:
            h, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
            out = F.cross_entropy(F.linear(h, w).float(), t)
    return (out, hidden) if output_hidden_states else out


def load_pretrained(model_dir, device="cpu", dtype=None) -> Qwen3ForCausalLM:
    """Load an exported model directory (config.json + safetensors shards) into PyTorch."""
    import json
    from pathlib import Path

    d = Path(model_dir)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(json.loads((d / "config.json").read_text())))
    return load_weights(model, d, device, dtype)


def load_weights(model: nn.Module, model_dir, device="cpu", dtype=None) -> nn.Module:
    """An exported directory's safetensors shards into `model` (strict), on `device`."""
    from pathlib import Path

    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.to(device=device, dtype=dtype or torch.float32)
