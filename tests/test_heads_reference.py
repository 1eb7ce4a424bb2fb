"""The trained heads shipped beside the reference model: they load strictly, pair with
it, decode losslessly, draw drafts from the q they report, and `auto` weighs them."""

from __future__ import annotations

import numpy as np
import pytest

from engine import REFERENCE_MODEL_DIR, Engine, GenerationRequest, SamplingParams
from engine.drafting.heads import HeadDrafter, head_for
from engine.drafting.heads.registry import REFERENCE_BEST, REFERENCE_DRAFTERS
from engine.drafting.modes import auto_candidates
from engine.decoding.verify import prefill
from stats_util import chi_square_fits

pytestmark = pytest.mark.skipif(
    not (REFERENCE_MODEL_DIR / "config.json").exists()
    or not all((REFERENCE_DRAFTERS / k / "model.safetensors").exists() for k in ("dflash", "dspark")),
    reason="the reference model or its trained heads are absent",
)


@pytest.fixture(scope="module")
def ref_engine():
    with Engine(prefix_cache=False) as engine:
        yield engine


def test_auto_weighs_the_registered_heads(ref_engine):  # which runs is measured: tests/test_auto_mode.py
    candidates = ref_engine.call(auto_candidates)
    assert candidates == ["lookup", "dflash", "dspark"] and REFERENCE_BEST in candidates


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_trained_head_is_lossless(ref_engine, mode):
    for text in ("Write a Python function that checks whether a number is prime.",
                 "Rename `total` to `acc` in:\n```python\ndef f(xs):\n    total = 0\n    for x in xs:\n"
                 "        total += x\n    return total\n```"):
        ids = ref_engine.render_chat([{"role": "user", "content": text}])
        base = list(ref_engine.generate(GenerationRequest(ids, max_tokens=48, mode="baseline")))[-1]
        done = list(ref_engine.generate(GenerationRequest(ids, max_tokens=48, mode=mode)))[-1]
        assert done.token_ids == base.token_ids
        assert done.stats.mode == mode and done.stats.accepted_tokens > 0


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_trained_head_samples_from_its_reported_q(ref_engine, mode):
    def draws(target):
        head = head_for(target, mode)
        prompt = target.encode("import os\nimport sys\n\n\ndef main(argv):\n")
        drafter = HeadDrafter(head, target, [], lookup_override=False)
        drafter.start(prompt)
        prefill(target, target.make_cache(), prompt[:-1], on_hidden=drafter.observe_prefill,
                tap_layers=drafter.tap_layers)
        drafter.set_sampling(SamplingParams(temperature=1.0, top_k=20, seed=1))
        return [drafter.propose(1) for _ in range(500)]

    drafts = ref_engine.call(draws)
    q0 = drafts[0].q[0]
    counts = np.bincount([d.tokens[0] for d in drafts if d.tokens], minlength=len(q0))
    ok, stat, crit = chi_square_fits(counts, q0)
    assert ok, f"chi2 {stat:.1f} > {crit:.1f}"
