"""DSpark (DeepSeek DeepSpec): a DFlash-style backbone plus a low-rank Markov head
that walks the block semi-autoregressively, and an optional confidence head.

Layout (DeepSpec `Qwen3DSparkModel`, config fields at the top level): block_size,
mask_token_id, target_layer_ids, markov_rank, markov_head_type (vanilla | gated | rnn),
enable_confidence_head, confidence_head_with_markov; tensors `fc`, `hidden_norm`,
`layers.N.*`, `norm`, `markov_head.markov_w1.weight` (vocab x rank),
`markov_head.markov_w2.weight` (vocab x rank), `markov_head.gate_proj.*` (gated),
`markov_head.joint_proj.*` (rnn), `confidence_head.proj.*`; `embed_tokens.weight` and
`lm_head.weight` are optional (frozen copies of the target's; absent means shared),
as is a `d2t` draft-to-target vocabulary map (EAGLE-3 convention: target id =
draft id + d2t[draft id]) with a smaller `lm_head`.

The state at block position i predicts the token after it (anchor + i + 1), so a
block of B proposes up to B tokens; step i adds markov_w2 @ markov_w1[previous token]
to the base logits (the previous token is the anchor for i = 0). The confidence head
estimates each step's acceptance; the draft ends where their running product falls
below `confidence_threshold`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..sampling import SamplingParams, target_probs
from .backbone import Backbone, HeadConfig

ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "Gemma4DSparkModel")
MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        r, v = cfg.markov_rank, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(v, r)
        self.markov_w2 = nn.Linear(r, v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(cfg.hidden_size + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + cfg.hidden_size, 3 * r)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkHead(Backbone):
    kind = "dspark"

    def __init__(self, cfg: HeadConfig, target_hidden: int | None = None, own_modules: set[str] = frozenset()):
        super().__init__(cfg, target_hidden)
        self.markov_head = MarkovHead(cfg)
        if cfg.enable_confidence_head:
            dim = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim)
        if "embed_tokens" in own_modules:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if "lm_head" in own_modules:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        if cfg.draft_vocab_size:
            self.d2t = mx.zeros((cfg.draft_vocab_size,), dtype=mx.int64)

    @property
    def max_draft(self) -> int:
        return self.cfg.block_size

    def base_logits(self, target, h: mx.array) -> mx.array:
        if "lm_head" not in self:
            return target.lm_head(h)
        logits = self.lm_head(h)
        if "d2t" not in self:
            return logits
        ids = mx.arange(logits.shape[-1]) + self.d2t.astype(mx.int32)
        full = mx.full((logits.shape[0], self.cfg.vocab_size), -mx.inf, dtype=logits.dtype)
        full[:, ids] = logits
        return full

    def _step(self, h_i: mx.array, prev: int, state: mx.array | None):
        """Markov bias for one step (and the confidence logit), given the previous token."""
        m = self.markov_head
        e = m.markov_w1.weight[prev]
        kind = self.cfg.markov_head_type
        if kind == "gated":
            e_eff = mx.sigmoid(m.gate_proj(mx.concatenate([h_i, e]))) * e
            bias = m.markov_w2(e_eff)
        elif kind == "rnn":
            g, c, o = mx.split(m.joint_proj(mx.concatenate([state, e, h_i])), 3)
            g = mx.sigmoid(g)
            state = g * state + (1.0 - g) * mx.tanh(c)
            bias = m.markov_w2(mx.tanh(o))
        else:
            bias = m.markov_w2(e)
        conf = None
        if "confidence_head" in self:
            feat = mx.concatenate([h_i, e]) if self.cfg.confidence_head_with_markov else h_i
            conf = mx.sigmoid(self.confidence_head.proj(feat))[0]
        return bias, conf, state

    def draft(self, target, anchor: int, ctx, position: int, max_len: int,
              sampling: SamplingParams, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        n = min(max_len, self.max_draft)
        block = mx.array([anchor] + [self.cfg.mask_token_id] * (self.cfg.block_size - 1), dtype=mx.uint32)
        embed = self.embed_tokens if "embed_tokens" in self else target.embed
        h = self(embed(block)[None], ctx, position)[0, :n]
        base = self.base_logits(target, h)
        mx.eval(h, base)
        thr = self.cfg.confidence_threshold
        state = mx.zeros((self.cfg.markov_rank,), dtype=h.dtype) if self.cfg.markov_head_type == "rnn" else None
        prev, tokens, qs, alive = anchor, [], [], 1.0
        # The walk is sequential (each step's bias depends on the token just chosen): one
        # small graph and one sync per step.
        for i in range(n):
            bias, conf, state = self._step(h[i], prev, state)
            logits = base[i] + bias
            if conf is not None:
                alive *= conf.item()
                if alive < thr:
                    break
            if sampling.greedy:
                tok = int(mx.argmax(logits).item())
            else:
                q = target_probs(logits[None], sampling)[0]
                tok = int(rng.choice(q.shape[0], p=q))
                qs.append(q)
            tokens.append(tok)
            prev = tok
        return tokens, (np.stack(qs) if qs else None)
