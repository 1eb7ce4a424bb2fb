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

from engine.base.sampling import target_probs
from engine.drafting.heads.backbone import Backbone, DraftRow, HeadConfig

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

    def _step(self, h_i: mx.array, prev: mx.array, state: mx.array | None):
        """Markov bias for one step of every row (and the confidence), given each row's previous
        token: h_i (rows, hidden), prev (rows,) -> bias (rows, vocab), confidence (rows,) or None."""
        m = self.markov_head
        e = m.markov_w1.weight[prev]
        kind = self.cfg.markov_head_type
        if kind == "gated":
            e_eff = mx.sigmoid(m.gate_proj(mx.concatenate([h_i, e], axis=-1))) * e
            bias = m.markov_w2(e_eff)
        elif kind == "rnn":
            g, c, o = mx.split(m.joint_proj(mx.concatenate([state, e, h_i], axis=-1)), 3, axis=-1)
            g = mx.sigmoid(g)
            state = g * state + (1.0 - g) * mx.tanh(c)
            bias = m.markov_w2(mx.tanh(o))
        else:
            bias = m.markov_w2(e)
        conf = None
        if "confidence_head" in self:
            feat = mx.concatenate([h_i, e], axis=-1) if self.cfg.confidence_head_with_markov else h_i
            conf = mx.sigmoid(self.confidence_head.proj(feat))[:, 0]
        return bias, conf, state

    def draft_rows(self, target, rows: list[DraftRow]) -> list[tuple[list[int], np.ndarray | None]]:
        """Every row's draft: one head forward for all rows, then the Markov walk over all rows
        at once, a step per draft position. Each row's tokens are the ones it drafts alone."""
        n = max(min(r.max_len, self.max_draft) for r in rows)
        embed = self.embed_tokens if "embed_tokens" in self else target.embed
        h = self(embed(self.block(rows)), [r.ctx for r in rows], [r.position for r in rows], keep=n)
        base = self.base_logits(target, h.reshape(-1, h.shape[-1])).reshape(len(rows), n, -1)
        thr = self.cfg.confidence_threshold
        caps = [min(r.max_len, self.max_draft) for r in rows]
        sampled = not all(r.sampling.greedy for r in rows)
        state = mx.zeros((len(rows), self.cfg.markov_rank), dtype=h.dtype) if self.cfg.markov_head_type == "rnn" else None
        prev = [r.anchor for r in rows]
        tokens, qs, alive = [[] for _ in rows], [[] for _ in rows], [1.0] * len(rows)
        live = [c > 0 for c in caps]
        # Each step's bias depends on the token just chosen, and the confidence ends most drafts
        # after a token or two: a step per position for all rows, one (cheap) sync each, up to
        # the last position a row reaches (a row stops drawing where it stops alone). The base
        # logits came in one projection above: the vocabulary weights are read once.
        for i in range(n):
            if not any(live):
                break
            bias, conf, state = self._step(h[:, i], mx.array(prev, dtype=mx.uint32), state)
            logits = base[:, i] + bias
            best = mx.argmax(logits, axis=-1)
            mx.eval([best] + ([] if conf is None else [conf]) + ([logits] if sampled else []))
            best, conf = best.tolist(), (None if conf is None else conf.tolist())
            for b, r in enumerate(rows):
                if not live[b]:
                    continue
                if conf is not None:
                    alive[b] *= conf[b]
                    if alive[b] < thr:
                        live[b] = False
                        continue
                if r.sampling.greedy:
                    tok = best[b]
                else:
                    q = target_probs(logits[b : b + 1], r.sampling)[0]
                    tok = int(r.rng.choice(q.shape[0], p=q))
                    qs[b].append(q)
                tokens[b].append(tok)
                prev[b] = tok
                live[b] = len(tokens[b]) < caps[b]
        return [(t, np.stack(q) if q else None) for t, q in zip(tokens, qs)]
