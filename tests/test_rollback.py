"""Taking back a rejected draft on sliding-window caches (mlx-lm's RotatingKVCache).

A verify pass of k+1 tokens appends them to the window's buffer; when the draft is
partly rejected, the next round must attend to exactly the keys plain decoding would
have: the kept tokens and the window before them, never a rejected token. Before
engine/caches/rollback.py a draft that pushed the buffer past its window could not be taken
back at all (the request failed), and a prompt longer than the window was decoded
without drafts.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from engine import Engine
from test_lossless import corrupt, lookup_ids, mlx_lm_greedy
from tiny_models import build_tiny_model

WINDOW = 16


@pytest.fixture(scope="module")
def swa_engine(tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-swa"), arch="llama", seed=3,
        extra={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW},
    )
    with Engine(str(path)) as e:
        yield e


def _prompt(engine, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(engine.target.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("bad", [1, 4, 7, 12])
def test_draft_crossing_the_window_rejected_midway(swa_engine, bad):
    """Prompt inside the window, a 16-token draft that crosses it, rejected at `bad`."""
    prompt = _prompt(swa_engine, 10, 10)
    ref = mlx_lm_greedy(swa_engine, prompt, 40)
    wrong = list(ref)
    wrong[bad] = (wrong[bad] + 1) % swa_engine.target.vocab_size
    ids, stats = lookup_ids(swa_engine, prompt, 16, [prompt + wrong])
    assert ids == ref
    assert stats.drafted_tokens >= 16


@pytest.mark.parametrize("plen", [40, 3 * WINDOW + 5])
def test_prompt_longer_than_the_window_drafts(swa_engine, plen):
    """Past the window, drafts are still made, accepted in full or rejected anywhere."""
    prompt = _prompt(swa_engine, plen, plen)
    vocab = swa_engine.target.vocab_size
    ref = mlx_lm_greedy(swa_engine, prompt, 40)
    ids, stats = lookup_ids(swa_engine, prompt, 16, [prompt + ref])
    assert ids == ref
    assert stats.generated_tokens / stats.rounds > 2, "drafting did not happen past the window"
    for every in (3, 5, 13):
        ids, stats = lookup_ids(swa_engine, prompt, 16, [corrupt(prompt + ref, every, vocab)])
        assert ids == ref, f"corrupted every {every}"
        assert stats.drafted_tokens > 0


@pytest.mark.parametrize("before,fed,kept", [(10, 9, 3), (14, 8, 1), (30, 17, 5), (16, 2, 2), (40, 20, 20),
                                             (40, 5, 0), (3, 4, 0)])
def test_window_layer_keeps_exactly_the_kept_tokens(before, fed, kept):
    """Layer level: after feeding `fed` tokens and keeping `kept`, the next token sees
    the same keys (in the same order) as a cache that was fed only the kept ones."""
    from engine.caches.rollback import mark, take_back

    mx.random.seed(before)
    kv = mx.random.normal((1, 1, before + fed + 1, 4))

    def feed(cache, start, end):
        return cache.update_and_fetch(kv[..., start:end, :], kv[..., start:end, :])

    ref = RotatingKVCache(max_size=WINDOW)
    feed(ref, 0, before)
    if kept:
        feed(ref, before, before + kept)
    got = RotatingKVCache(max_size=WINDOW)
    feed(got, 0, before)
    m = mark([got])
    feed(got, before, before + fed)
    take_back([got], m, fed, kept, replay=None)
    assert got.offset == ref.offset
    n = before + kept
    for start, end in ((n, n + 1), (n + 1, n + 4)):  # then decode one token, then verify three
        if end > kv.shape[2]:
            break
        k_ref, _ = feed(ref, start, end)
        k_got, _ = feed(got, start, end)
        want = _in_order(ref, k_ref)[..., -(WINDOW + end - start - 1):, :]
        have = _in_order(got, k_got)[..., -(WINDOW + end - start - 1):, :]
        assert mx.array_equal(want, have).item()


def _in_order(cache, keys):
    """The keys a query attends to, oldest first (a single-token update writes in place)."""
    if keys.shape[2] < cache.max_size or cache._idx >= keys.shape[2]:
        return keys
    return mx.concatenate([keys[..., cache._idx :, :], keys[..., : cache._idx, :]], axis=2)


@pytest.mark.parametrize("before", [5, WINDOW, 3 * WINDOW + 2])
def test_one_token_pass_on_a_window_is_taken_back(before):
    """A one-token update rotates the window's buffer in place; taking it back restores
    exactly what was there (the cost curve undoes width-1 passes this way)."""
    from engine.caches.rollback import mark, take_back

    mx.random.seed(before)
    kv = mx.random.normal((1, 1, before + 2, 4))
    ref, got = RotatingKVCache(max_size=WINDOW), RotatingKVCache(max_size=WINDOW)
    for c in (ref, got):
        for t in range(before):  # one token at a time: the buffer rotates in place
            c.update_and_fetch(kv[..., t : t + 1, :], kv[..., t : t + 1, :])
    m = mark([got])
    got.update_and_fetch(kv[..., before : before + 1, :], kv[..., before : before + 1, :])
    take_back([got], m, 1, 0, replay=None)
    k_ref, _ = ref.update_and_fetch(kv[..., before + 1 :, :], kv[..., before + 1 :, :])
    k_got, _ = got.update_and_fetch(kv[..., before + 1 :, :], kv[..., before + 1 :, :])
    assert got.offset == ref.offset and mx.array_equal(k_ref, k_got).item()
