"""DFlash and DSpark drafter heads: taps, lossless decoding, exact sampling, incremental context.

Heads here are random (built from tiny configs in their published layouts and paired
with the tiny qwen3 model); the trained heads for the reference model are checked in
test_heads_reference.py when they are present.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, GenerationRequest, SamplingParams
from engine.drafting.heads import HeadDrafter, load_head
from engine.drafting.heads.backbone import ContextCache
from engine.drafting.heads.export import dflash_config, dspark_config, random_head_checkpoint
from engine.model.target import load_target
from engine.decoding.verify import prefill, speculative_rounds
from stats_util import chi_square_fits

PROMPTS = [
    "def rename_symbol(path, old, new):\n",
    "The quick brown fox jumps over the lazy dog. Please rewrite this file.\n",
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i)\nfor i in range(",
]


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    return load_target(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_heads(tiny_model_dir, tmp_path_factory):
    """Random heads in the published layouts: DFlash, DSpark (vanilla Markov + confidence), DSpark gated."""
    tc = json.loads((tiny_model_dir / "config.json").read_text())
    root = tmp_path_factory.mktemp("heads")
    return {
        "dflash": random_head_checkpoint(root / "dflash", dflash_config(
            tc, mask_token_id=0, target_layer_ids=[0, 1], block_size=8), seed=1),
        "dspark": random_head_checkpoint(root / "dspark", dspark_config(
            tc, mask_token_id=0, target_layer_ids=[-1, 1], markov_rank=16), seed=2),
        "dflash2": random_head_checkpoint(root / "dflash2", dflash_config(
            tc, mask_token_id=0, target_layer_ids=[0, 1], block_size=6, version=2), seed=4),
        "dspark_gated": random_head_checkpoint(root / "dspark_gated", dspark_config(
            tc, mask_token_id=0, target_layer_ids=[1], markov_rank=8, markov_head_type="gated",
            confidence=False, layers=2), seed=3),
    }


def test_forward_tapped_is_the_same_forward(tiny_model_dir, tiny_llama_dir):
    for d in (tiny_model_dir, tiny_llama_dir):
        t = load_target(d)
        a, b = t.make_cache(), t.make_cache()
        ids = t.encode(PROMPTS[0])
        plain = t.forward(ids, a)
        logits, hidden = t.forward_tapped(ids, b, (-1, 0, 1))
        assert mx.array_equal(plain, logits)
        assert hidden.shape == (len(ids), 3 * t.hidden_size)
        # the tap after the last layer is the residual stream the final norm reads
        assert mx.allclose(t.lm_head(t.model.model.norm(hidden[None, :, -t.hidden_size :]))[0], logits, atol=1e-4)
        # and the cache it filled continues exactly like the plain one
        assert mx.allclose(t.forward([5, 6], a), t.forward_tapped([5, 6], b, (1,))[0], atol=1e-5)


def test_taps_refuse_unsupported_families_and_layers(tiny_target, monkeypatch):
    with pytest.raises(ValueError, match="do not exist"):
        tiny_target.check_tappable((0, 7))
    monkeypatch.setattr(type(tiny_target), "family", property(lambda self: "mamba"))
    with pytest.raises(ValueError, match="not supported for model type 'mamba'"):
        tiny_target.forward_tapped([1, 2], tiny_target.make_cache(), (0,))


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "dspark_gated"])
def test_greedy_equals_plain_decoding(tiny_model_dir, tiny_heads, kind):
    with Engine(str(tiny_model_dir), drafter=str(tiny_heads[kind])) as engine:
        mode = engine.call(lambda t: next(iter(t.heads)))
        assert mode == kind.split("_")[0].rstrip("2")
        for text in [*PROMPTS, PROMPTS[0]]:  # the repeat is served from the prefix cache
            ids = engine.encode(text)
            base = list(engine.generate(GenerationRequest(ids, max_tokens=40, mode="baseline")))[-1]
            for cap in (3, 16):
                done = list(engine.generate(GenerationRequest(ids, max_tokens=40, mode=mode, max_draft=cap)))[-1]
                assert done.token_ids == base.token_ids, (kind, text, cap)
                assert done.stats.mode == mode and done.stats.drafted_tokens > 0


def _drafter_after_prefill(target, head, prompt):
    drafter = HeadDrafter(head, target, [], lookup_override=False)
    drafter.start(prompt)
    cache = target.make_cache()
    prefill(target, cache, prompt[:-1], chunk_size=5, on_hidden=drafter.observe_prefill,
            tap_layers=drafter.tap_layers)
    return drafter, cache


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_incremental_context_equals_full_recompute(tiny_target, tiny_heads, kind):
    """Context features gathered chunk by chunk and round by round put every token at its
    own position: the head's next draft equals one computed from a single full pass."""
    head = load_head(tiny_heads[kind], tiny_target)
    prompt = tiny_target.encode(PROMPTS[2])
    drafter, cache = _drafter_after_prefill(tiny_target, head, prompt)
    rounds = speculative_rounds(tiny_target, cache, prompt[-1], drafter, SamplingParams(), 5)
    for _ in range(6):
        next(rounds)
    drafter._flush()
    tokens = drafter.tokens
    _, full = tiny_target.forward_tapped(tokens[:-1], tiny_target.make_cache(), drafter.tap_layers)
    fresh = ContextCache()
    fresh.add(head.context_kv(full, 0))
    for (k1, v1), (k2, v2) in zip(drafter.ctx.kv, fresh.kv):
        assert k1.shape == k2.shape
        assert mx.allclose(k1, k2, atol=1e-4) and mx.allclose(v1, v2, atol=1e-4)
    rng = np.random.default_rng(0)
    got = head.draft(tiny_target, tokens[-1], drafter.ctx.kv, len(tokens) - 1, 8, SamplingParams(), rng)
    want = head.draft(tiny_target, tokens[-1], fresh.kv, len(tokens) - 1, 8, SamplingParams(), rng)
    assert got[0] == want[0]


def _exact_marginals(target, prompt, params):
    """The target's distributions of the first and second sampled token."""
    from engine.base.sampling import target_probs

    p1 = target_probs(target.forward(prompt, target.make_cache()), params)[-1]
    p2 = np.zeros_like(p1)
    for t1 in np.nonzero(p1)[0]:
        p2 += p1[t1] * target_probs(target.forward(prompt + [int(t1)], target.make_cache()), params)[-1]
    return p1, p2


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_sampling_with_the_heads_own_q_keeps_the_target_distribution(tiny_target, tiny_heads, kind):
    """Chi-square (0.1% false alarm) on the first and second sampled token: drafts are drawn
    from the head's own q and verified by speculative sampling; accepts and rejects both occur."""
    head = load_head(tiny_heads[kind], tiny_target)
    if kind == "dflash":
        head.cfg.output_multiplier = 0.3  # a broad q, so that drafts are often accepted
    target, prompt = tiny_target, tiny_target.encode(PROMPTS[1])
    p1, p2 = _exact_marginals(target, prompt, SamplingParams(temperature=2.0))
    drafter, cache = _drafter_after_prefill(target, head, prompt)
    saved, base_len = list(drafter.prefill_chunks), len(prompt) - 1
    first, second = np.zeros_like(p1), np.zeros_like(p2)
    drafted = accepted = 0
    for seed in range(600):
        drafter.start(prompt)
        drafter.prefill_chunks = list(saved)
        params = SamplingParams(temperature=2.0, seed=seed)
        rounds = speculative_rounds(target, cache, prompt[-1], drafter, params, 2,
                                    rng=np.random.default_rng(10_000 + seed))
        out = []
        while len(out) < 2:
            r = next(rounds)
            out += r.tokens
            drafted, accepted = drafted + r.drafted, accepted + r.accepted
        rounds.close()
        target.rollback(cache, cache[0].offset - base_len)
        first[out[0]] += 1
        second[out[1]] += 1
    assert drafted >= 600 and 150 < accepted < drafted - 150, (drafted, accepted)
    for name, counts, p in (("first", first, p1), ("second", second, p2)):
        ok, stat, crit = chi_square_fits(counts, p)
        assert ok, f"{kind} {name} token: chi2 {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_draft_tokens_follow_the_reported_q(tiny_target, tiny_heads, kind):
    """Draft.q is the distribution the draft was drawn from: position 0 against q[0], and
    position 1 (given the most frequent position-0 token, for DSpark's Markov walk) against q[1]."""
    head = load_head(tiny_heads[kind], tiny_target)
    head.cfg.confidence_threshold = 0.0  # full-length drafts
    prompt = tiny_target.encode(PROMPTS[0])
    drafter, _ = _drafter_after_prefill(tiny_target, head, prompt)
    drafter.set_sampling(SamplingParams(temperature=1.5, seed=5))
    drafts = [drafter.propose(3) for _ in range(1500)]
    q0 = drafts[0].q[0]
    assert all(np.array_equal(d.q[0], q0) for d in drafts)
    first = np.bincount([d.tokens[0] for d in drafts], minlength=len(q0))
    ok, stat, crit = chi_square_fits(first, q0)
    assert ok, f"position 0: chi2 {stat:.1f} > {crit:.1f}"
    top = int(np.argmax(first))
    given = [d for d in drafts if d.tokens[0] == top]
    q1 = given[0].q[1]
    assert all(np.array_equal(d.q[1], q1) for d in given)
    second = np.bincount([d.tokens[1] for d in given], minlength=len(q1))
    ok, stat, crit = chi_square_fits(second, q1)
    assert ok, f"position 1: chi2 {stat:.1f} > {crit:.1f}"
    # the check has power: the same draws against a sharpened q fail
    sharp = q0**1.5 / (q0**1.5).sum()
    assert not chi_square_fits(first, sharp)[0]


def test_chi_square_here_has_power(tiny_target):
    """Sampling the first token from a slightly wrong temperature is caught by the same check."""
    from engine.base.sampling import target_probs

    prompt = tiny_target.encode(PROMPTS[1])
    logits = tiny_target.forward(prompt, tiny_target.make_cache())
    p = target_probs(logits, SamplingParams(temperature=2.0))[-1]
    wrong = target_probs(logits, SamplingParams(temperature=1.6))[-1]
    counts = np.random.default_rng(0).multinomial(1000, wrong)
    assert not chi_square_fits(counts, p)[0]


def test_long_lookup_match_replaces_the_heads_draft(tiny_target, tiny_heads):
    head = load_head(tiny_heads["dflash"], tiny_target)
    text = "class Engine:\n    def __init__(self, model):\n        self.model = model\n" * 3
    prompt = tiny_target.encode(text)
    cut = prompt[: len(prompt) - 12]  # the third copy is half-written: lookup knows the rest
    drafter = HeadDrafter(head, tiny_target, [])
    drafter.start(cut)
    draft = drafter.propose(32)
    assert drafter.source == "lookup" and draft.q is None
    assert draft.tokens[:8] == prompt[len(cut) : len(cut) + 8]
    for _ in range(4):  # rejected lookup drafts shut its gate below the override's length...
        drafter.lookup.commit([], 64, 0)
    assert drafter.lookup.limit < 16
    again = drafter.propose(32)  # ...and the match still overrides, at the override's length
    assert drafter.source == "lookup" and again.tokens == draft.tokens[:16]
    fresh = HeadDrafter(head, tiny_target, [])
    fresh.start(tiny_target.encode("zq"))
    assert len(fresh.propose(32).tokens) == head.max_draft and fresh.source == "head"


def test_verbatim_override_runs_past_an_adaptive_cap_but_not_the_hard_one(tiny_target, tiny_heads):
    """A long lookup match is drafted in full even where the round's adaptive cap is small or
    has turned head drafting off (0); the hard cap still bounds it, and the output is exact."""
    head = load_head(tiny_heads["dflash"], tiny_target)
    prompt = tiny_target.encode(PROMPTS[0])
    ref = []
    rounds = speculative_rounds(tiny_target, _prefilled(tiny_target, prompt), prompt[-1],
                                _started(HeadDrafter(head, tiny_target, [], lookup_override=False), prompt),
                                SamplingParams(), 0)
    while len(ref) < 40:
        ref += next(rounds).tokens
    for hard_cap, longest in ((10, lambda m: m == 10), (64, lambda m: m >= 16), (None, lambda m: m == 0)):
        drafter = _started(HeadDrafter(head, tiny_target, [prompt + ref]), prompt)  # the corpus holds the answer
        rounds = speculative_rounds(tiny_target, _prefilled(tiny_target, prompt), prompt[-1], drafter,
                                    SamplingParams(), lambda: 0, hard_cap=hard_cap)
        out, drafted = [], []
        while len(out) < 40:
            r = next(rounds)
            out += r.tokens
            drafted.append(r.drafted)
        assert out[:40] == ref[:40]
        assert longest(max(drafted)), (hard_cap, drafted)  # no hard cap: a cap of 0 means no drafts


def _prefilled(target, prompt):
    cache = target.make_cache()
    prefill(target, cache, prompt[:-1])
    return cache


def _started(drafter, prompt):
    drafter.start(prompt)
    return drafter


def test_quantised_head_is_lossless(tiny_model_dir, tiny_heads):
    with Engine(str(tiny_model_dir), drafter=str(tiny_heads["dspark_gated"]), drafter_bits=4) as engine:
        bits = engine.call(lambda t: t.heads["dspark"].layers[0].mlp.gate_proj.bits)
        assert bits == 4
        ids = engine.encode(PROMPTS[0])
        base = list(engine.generate(GenerationRequest(ids, max_tokens=30, mode="baseline")))[-1]
        done = list(engine.generate(GenerationRequest(ids, max_tokens=30, mode="dspark")))[-1]
        assert done.token_ids == base.token_ids


def test_confidence_head_ends_the_draft_where_its_estimate_falls(tiny_target, tiny_heads):
    head = load_head(tiny_heads["dspark"], tiny_target)
    prompt = tiny_target.encode(PROMPTS[0])
    drafter, _ = _drafter_after_prefill(tiny_target, head, prompt)
    lengths = {}
    for thr in (0.0, 0.2, 1.0):
        head.cfg.confidence_threshold = thr
        lengths[thr] = len(drafter.propose(16).tokens)
    assert lengths[0.0] == head.max_draft == 7
    assert lengths[1.0] == 0  # no estimate reaches certainty
    assert lengths[0.0] >= lengths[0.2] >= lengths[1.0]


def test_long_prompt_keeps_a_recent_window(tiny_target, tiny_heads):
    """With a context limit, old prefill chunks are dropped and the rest keep their positions:
    the head's keys equal those of a full pass restricted to the window."""
    head = load_head(tiny_heads["dflash"], tiny_target)
    prompt = tiny_target.encode(" ".join(PROMPTS) * 3)
    drafter = HeadDrafter(head, tiny_target, [], lookup_override=False, context_limit=40)
    drafter.start(prompt)
    prefill(tiny_target, tiny_target.make_cache(), prompt[:-1], chunk_size=16,
            on_hidden=drafter.observe_prefill, tap_layers=drafter.tap_layers)
    assert sum(c.shape[0] for c in drafter.prefill_chunks) < 40 + 16
    drafter._flush()
    _, full = tiny_target.forward_tapped(prompt[:-1], tiny_target.make_cache(), drafter.tap_layers)
    start = len(prompt) - 1 - 40
    want = head.context_kv(full[start:], start)
    assert len(drafter.ctx) == 40
    for (k1, v1), (k2, v2) in zip(drafter.ctx.kv, want):
        assert mx.allclose(k1, k2, atol=1e-4) and mx.allclose(v1, v2, atol=1e-4)
