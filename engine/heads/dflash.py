"""DFlash (z-lab, block diffusion): one pass fills a block [anchor, MASK x (B-1)].

Layout: config.json `architectures: ["DFlashDraftModel"]` with `dflash_config`
(block_size, mask_token_id, target_layer_ids, optional input_embedding_scale,
output_multiplier, final_logit_softcapping); safetensors `fc`, `hidden_norm`,
`layers.N.*`, `norm`. The state at block position i predicts the token at position i
(the masked token itself), so a block of B proposes B-1 tokens. The target's
embedding and LM head are reused.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..sampling import SamplingParams, target_probs
from .backbone import Backbone, HeadConfig

ARCHITECTURES = ("DFlashDraftModel",)


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

    def draft(self, target, anchor: int, ctx, position: int, max_len: int,
              sampling: SamplingParams, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        n = min(max_len, self.max_draft)
        block = mx.array([anchor] + [self.cfg.mask_token_id] * (self.cfg.block_size - 1), dtype=mx.uint32)
        x = target.embed(block)[None] * self.cfg.input_embedding_scale
        h = self(x, ctx, position)[0, 1 : n + 1]
        logits = self.logits(target, h)
        if sampling.greedy:
            return mx.argmax(logits, axis=-1).tolist(), None
        q = target_probs(logits, sampling)
        return [int(rng.choice(q.shape[1], p=row)) for row in q], q
