"""DFlash and DSpark drafter heads in PyTorch, for training; parameter names are the
published layouts' (z-lab DFlashDraftModel, DeepSpec Qwen3DSparkModel), so
``state_dict()`` exports unchanged and engine/heads loads it.

Training follows DeepSpec/SpecForge: many anchors per sequence, each a block
``[token at anchor, MASK x (B-1)]`` at positions anchor..anchor+B-1; a block's queries
attend to the context features strictly before its anchor and to their own block
(non-causal), all blocks of a row in one masked attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from qwen3_torch import RMSNorm  # the target's own norm (training/ is on sys.path)


def rope(x, pos, theta: float):
    """x (B, H, L, D), pos (B, L) absolute positions; non-interleaved halves (HF/mlx-lm `traditional=False`)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv  # (B, L, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.float().chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd, self.theta = c["num_attention_heads"], c["num_key_value_heads"], hd, c["rope_theta"]
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def _kv(self, x, pos):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.nkv, self.hd).transpose(1, 2)
        return rope(k, pos, self.theta), v

    def forward(self, x, x_pos, ctx, ctx_pos, mask):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.nh, self.hd)).transpose(1, 2)
        q = rope(q, x_pos, self.theta)
        kc, vc = self._kv(ctx, ctx_pos)
        kb, vb = self._kv(x, x_pos)
        k, v = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, x_pos, ctx, ctx_pos, mask):
        h = x + self.self_attn(self.input_layernorm(x), x_pos, ctx, ctx_pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, c: dict, n_taps: int, target_hidden: int):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(n_taps * target_hidden, c["hidden_size"], bias=False)
        self.hidden_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def backbone(self, x, x_pos, feats, ctx_pos, mask):
        ctx = self.hidden_norm(self.fc(feats))
        for layer in self.layers:
            x = layer(x, x_pos, ctx, ctx_pos, mask)
        return self.norm(x)


class DFlashHead(Backbone):
    kind = "dflash"
    predicts_offset = 0  # block position j predicts the token at anchor + j (j >= 1)


class DSparkHead(Backbone):
    kind = "dspark"
    predicts_offset = 1  # block position j predicts the token at anchor + j + 1

    def __init__(self, c: dict, n_taps: int, target_hidden: int, vocab: int, rank: int):
        super().__init__(c, n_taps, target_hidden)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_head.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.markov_head.markov_w2.weight)  # start as the plain head
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(c["hidden_size"] + rank, 1)


def init_weights(m: nn.Module, std: float = 0.02, n_layers: int = 1) -> None:
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif "markov_w2" in name:
            nn.init.zeros_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layers))
        else:
            nn.init.normal_(p, 0.0, std)


def block_mask(anchors: torch.Tensor, T: int, Bk: int) -> torch.Tensor:
    """(B, 1, A*Bk, T + A*Bk) bool: context keys before the block's anchor, plus its own block."""
    B, A = anchors.shape
    dev = anchors.device
    q_block = torch.arange(A * Bk, device=dev) // Bk  # (Q,)
    anchor_q = anchors[:, q_block]  # (B, Q)
    ctx = torch.arange(T, device=dev)[None, None, :] < anchor_q[:, :, None]  # (B, Q, T)
    kb = torch.arange(A * Bk, device=dev) // Bk
    own = (q_block[:, None] == kb[None, :])[None].expand(B, -1, -1)  # (B, Q, A*Bk)
    return torch.cat([ctx, own], -1)[:, None]


def head_forward(head: Backbone, embed_w, ids, feats, anchors, mask_id: int, Bk: int):
    """Normed states (B, A, Bk, H) of every anchor's block."""
    B, T = ids.shape
    A = anchors.shape[1]
    offs = torch.arange(Bk, device=ids.device)
    block_ids = torch.full((B, A, Bk), mask_id, device=ids.device, dtype=ids.dtype)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    x = F.embedding(block_ids.view(B, A * Bk), embed_w).to(feats.dtype)
    x_pos = (anchors[:, :, None] + offs).view(B, A * Bk)
    ctx_pos = torch.arange(T, device=ids.device)[None].expand(B, -1)
    mask = block_mask(anchors, T, Bk)
    h = head.backbone(x, x_pos, feats, ctx_pos, mask)
    return h.view(B, A, Bk, -1)
