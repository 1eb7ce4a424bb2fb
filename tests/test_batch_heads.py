"""Drafter heads batched across sequences (engine/drafting/heads/drafter.py `draft_together`): one head
forward and one walk for all rows give each row the draft it makes alone (greedy: the same
tokens, or a first difference at a near-tie of the alone logits; sampled: the same draws from
each row's own generator), rows of different context lengths, positions and caps together; and
the engine's batched runs with heads decode exactly what each sequence decodes alone.
Models: the tiny random qwen3 with random heads in the published layouts (real MLX forwards)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, GenerationRequest, SamplingParams
from engine.drafting.heads import HeadDrafter, load_head
from engine.drafting.heads.drafter import HeadCall, draft_together
from engine.drafting.heads.export import dflash_config, dspark_config, random_head_checkpoint
from engine.model.target import load_target
from engine.decoding.verify import prefill, speculative_rounds

PROMPTS = [
    "def rename_symbol(path, old, new):\n",
    "The quick brown fox jumps over the lazy dog. Please rewrite this file.\n" * 3,
    "x = 1",
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i)\nfor i in range(",
]
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_target(tiny_model_dir)


@pytest.fixture(scope="module")
def heads(tiny_model_dir, tmp_path_factory):
    tc = json.loads((tiny_model_dir / "config.json").read_text())
    root = tmp_path_factory.mktemp("batch_heads")
    return {
        "dspark": random_head_checkpoint(root / "dspark", dspark_config(
            tc, mask_token_id=0, target_layer_ids=[-1, 1], markov_rank=16), seed=2),
        "dspark_gated": random_head_checkpoint(root / "dspark_gated", dspark_config(
            tc, mask_token_id=0, target_layer_ids=[1], markov_rank=8, markov_head_type="gated",
            confidence=False, layers=2), seed=3),
        "dspark_rnn": random_head_checkpoint(root / "dspark_rnn", dspark_config(
            tc, mask_token_id=0, target_layer_ids=[0], markov_rank=8, markov_head_type="rnn"), seed=5),
        "dflash": random_head_checkpoint(root / "dflash", dflash_config(
            tc, mask_token_id=0, target_layer_ids=[0, 1], block_size=8, layers=2), seed=1),
        "dflash2": random_head_checkpoint(root / "dflash2", dflash_config(
            tc, mask_token_id=0, target_layer_ids=[0, 1], block_size=6, version=2), seed=4),
    }


def drafters(target, head, rounds: int):
    """A drafter per prompt after prefill and `rounds` decode rounds (context from both)."""
    out = []
    for text in PROMPTS:
        prompt = target.encode(text)
        d = HeadDrafter(head, target, [], lookup_override=False)
        d.start(prompt)
        cache = target.make_cache()
        prefill(target, cache, prompt[:-1], chunk_size=7, on_hidden=d.observe_prefill, tap_layers=d.tap_layers)
        steps = speculative_rounds(target, cache, prompt[-1], d, SamplingParams(), 3)
        for _ in range(rounds):
            next(steps)
        steps.close()
        out.append(d)
    return out


def step_scores(target, head, row, prefix: list[int]) -> mx.array:
    """What the head chooses draft position len(prefix) from, the row drafted alone after `prefix`:
    its logits (DSpark: with the Markov bias of the previous token; DFlash 2: the selector's
    candidate scores)."""
    i = len(prefix)
    prev = prefix[-1] if prefix else row.anchor
    if head.kind == "dspark":
        embed = head.embed_tokens if "embed_tokens" in head else target.embed
        h = head(embed(head.block([row])), [row.ctx], [row.position])[0]
        rnn = head.cfg.markov_head_type == "rnn"
        state = mx.zeros((1, head.cfg.markov_rank)) if rnn else None
        for j, tok in enumerate([row.anchor, *prefix]):  # the walk up to position i (an rnn's state)
            bias, _, state = head._step(h[j : j + 1], mx.array([tok]), state)
        return (head.base_logits(target, h[i : i + 1]) + bias)[0]
    h, logits = head.block_states(target, [row])
    if "candidate_selector" not in head:
        return logits[0, i]
    sel = head.candidate_selector
    k = min(sel.top_k, logits.shape[-1])
    cands = mx.argpartition(-logits[0, i], k - 1)[:k]
    edges = (sel.predecessor_codebook.weight[prev] * sel.hidden_projection(h[0, i])
             * sel.successor_codebook(cands)).sum(-1)
    return logits[0, i][cands] + edges


def top_two_gap(scores: mx.array) -> float:
    top = mx.sort(scores.astype(mx.float32))[-2:].tolist()
    return top[1] - top[0]


@pytest.mark.parametrize("kind", ["dspark", "dspark_gated", "dspark_rnn", "dflash", "dflash2"])
def test_batched_drafts_equal_each_rows_own(tiny_target, heads, kind):
    """Four rows (contexts of 5 to 60 tokens, positions apart, caps 1 to 16 and one row not
    drafting) in one batched draft: each row's tokens are its own alone, or differ first at a
    near-tie; greedy rows beside sampled ones; and a single row drafts as a batch of one."""
    head = load_head(heads[kind], tiny_target)
    if head.cfg.enable_confidence_head:
        head.cfg.confidence_threshold = 0.02  # drafts of several tokens, cut at different places
    for caps in ([16, 3, 1, 5], [2, 0, 16, 7], [16, 16, 16, 16]):
        # twins: the same sequences, each with new context features pending (from prefill and
        # two rounds), drafting alone and together
        rows, twins = drafters(tiny_target, head, rounds=2), drafters(tiny_target, head, rounds=2)
        alone = [d.propose(c).tokens for d, c in zip(rows, caps)]
        assert len({len(d.tokens) for d in rows}) == len(rows)  # different context lengths
        calls = [d.plan(c) for d, c in zip(twins, caps)]
        assert [isinstance(c, HeadCall) for c in calls] == [c > 0 for c in caps]
        draft_together(tiny_target, [c for c in calls if isinstance(c, HeadCall)])
        together = [d.take(c).tokens if isinstance(c, HeadCall) else c.tokens for d, c in zip(twins, calls)]
        for d, twin, cap in zip(rows, twins, caps):  # the context keys/values projected together
            if cap:
                assert all(mx.allclose(k1, k2, atol=1e-4) and mx.allclose(v1, v2, atol=1e-4)
                           for (k1, v1), (k2, v2) in zip(d.ctx.kv, twin.ctx.kv))
        for d, cap, a, b in zip(rows, caps, alone, together):
            assert len(a) <= cap and len(b) <= cap
            if a != b:  # a batched matmul rounded differently: only at a near-tie
                i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                row = d.plan(cap).row
                row.ctx = d.ctx.kv  # the context it drafted from (nothing new is pending)
                assert top_two_gap(step_scores(tiny_target, head, row, a[:i])) < NEAR_TIE, (kind, caps, a, b)
        assert any(len(t) > 1 for t in together)

    # sampled rows (each its own seeded generator) beside a greedy one: the same draws, the same q
    samplings = [SamplingParams(temperature=1.5, seed=s) for s in (1, 2, 3)] + [SamplingParams()]
    for d, s in zip(rows, samplings):
        d.set_sampling(s)
    alone = [d.propose(6) for d in rows]
    for d, s in zip(rows, samplings):
        d.set_sampling(s)  # the generators start over
    calls = [d.plan(6) for d in rows]
    draft_together(tiny_target, calls)
    together = [d.take(c) for d, c in zip(rows, calls)]
    for s, a, b in zip(samplings, alone, together):
        assert a.tokens == b.tokens
        assert (a.q is None) == (b.q is None) == s.greedy
        if a.q is not None:
            assert np.allclose(a.q, b.q, atol=1e-5)


def test_a_failing_batched_draft_drafts_each_row_alone(tiny_target, heads, monkeypatch):
    head = load_head(heads["dspark"], tiny_target)
    rows = drafters(tiny_target, head, rounds=1)
    alone = [d.propose(4).tokens for d in rows]
    real = type(head).draft_rows

    def only_one_row(self, target, batch):
        if len(batch) > 1:
            raise ValueError("no batch here")
        return real(self, target, batch)

    monkeypatch.setattr(type(head), "draft_rows", only_one_row)
    calls = [d.plan(4) for d in rows]
    draft_together(tiny_target, calls)
    assert [d.take(c).tokens for d, c in zip(rows, calls)] == alone
    # a row whose own draft fails reports its error at take(), the others are unharmed
    monkeypatch.setattr(type(head), "draft_rows", lambda self, target, batch: 1 / 0)
    call = rows[0].plan(4)
    draft_together(tiny_target, [call])
    with pytest.raises(ZeroDivisionError):
        rows[0].take(call)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_engine_batched_with_heads_equals_alone(tiny_model_dir, heads, kind):
    """The real engine and scheduler, max_batch 4: four prompts decode with the head's drafts
    drafted together (batched head drafts counted), token for token what each decodes alone."""
    with Engine(str(tiny_model_dir), drafter=str(heads[kind]), prefix_cache=False, prefill_chunk=16) as engine:
        ids = [engine.encode(p) for p in PROMPTS]
        lengths = [30, 24, 40, 20]
        alone = [engine.submit(GenerationRequest(i, max_tokens=n, mode=kind, max_draft=4)).result()
                 for i, n in zip(ids, lengths)]
        engine.max_batch = 4
        before = engine.batched_drafts
        jobs = [engine.submit(GenerationRequest(i, max_tokens=n, mode=kind, max_draft=4)) for i, n in zip(ids, lengths)]
        together = [j.result() for j in jobs]
        assert engine.batched_drafts > before
        assert [d.token_ids for d in together] == [d.token_ids for d in alone]
        assert sum(d.stats.drafted_tokens for d in together) > 0
        assert engine.load()["running"] == 0
