"""Speculative sampling keeps the target's distribution exactly.

Each check is a chi-square test at a 0.1% false-alarm rate over thousands of draws,
with fixed seeds (so a run is reproducible); a wrong acceptance rule (accepting
drafts too often, or sampling the wrong residual) fails them by a wide margin.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine import Engine, GenerationRequest, SamplingParams
from engine.base.sampling import accept_speculative, target_probs
from stats_util import chi_square_fits


def _dirichlet(rng, k, v, alpha=0.7):
    return rng.dirichlet([alpha] * v, size=k)


@pytest.mark.parametrize("one_hot", [True, False])
def test_acceptance_rule_preserves_distribution(one_hot):
    rng = np.random.default_rng(7)
    V, k, draws = 6, 3, 20000
    p = _dirichlet(rng, k + 1, V)
    q = None if one_hot else _dirichlet(rng, k, V)
    first = np.zeros(V)
    second_given_accept = np.zeros(V)
    for _ in range(draws):
        if one_hot:
            draft = [2, 4, 1]  # a fixed, deterministic draft (as lookup proposes)
        else:
            draft = [int(rng.choice(V, p=q[i])) for i in range(k)]
        n, nxt = accept_speculative(p, draft, q, rng)
        emitted = draft[:n] + [nxt]
        first[emitted[0]] += 1
        if one_hot and n >= 1:
            second_given_accept[emitted[1]] += 1
    ok, stat, crit = chi_square_fits(first, p[0])
    assert ok, f"first token: chi2 {stat:.1f} > {crit:.1f}"
    if one_hot:
        ok, stat, crit = chi_square_fits(second_given_accept, p[1])
        assert ok, f"second token after an accepted draft: chi2 {stat:.1f} > {crit:.1f}"


def test_wrong_rule_is_detected():
    """The test has power: always accepting the draft is caught."""
    rng = np.random.default_rng(3)
    p = _dirichlet(rng, 2, 6)
    counts = np.zeros(6)
    counts[2] = 5000  # what 'accept every draft' would produce for draft [2]
    assert not chi_square_fits(counts, p[0])[0]


def _exact_two_token_distribution(engine: Engine, prompt: list[int], params: SamplingParams):
    """P(t1, t2) of the target under `params`, by enumerating t1's support."""

    def run(target):
        cache = make_prompt_cache(target.model)
        p1 = target_probs(target.forward(prompt, cache), params)[-1]
        joint = np.zeros((len(p1), len(p1)))
        for t1 in np.nonzero(p1)[0]:
            c = make_prompt_cache(target.model)
            p2 = target_probs(target.forward(prompt + [int(t1)], c), params)[-1]
            joint[t1] = p1[t1] * p2
        return joint

    return engine.call(run)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 4, 1.0), (0.8, 6, 0.8)])
def test_engine_sampling_matches_target(tiny_engine, temperature, top_k, top_p):
    engine = tiny_engine
    prompt = engine.render_chat([{"role": "user", "content": "Re-emit: for i in range(10): print(i)"}])
    check_engine_sampling(engine, prompt, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))


def check_engine_sampling(engine: Engine, prompt: list[int], params: SamplingParams, seeds: int = 1500) -> None:
    """The engine's first two sampled tokens, drafted by lookup, fit the target's exact
    joint distribution (chi-square). Also used for other model families."""
    joint = _exact_two_token_distribution(engine, prompt, params)
    support = np.argwhere(joint > 0)
    assert len(support) <= 64, "keep the support small so the test has power"
    # Draft the most likely pair every time (a corpus that repeats prompt + that pair),
    # so accepts and rejects both happen often at both positions.
    t1, t2 = np.unravel_index(np.argmax(joint), joint.shape)
    corpus = [prompt + [int(t1), int(t2), int(t1)]]
    counts = np.zeros_like(joint)
    drafted = 0
    for seed in range(seeds):
        req = GenerationRequest(
            prompt, max_tokens=2, mode="lookup", max_draft=4, corpus=corpus,
            sampling=SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed),
        )
        done = list(engine.generate(req))[-1]
        if len(done.token_ids) < 2:
            continue  # ended by EOS: not part of the (t1, t2) table
        counts[done.token_ids[0], done.token_ids[1]] += 1
        drafted += done.stats.drafted_tokens
    assert drafted > seeds * 2 // 3, "drafts were not exercised"
    # Condition on 'no EOS' by renormalising over pairs that are not EOS-terminated.
    eos = list(engine.target.eos_token_ids)
    joint[eos, :] = 0
    ok, stat, crit = chi_square_fits(counts[support[:, 0], support[:, 1]], joint[support[:, 0], support[:, 1]])
    assert ok, f"chi2 {stat:.1f} > {crit:.1f}"
