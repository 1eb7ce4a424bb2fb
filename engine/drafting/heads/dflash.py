"""DFlash (z-lab, block diffusion): one pass fills a block [anchor, MASK x (B-1)].

Layout: config.json `architectures: ["DFlashDraftModel"]` with `dflash_config`
(block_size, mask_token_id, target_layer_ids, optional input_embedding_scale,
output_multiplier, final_logit_softcapping); safetensors `fc`, `hidden_norm`,
`layers.N.*`, `norm`. The state at block position i predicts the token at position i
(the masked token itself), so a block of B proposes B-1 tokens. The target's
embedding and LM head are reused.

DFlash 2 (`DFlash2DraftModel`; dflash_config adds conv_kernel_size, conv_group_size,
selector_rank, selector_top_k) wraps each layer's attention and MLP in grouped dynamic
causal convolutions over the block (`layers.N.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}`) and picks the draft with a candidate selector
(`candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`):
at each position the top-k tokens of the head's logits are rescored with a low-rank
term linking the previous chosen token to each candidate, and one is chosen (greedy) or
sampled (its q is the softmax over the k candidates, zero elsewhere).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlx.nn as nn

from engine.base.sampling import target_probs
from engine.drafting.heads.backbone import Backbone, DecoderLayer, DraftRow, HeadConfig

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


class DFlashHead(Backbone):
    kind = "dflash"

    def __init__(self, cfg: HeadConfig, target_hidden: int | None = None, own_modules: set[str] = frozenset()):
        super().__init__(cfg, target_hidden)

    @property
    def max_draft(self) -> int:
        return self.cfg.block_size - 1

    def logits(self, target, h: mx.array) -> mx.array:
        out = target.lm_head(h) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    def block_states(self, target, rows: list[DraftRow]) -> tuple[mx.array, mx.array]:
        """Hidden states and logits of the rows' blocks [anchor, MASK...] for the first drafts,
        as many as the longest row's cap: (rows, n, hidden), (rows, n, vocab)."""
        n = max(min(r.max_len, self.max_draft) for r in rows)
        x = target.embed(self.block(rows)) * self.cfg.input_embedding_scale
        h = self(x, [r.ctx for r in rows], [r.position for r in rows], keep=n + 1)[:, 1:]
        return h, self.logits(target, h)

    def draft_rows(self, target, rows: list[DraftRow]) -> list[tuple[list[int], np.ndarray | None]]:
        """Every row's draft from one head forward over all rows."""
        _, logits = self.block_states(target, rows)
        greedy = mx.argmax(logits, axis=-1).tolist()
        out = []
        for b, r in enumerate(rows):
            n = min(r.max_len, self.max_draft)
            if r.sampling.greedy:
                out.append((greedy[b][:n], None))
            else:
                q = target_probs(logits[b, :n], r.sampling)
                out.append(([int(r.rng.choice(q.shape[1], p=p)) for p in q], q))
        return out


def _dynamic_convolve(hidden: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """Causal grouped convolution along the block: (base + per-position dynamic) taps."""
    B, L, H = hidden.shape
    groups = H // group_size
    blocks = hidden.reshape(B, L, groups, group_size)
    dynamic = dynamic.reshape(B, L, base.shape[0], groups, 1)
    out = mx.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else mx.concatenate(
            [mx.zeros_like(blocks[:, :offset]), blocks[:, :-offset]], axis=1)
        out = out + base[offset].reshape(1, 1, groups, group_size).astype(hidden.dtype) * values
        out = out + dynamic[:, :, offset] * values
    return out.reshape(B, L, H)


class DynamicCausalConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, group_size: int):
        super().__init__()
        self.kernel, self.group_size = kernel, group_size
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group_size), bias=False)

    def prepare(self, h):
        dyn = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.kernel, h.shape[-1] // self.group_size)
        return _dynamic_convolve(h, dyn[..., 0, :, :], self.base_kernel[0], self.group_size), dyn[..., 1, :, :]

    def finish(self, h, dyn):
        return _dynamic_convolve(h, dyn, self.base_kernel[1], self.group_size)


class DFlash2Layer(DecoderLayer):
    def __init__(self, cfg: HeadConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.attention_conv = DynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, x, ctx, rope, offsets, queries=None):
        h, k = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope, offsets), k)
        h, k = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        x = x + self.mlp_conv.finish(self.mlp(h), k)
        return x if queries is None else x[:, :queries]  # the convolutions need every position


class CandidateSelector(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)


class DFlash2Head(DFlashHead):
    kind = "dflash"
    layer_class = DFlash2Layer

    def __init__(self, cfg: HeadConfig, target_hidden: int | None = None, own_modules: set[str] = frozenset()):
        super().__init__(cfg, target_hidden)
        self.candidate_selector = CandidateSelector(cfg)

    def draft_rows(self, target, rows: list[DraftRow]) -> list[tuple[list[int], np.ndarray | None]]:
        """One head forward for all rows; the selector's walk over all rows at once. Greedy,
        each choice stays on the device (one graph, one sync); sampled, one sync per step."""
        h, logits = self.block_states(target, rows)
        sel = self.candidate_selector
        k = min(sel.top_k, logits.shape[-1])
        cands = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]  # (rows, n, k)
        unary = mx.take_along_axis(logits, cands, axis=-1)
        proj = sel.hidden_projection(h)
        sampled = not all(r.sampling.greedy for r in rows)
        if sampled:
            mx.eval(cands, unary, proj)
        caps = [min(r.max_len, self.max_draft) for r in rows]
        prev = mx.array([r.anchor for r in rows], dtype=mx.uint32)
        chosen, qs = [], [[] for _ in rows]
        for i in range(h.shape[1]):
            edges = (sel.predecessor_codebook.weight[prev][:, None] * proj[:, i, None]
                     * sel.successor_codebook(cands[:, i])).sum(-1)
            scores = unary[:, i] + edges  # (rows, k)
            j = mx.argmax(scores, axis=-1)
            if sampled:
                j = np.array(j)
                for b, r in enumerate(rows):
                    if not r.sampling.greedy and i < caps[b]:
                        p = target_probs(scores[b : b + 1], r.sampling)[0]
                        j[b] = r.rng.choice(k, p=p)
                        q = np.zeros(logits.shape[-1])
                        q[np.array(cands[b, i])] = p
                        qs[b].append(q)
                j = mx.array(j)
            prev = mx.take_along_axis(cands[:, i], j[:, None].astype(mx.uint32), axis=-1)[:, 0]
            chosen.append(prev)
        chosen = mx.stack(chosen, axis=1).tolist()
        return [(t[:c], np.stack(q) if q else None) for t, c, q in zip(chosen, caps, qs)]
