"""The network DFlash and DSpark heads share (their tensor names are the same).

Context features (the target's residual stream after the tapped layers, concatenated)
are fused by `fc` and normalised by `hidden_norm`; each decoder layer turns them into
extra keys and values (cached, at the tokens' absolute positions), and the block's
queries attend non-causally to [context, block]. Qwen3-style layers: q/k RMS norms,
SwiGLU MLP. The target's embedding and output head are reused, not stored here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope


@dataclass
class HeadConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    rope_scaling: dict | None = None
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal only in sliding layers (z-lab's rule)
    # DFlash logit shaping (z-lab dflash_config)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (dynamic causal convolutions, candidate selector)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # DSpark (DeepSpec Qwen3DSparkModel config)
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    confidence_threshold: float = 0.0
    draft_vocab_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DraftRow:
    """One sequence's part of a head draft: rows of one head draft together (`draft_rows`)."""

    anchor: int  # the last committed token, at absolute `position`
    ctx: list | None  # the sequence's per-layer context keys/values (ContextCache.kv)
    position: int
    max_len: int
    sampling: Any  # SamplingParams
    rng: np.random.Generator


class ContextAttention(nn.Module):
    def __init__(self, cfg: HeadConfig, layer_idx: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.scale = hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        sliding = cfg.layer_types and cfg.layer_types[layer_idx] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.causal = bool(sliding) if cfg.is_causal is None else bool(cfg.is_causal)

    def _kv(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Keys (before RoPE) and values, (B, kv heads, L, head dim)."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return k, v

    def __call__(self, x: mx.array, ctx: list, rope, offsets: list[int], queries: int | None = None) -> mx.array:
        """Blocks x (B, L, d) of B rows, row b at absolute position offsets[b] with its own
        context keys/values ctx[b] (or None). Projections run once for all rows; attention
        per row, over that row's own context: rows' contexts differ in length and need no
        padding, and each row attends exactly as it would alone. `queries`: only the first
        that many positions attend (every position is still a key): (B, queries, d)."""
        B, L, _ = x.shape
        Q = L if queries is None else min(queries, L)
        q = self.q_norm(self.q_proj(x[:, :Q] if Q < L else x).reshape(B, Q, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k, v = self._kv(x)
        out = []
        for b, offset in enumerate(offsets):
            qb, kb, vb = rope(q[b : b + 1], offset=offset), rope(k[b : b + 1], offset=offset), v[b : b + 1]
            S = 0
            if ctx[b] is not None:
                ck, cv = ctx[b]
                if self.window is not None and ck.shape[2] > self.window - 1:
                    ck, cv = ck[:, :, -(self.window - 1) :], cv[:, :, -(self.window - 1) :]
                S = ck.shape[2]
                kb, vb = mx.concatenate([ck, kb], axis=2), mx.concatenate([cv, vb], axis=2)
            mask = None
            if self.causal:  # block attends causally within itself, to all context
                mask = mx.arange(S + L)[None] <= (S + mx.arange(Q))[:, None]
            out.append(mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=self.scale, mask=mask))
        out = out[0] if B == 1 else mx.concatenate(out, axis=0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, Q, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ContextAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx, rope, offsets, queries=None):
        """`queries`: only the first that many positions come out (the last layer's other
        positions feed no draft)."""
        h = (x if queries is None else x[:, :queries]) + self.self_attn(
            self.input_layernorm(x), ctx, rope, offsets, queries)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """fc + hidden_norm + layers + norm: the parameters both published layouts name alike."""

    layer_class = DecoderLayer

    def __init__(self, cfg: HeadConfig, target_hidden: int | None = None):
        super().__init__()
        self.cfg = cfg
        feat = len(cfg.target_layer_ids) * (target_hidden or cfg.hidden_size)
        self.fc = nn.Linear(feat, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._rope = initialize_rope(
            cfg.head_dim,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def draft(self, target, anchor: int, ctx, position: int, max_len: int,
              sampling, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """One sequence's draft: a batch of one row."""
        return self.draft_rows(target, [DraftRow(anchor, ctx, position, max_len, sampling, rng)])[0]

    def block(self, rows: list[DraftRow]) -> mx.array:
        """The rows' blocks [anchor, MASK x (B-1)], (rows, block size)."""
        mask = [self.cfg.mask_token_id] * (self.cfg.block_size - 1)
        return mx.array([[r.anchor, *mask] for r in rows], dtype=mx.uint32)

    def context_kv(self, feats: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Per-layer keys and values for context features (n, taps*hidden) starting at `offset`."""
        return self.context_kvs([(feats, offset)])[0]

    def context_kvs(self, chunks: list[tuple[mx.array, int]]) -> list[list[tuple[mx.array, mx.array]]]:
        """`context_kv` of several chunks (several sequences' new features): one projection of
        them all, each chunk's keys then rotated to its own positions."""
        feats = mx.concatenate([f for f, _ in chunks]) if len(chunks) > 1 else chunks[0][0]
        h = self.hidden_norm(self.fc(feats[None]))
        out: list[list] = [[] for _ in chunks]
        for layer in self.layers:
            k, v = layer.self_attn._kv(h)
            start = 0
            for kvs, (f, offset) in zip(out, chunks):
                end = start + f.shape[0]
                kvs.append((self._rope(k[:, :, start:end], offset=offset), v[:, :, start:end]))
                start = end
        return out

    def __call__(self, x: mx.array, ctx: list | None, offset: int | list[int], keep: int | None = None) -> mx.array:
        """Block embeddings (B, L, hidden) -> normed states. One row: `ctx` its per-layer
        context (or None), `offset` its absolute position. B rows: `ctx` a list of those per
        row and `offset` a list of positions (engine/drafting/heads/drafter.py drafts rows together).
        `keep`: only the first that many positions' states are wanted (B, keep, hidden); the
        last layer computes no others (a short draft's cap leaves most of the block unread)."""
        rows = isinstance(offset, list)
        ctx, offsets = (ctx, offset) if rows else ([ctx], [offset])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            own = [None if c is None else c[i] for c in ctx]
            x = layer(x, own, self._rope, offsets, keep) if i == last and keep is not None else layer(x, own, self._rope, offsets)
        return self.norm(x)


class ContextCache:
    """Per-layer context keys/values at absolute positions, bounded to the most recent `limit`.

    Features can arrive with gaps (a prefix-cache hit skips prefill of the cached part):
    each chunk keeps its own absolute positions, so the head sees a recent window."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.kv: list[tuple[mx.array, mx.array]] | None = None

    def add(self, new: list[tuple[mx.array, mx.array]]) -> None:
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [
                (mx.concatenate([k, nk], axis=2), mx.concatenate([v, nv], axis=2))
                for (k, v), (nk, nv) in zip(self.kv, new)
            ]
        if self.limit and self.kv[0][0].shape[2] > self.limit:
            self.kv = [(k[:, :, -self.limit :], v[:, :, -self.limit :]) for k, v in self.kv]

    def __len__(self) -> int:
        return 0 if self.kv is None else int(self.kv[0][0].shape[2])
