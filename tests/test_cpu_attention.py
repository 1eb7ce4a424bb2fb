"""Blockwise CPU prefill attention: equal to MLX's kernel to float32 rounding, routed only
where it is exact, and greedy output identical to plain mlx-lm at 1k, 8k and 16k+ tokens."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine import Engine, GenerationRequest
from engine.kernels import cpu_attention
from engine.kernels import cpu_swiglu
from engine.kernels import attention_crossover as crossover_mod
from engine.tuning import attention_tune as tune_mod
from engine.kernels import native
from greedy_ties import argmax_equal_away_from_ties, assert_same_greedy_away_from_ties
from tiny_models import build_tiny_model


@pytest.fixture(params=["compiled", "numpy"])
def softmax_step(request, monkeypatch):
    """Both ways of a work item: cpu_kernels.c's loop, and numpy's passes."""
    if request.param == "numpy":
        monkeypatch.setattr(cpu_attention, "_kernel", False)
    elif cpu_attention._compiled() is None:
        pytest.skip("no C compiler here")
    return request.param


def test_compiled_kernel_is_used_where_a_compiler_is():
    if native.compiler() is None or os.environ.get("MLX_DSPARK_NATIVE") == "0":
        pytest.skip("no C compiler here, or kernels turned off")
    assert cpu_attention._compiled() is not None


def mlx_sdpa(q, k, v, scale, mask):
    with cpu_attention.disabled():
        return np.array(mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(k), mx.array(v), scale=scale, mask=mask))


@pytest.mark.parametrize("hq,hkv,L,S,d", [
    (4, 2, 100, 100, 16),     # a first chunk
    (6, 2, 300, 1300, 64),    # a chunk after a cached prefix, GQA 3:1
    (4, 4, 513, 1537, 32),    # no grouping, sizes off the block grid
    (8, 1, 70, 5000, 8),      # many heads on one kv head, many key blocks
])
@pytest.mark.parametrize("mask", ["causal", None])
@pytest.mark.parametrize("spread", [2, 20])  # 20: most exps underflow, as in peaked attention
def test_kernel_equals_mlx(hq, hkv, L, S, d, mask, spread, softmax_step):
    rng = np.random.default_rng(hq * L + S)
    q = rng.standard_normal((2, hq, L, d), dtype=np.float32)
    k = rng.standard_normal((2, hkv, S, d), dtype=np.float32) * spread
    v = rng.standard_normal((2, hkv, S, d), dtype=np.float32)
    ref = mlx_sdpa(q, k, v, d**-0.5, mask)
    exact = attention_f64(q, k, v, d**-0.5, mask)
    for threads in (1, 2):
        out = cpu_attention.attention(q, k, v, d**-0.5, causal=mask is not None, threads=threads)
        if spread == 2:
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
        else:  # peaked: scores of +-100 leave float32 rounding visible; as near the truth as MLX
            assert np.abs(out - exact).max() <= 2 * np.abs(ref - exact).max() + 1e-6


def attention_f64(q, k, v, scale, mask):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    if mask is not None:
        L, S = scores.shape[-2:]
        scores[..., np.arange(S)[None, :] > np.arange(S - L, S)[:, None]] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.fixture
def routed():
    """The blockwise path installed for every chunk wide enough, restored after."""
    was = cpu_attention._min_keys, cpu_attention._original is not None
    cpu_attention.install(0)
    calls = []
    real = cpu_attention.attention

    def counting(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    cpu_attention.attention = counting
    yield calls
    cpu_attention.attention = real
    cpu_attention.set_crossover(was[0])
    if not was[1]:
        cpu_attention.uninstall()


def test_routing_takes_only_what_it_computes_exactly(routed):
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 4, 80, 16), dtype=np.float32))
    k = mx.array(rng.standard_normal((1, 2, 200, 16), dtype=np.float32))
    v = mx.array(rng.standard_normal((1, 2, 200, 16), dtype=np.float32))
    ref = mlx_sdpa(np.array(q), np.array(k), np.array(v), 0.25, "causal")
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert len(routed) == 1
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=2e-6)
    # MLX's kernel for: array masks (sliding windows), sinks, other dtypes, verify-sized chunks.
    window = mx.array(np.tril(np.ones((80, 200), dtype=bool), k=120))
    others = [
        dict(q=q, k=k, v=v, mask=window),
        dict(q=q, k=k, v=v, mask="causal", sinks=mx.zeros((4,))),
        dict(q=q.astype(mx.bfloat16), k=k.astype(mx.bfloat16), v=v.astype(mx.bfloat16), mask="causal"),
        dict(q=q[:, :, :64], k=k, v=v, mask="causal"),
    ]
    for o in others:
        mx.eval(mx.fast.scaled_dot_product_attention(o.pop("q"), o.pop("k"), o.pop("v"), scale=0.25, **o))
    assert len(routed) == 1
    with cpu_attention.disabled():
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal"))
    assert len(routed) == 1
    cpu_attention.set_crossover(201)  # below the crossover: MLX's
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal"))
    assert len(routed) == 1


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-long"), arch="qwen3", seed=3,
                            context=20000)


def mlx_lm_greedy(engine, prompt, max_tokens):
    """Plain mlx-lm on MLX's own attention kernel: the reference."""

    def run(target):
        out = []
        with cpu_attention.disabled():
            for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), target.model,
                                        max_tokens=max_tokens, sampler=make_sampler(temp=0.0),
                                        prompt_cache=make_prompt_cache(target.model),
                                        prefill_step_size=512):
                if tok in target.eos_token_ids:
                    break
                out.append(int(tok))
        return out

    return engine.call(run)


@pytest.mark.slow
@pytest.mark.parametrize("length", [1000, 8000, 16500])
def test_greedy_equals_mlx_lm_at_depth(long_model, routed, length):
    rng = np.random.default_rng(length)
    with Engine(str(long_model), prefix_cache=False, prefill_chunk=512) as engine:
        cpu_attention.install(0)  # loading installed the measured/default crossover
        vocab = engine.call(lambda t: t.vocab_size)
        prompt = rng.integers(0, vocab, size=length).tolist()
        ref = mlx_lm_greedy(engine, prompt, 16)
        assert not routed
        for mode in ("baseline", "lookup"):
            done = list(engine.generate(GenerationRequest(prompt, max_tokens=16, mode=mode)))[-1]
            # our kernel vs MLX's: float32 rounding apart, so equal away from near-ties
            assert_same_greedy_away_from_ties(engine, prompt, ref, done.token_ids)
        full_chunks = (length - 1) // 512  # chunks of 512 queries (the tail may be under 65)
        # 2 modes x 1 layer: every full chunk took it, in all layers but the last (unread in a prefill)
        assert len(routed) >= 2 * 1 * full_chunks


def test_logits_agree_to_float32_rounding(tiny_model_dir, routed):
    """A chunk after a cached prefix (the causal offset), through the whole model."""
    with Engine(str(tiny_model_dir), prefix_cache=False) as engine:
        cpu_attention.install(0)

        def logits(target, on):
            rng = np.random.default_rng(1)
            ids = rng.integers(0, target.vocab_size, size=700).tolist()
            cache = target.make_cache()
            with cpu_attention.disabled():
                target.forward(ids[:300], cache)
            if on:
                out = target.forward(ids[300:], cache)
            else:
                with cpu_attention.disabled():
                    out = target.forward(ids[300:], cache)
            return np.array(out.astype(mx.float32))

        ours = engine.call(lambda t: logits(t, True))
        assert routed
        ref = engine.call(lambda t: logits(t, False))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert argmax_equal_away_from_ties(mx.array(ours), mx.array(ref))


def test_crossover_cache_is_keyed(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path))
    from engine import load_target

    target = load_target(tiny_model_dir)
    key = crossover_mod.crossover_key(target)
    assert key["shape"] == [4, 2, 16, 16]  # seen from the model's own attention calls
    assert "cpu:" in key["device"]
    found = crossover_mod.crossover_for(target)
    assert not found.measured and found.min_keys == crossover_mod.DEFAULT_MIN_KEYS
    measured = tune_mod.measure_crossover(key["shape"], key=key, key_counts=(256, 512), chunk=128, repeats=1)
    path = tune_mod.save_crossover(measured)
    assert crossover_mod.crossover_for(target) == measured
    # Another BLAS, MLX or attention shape is another file; a file with a stale key is ignored.
    for change in ({"device": key["device"] + "x"}, {"mlx": "0.0"}, {"shape": [8, 2, 16, 16]}):
        assert crossover_mod.crossover_path({**key, **change}) != path
    data = json.loads(path.read_text())
    data["key"]["mlx"] = "0.0"
    path.write_text(json.dumps(data))
    assert not crossover_mod.crossover_for(target).measured


def test_prefill_leaves_the_unread_last_attention_to_mlx(tiny_model_dir, routed):
    """A cache-filling chunk computes every layer's attention but the last (whose output nothing
    reads, so MLX never evaluates it), and the cache it leaves equals a full forward's."""
    from engine import load_target
    from engine.decoding.verify import prefill

    target = load_target(tiny_model_dir)
    cpu_attention.set_crossover(0)  # load_target installed the default crossover
    ids = np.random.default_rng(1).integers(0, target.vocab_size, size=300).tolist()
    layers = len(target.make_cache())
    ref = target.make_cache()
    with cpu_attention.disabled():
        mx.eval(target.forward(ids, ref))
    cache = target.make_cache()
    swiglu_calls = []
    real_swiglu = cpu_swiglu.swiglu
    cpu_swiglu.swiglu = lambda *a, **k: swiglu_calls.append(1) or real_swiglu(*a, **k)
    try:
        prefill(target, cache, ids, chunk_size=150)
    finally:
        cpu_swiglu.swiglu = real_swiglu
    assert len(routed) == 2 * (layers - 1)
    if cpu_swiglu._swiglu_kernel() is not None:  # nor the last layer's MLP, which that would force
        assert len(swiglu_calls) == 2 * (layers - 1)
    for a, b in zip(cache, ref):
        assert a.offset == b.offset == 300
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_allclose(np.array(x[..., :300, :]), np.array(y[..., :300, :]), rtol=1e-4, atol=1e-4)
    routed.clear()
    mx.eval(target.forward(ids[:100], target.make_cache()))  # a forward whose outputs are read
    assert len(routed) == layers


def test_tapped_prefill_leaves_the_unread_last_attention_to_mlx_unless_it_is_tapped(tiny_model_dir, routed):
    """A drafter's prefill (hidden states tapped) skips the last layer's attention as a plain one
    does when no tap reads that layer, and gives the same taps and caches; tapping it computes it."""
    from engine import load_target
    from engine.decoding.verify import prefill

    target = load_target(tiny_model_dir)
    cpu_attention.set_crossover(0)
    ids = np.random.default_rng(2).integers(0, target.vocab_size, size=300).tolist()
    layers = len(target.make_cache())
    for taps, calls in (((0,), layers - 1), ((0, layers - 1), layers)):
        ref = target.make_cache()
        with cpu_attention.disabled():
            _, want = target.forward_tapped(ids, ref, taps)
            mx.eval(want)
        routed.clear()
        cache, got = target.make_cache(), []
        prefill(target, cache, ids, chunk_size=150, tap_layers=taps, on_hidden=got.append)
        assert len(routed) == 2 * calls
        np.testing.assert_allclose(np.array(mx.concatenate(got)), np.array(want), rtol=1e-4, atol=1e-4)
        for a, b in zip(cache, ref):
            assert a.offset == b.offset == 300
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                np.testing.assert_allclose(np.array(x[..., :300, :]), np.array(y[..., :300, :]), rtol=1e-4, atol=1e-4)


def batch_mask(starts, L, S, window=None):
    """A batched verify forward's mask (engine/caches/batch_cache.py): row b's query i sees keys
    0..starts[b] + i (within `window` of it)."""
    key = np.arange(S)[None, None, None, :]
    query = np.asarray(starts)[:, None, None, None] + np.arange(L)[None, None, :, None]
    mask = key <= query
    return mask if window is None else mask & (key > query - window)


def test_row_offsets_reads_a_causal_mask_per_row_and_nothing_else():
    starts = [10, 3, 0, 12]
    assert cpu_attention.row_offsets(batch_mask(starts, 5, 17), 4, 5, 17).tolist() == starts
    assert cpu_attention.row_offsets(batch_mask([12], 5, 17), 4, 5, 17).tolist() == [12] * 4  # broadcast
    assert cpu_attention.row_offsets(np.tril(np.ones((5, 17), bool), k=12), 2, 5, 17).tolist() == [12, 12]
    assert cpu_attention.row_offsets(batch_mask(starts, 5, 17, window=4), 4, 5, 17) is None  # a window
    padded = batch_mask(starts, 5, 17)
    padded[1, 0, :, 0] = False  # left padding
    assert cpu_attention.row_offsets(padded, 4, 5, 17) is None
    by_head = np.repeat(batch_mask(starts, 5, 17), 2, axis=1)
    assert cpu_attention.row_offsets(by_head, 4, 5, 17) is None


def test_verify_forwards_take_this_path_on_the_engine_thread_only(routed):
    """Decode and verify forwards of MIN_TOKENS tokens or more (no mask, "causal", a batched
    forward's mask causal per row) go through the kernel on the engine's thread, equal to MLX's
    to float32 rounding; off it, narrower ones, and other masks: MLX's kernel."""
    rng = np.random.default_rng(1)
    starts = [40, 33, 20, 47]
    q = rng.standard_normal((4, 6, 17, 16), dtype=np.float32)
    k = rng.standard_normal((4, 2, 64, 16), dtype=np.float32) * 3
    v = rng.standard_normal((4, 2, 64, 16), dtype=np.float32)
    cases = [(q, k, v, mx.array(batch_mask(starts, 17, 64))), (q[:1], k[:1], v[:1], "causal"),
             (q[:1, :, :8], k[:1], v[:1], None), (q[:, :, :2], k, v, mx.array(batch_mask(starts, 2, 64)))]
    for a, b, c, mask in cases:
        mx.eval(mx.fast.scaled_dot_product_attention(mx.array(a), mx.array(b), mx.array(c), scale=0.25, mask=mask))
    assert routed == []  # off the engine thread
    with cpu_attention.engine_thread():
        for a, b, c, mask in cases:
            out = mx.fast.scaled_dot_product_attention(mx.array(a), mx.array(b), mx.array(c), scale=0.25, mask=mask)
            np.testing.assert_allclose(np.array(out), mlx_sdpa(a, b, c, 0.25, mask), rtol=1e-5, atol=2e-6)
        assert len(routed) == 4
        for width in (1, cpu_attention.MIN_TOKENS - 1):  # a decode step, a short draft: MLX's (no sync)
            mx.eval(mx.fast.scaled_dot_product_attention(mx.array(q[:1, :, :width]), mx.array(k[:1]),
                                                         mx.array(v[:1]), scale=0.25, mask="causal"))
        assert len(routed) == 4
        window = mx.array(batch_mask(starts, 17, 64, window=8))
        out = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, mask=window)
        np.testing.assert_allclose(np.array(out), mlx_sdpa(q, k, v, 0.25, window), rtol=1e-5, atol=2e-6)
    assert len(routed) == 4  # the window went to MLX's kernel


def test_a_row_of_a_batched_forward_equals_it_alone():
    """A row of a batch (more keys, masked, and padded queries) equals it alone: bitwise where the
    kernel makes the same BLAS calls (the whole row: the same rows and keys), to float32 rounding
    where it doesn't (a narrower row: OpenBLAS picks its sgemm kernel by shape and CPU). A row
    that saw one key too many, or another row's keys, is off by 0.08 or more."""
    if cpu_attention._compiled() is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(2)
    starts, L, S = [30, 11, 50], 9, 59
    q = rng.standard_normal((3, 4, L, 16), dtype=np.float32)
    k = rng.standard_normal((3, 2, S, 16), dtype=np.float32)
    v = rng.standard_normal((3, 2, S, 16), dtype=np.float32)
    together = cpu_attention.attention(q, k, v, 0.25, causal=True, offsets=np.array(starts))
    # one C call for every row and head (small, one thread) or a work item each: the same steps
    assert np.array_equal(together, cpu_attention.attention(q, k, v, 0.25, causal=True, offsets=np.array(starts),
                                                            threads=2))
    for b, start in enumerate(starts):
        for width in (L, 3):
            alone = cpu_attention.attention(q[b : b + 1, :, :width], k[b : b + 1, :, : start + width],
                                            v[b : b + 1, :, : start + width], 0.25, causal=True)
            if width == L:
                assert np.array_equal(alone[0], together[b, :, :width])
            else:
                np.testing.assert_allclose(alone[0], together[b, :, :width], rtol=1e-5, atol=1e-6)
