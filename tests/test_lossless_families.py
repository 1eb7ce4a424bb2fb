"""Lossless drafting on the model families agents run: hybrid (Gated DeltaNet, Mamba 2,
short conv), sliding-window and MoE targets.

Each family is a tiny random model built from mlx-lm's own model class (one or two
layers of each kind, a 16-token sliding window). Greedy lookup decoding must equal
mlx-lm's generate_step token for token with drafts accepted in full (the corpus holds
the reference output), rejected at every position (corpora corrupted at one place
each, or every few tokens), and prompts on both sides of the window so that rounds
cross it; and drafting must really happen (more than 2 tokens a round on the copy).
"""

from __future__ import annotations

import random

import pytest

from engine import Engine, GenerationRequest, SamplingParams
from test_lossless import corrupt, lookup_ids, mlx_lm_greedy
from test_sampling import check_engine_sampling
from tiny_models import FAMILIES, WINDOW, build_family_model, family_installed

MAX_TOKENS = 32
CAP = 16


@pytest.fixture(scope="module", params=[f for f in FAMILIES if family_installed(f)])
def family_engine(request, tmp_path_factory):
    path = build_family_model(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    with Engine(str(path)) as e:
        e.target.state_rollback = "capture"  # recurrent layers: per-position capture (replay: test_state_capture.py)
        yield request.param, e


def _prompts(engine: Engine) -> list[list[int]]:
    rng = random.Random(99)
    vocab = engine.target.vocab_size
    pattern = [rng.randrange(vocab) for _ in range(7)]
    return [
        [rng.randrange(vocab) for _ in range(9)],  # inside the window: drafts cross it
        [rng.randrange(vocab) for _ in range(2 * WINDOW + 3)],  # past the window
        (pattern * 10)[:45],  # repeats: the context itself drafts
    ]


def test_greedy_equals_mlx_lm(family_engine):
    family, engine = family_engine
    vocab = engine.target.vocab_size
    for i, prompt in enumerate(_prompts(engine)):
        ref = mlx_lm_greedy(engine, prompt, MAX_TOKENS)
        ids, stats = lookup_ids(engine, prompt, CAP, [prompt + ref], max_tokens=MAX_TOKENS)
        assert ids == ref, f"{family} prompt {i}: copy"
        if len(ref) >= 8:
            assert stats.generated_tokens / stats.rounds > 2, f"{family} prompt {i}: drafting did not happen"
        corpora = [corrupt(prompt + ref, every, vocab) for every in (3, 7)]
        for bad in (0, 1, 2, 4, 8, 15):  # a draft rejected at each of these positions
            if bad < len(ref):
                wrong = list(ref)
                wrong[bad] = (wrong[bad] + 1) % vocab
                corpora.append(prompt + wrong)
        for j, corpus in enumerate(corpora):
            for cap in (CAP, 3):
                ids, _ = lookup_ids(engine, prompt, cap, [corpus], max_tokens=MAX_TOKENS)
                assert ids == ref, f"{family} prompt {i}, corpus {j}, cap {cap}"


def test_baseline_equals_mlx_lm(family_engine):
    _, engine = family_engine
    prompt = _prompts(engine)[1]
    done = list(engine.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mode="baseline")))[-1]
    assert done.token_ids == mlx_lm_greedy(engine, prompt, MAX_TOKENS)


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_sampling_matches_target(family, tmp_path):
    """Chi-square on a hybrid and on a sliding-window family, prompt past the window."""
    if not family_installed(family):
        pytest.skip(f"mlx-lm has no {family}")
    path = build_family_model(tmp_path / family, family, seed=7, scale=2.0)
    with Engine(str(path)) as engine:
        rng = random.Random(3)
        prompt = [rng.randrange(engine.target.vocab_size) for _ in range(WINDOW + 5)]
        check_engine_sampling(engine, prompt, SamplingParams(temperature=1.0, top_k=4), seeds=1200)


def test_prefix_cache_on_off_diverged(family_engine):
    """A fresh engine with the prefix cache gives mlx-lm's tokens on a first turn, an
    appended turn (resumed at the last turn's end), a reply that diverges (resumed at
    the previous prompt's end) and a prompt diverging inside the first turn."""
    family, reference = family_engine
    rng = random.Random(7)
    vocab = reference.target.vocab_size

    def soup(n):
        return [rng.randrange(vocab) for _ in range(n)]

    with Engine(reference.model_path) as e:
        assert e.cache_stats()["kind"] == ("segments" if family in ("qwen3_moe", "glm4_moe") else "checkpoint")

        def turn(prompt, cap):
            ids, stats = lookup_ids(e, prompt, cap, max_tokens=12)
            assert ids == mlx_lm_greedy(reference, prompt, 12), f"{family}: {len(prompt)}-token prompt"
            return ids, stats.cached_tokens

        turn1 = soup(2 * WINDOW + 4)
        out1, cached = turn(turn1, 8)  # a last round drafted past max_tokens is taken back
        assert cached == 0
        turn2 = turn1 + out1 + soup(6)
        _, cached = turn(turn2, 8)
        assert cached >= len(turn1) + len(out1) - 1  # the first turn's end
        other = turn1 + soup(9)  # another reply to the first prompt
        _, cached = turn(other, 0)
        assert cached >= len(turn1) - 1  # the first prompt's end: the checkpoint before the divergence
        _, cached = turn(turn1[:20] + soup(5), 8)
        assert cached in (0, 20)  # before every checkpoint (segment models reuse the 20 tokens)
        _, cached = turn(turn2, 4)  # the second turn again, after all that
        assert cached == len(turn2) - 1


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss"])
def test_heads_tap_hybrid_and_sliding_targets(family, tmp_path):
    """Drafter heads read these models' residual stream from the verify forward itself,
    and decode losslessly with rejected head drafts taken back (replay, window trims)."""
    if not family_installed(family):
        pytest.skip(f"mlx-lm has no {family}")
    import json

    import mlx.core as mx

    from engine.drafting.heads.export import dflash_config, random_head_checkpoint
    from engine.model.target import load_target

    path = build_family_model(tmp_path / family, family, seed=5)
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    head = random_head_checkpoint(tmp_path / "dflash", dflash_config(
        config, mask_token_id=0, target_layer_ids=[0, 1], block_size=8), seed=1)
    target = load_target(path)
    a, b = target.make_cache(), target.make_cache()
    ids = list(range(3, 30))
    logits, hidden = target.forward_tapped(ids, b, (-1, 0, 1))
    assert mx.allclose(target.forward(ids, a), logits, atol=1e-5)
    assert hidden.shape == (len(ids), 3 * target.hidden_size)
    with Engine(str(path), drafter=str(head)) as engine:
        for prompt in _prompts(engine)[:2]:
            ref = mlx_lm_greedy(engine, prompt, MAX_TOKENS)
            done = list(engine.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mode="dflash", max_draft=8)))[-1]
            assert done.token_ids == ref
            assert done.stats.drafted_tokens > 0
