"""The verify-width attention for MLX CUDA (engine/kernels/gpu_attention.py), checked on any
device against MLX's own kernel: the same softmax(q k^T * scale + mask) v for grouped heads,
the causal mask, a batched verify's per-row boolean mask and an additive one; a short prefill
chunk's attention in a bucket. And the prefill chunks that end at multiples of the chunk size
(engine/model/vision.py), so shapes repeat."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import gpu_attention
from engine.model.vision import prefill_chunks


def qkv(B, H, Hk, L, S, D=16, seed=0):
    rng = np.random.default_rng(seed)
    make = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    return make(B, H, L, D), make(B, Hk, S, D), make(B, Hk, S, D)


@pytest.fixture(params=[1, 16, 256], ids=lambda b: f"key_block{b}")
def key_block(request, monkeypatch):
    """Keys as they come (1), padded to the next multiple of 16 (40 -> 48) and of 256: the padding is masked."""
    monkeypatch.setattr(gpu_attention, "KEY_BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("H,Hk", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_equals_mlx_attention(H, Hk, mask, key_block):
    q, k, v = qkv(2, H, Hk, L=7, S=40)
    ours = gpu_attention.attention(q, k, v, 0.25, mask)
    mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(mlx), rtol=1e-5, atol=1e-6)


def test_causal_mask_hides_later_keys(key_block):
    q, k, v = qkv(1, 2, 2, L=3, S=10)
    out = gpu_attention.attention(q, k, v, 0.5, "causal")
    v2 = mx.concatenate([v[:, :, :8], v[:, :, 8:] + 100.0], axis=2)  # keys only the last query sees
    out2 = gpu_attention.attention(q, k, v2, 0.5, "causal")
    np.testing.assert_allclose(np.array(out[:, :, :1]), np.array(out2[:, :, :1]), rtol=1e-6)
    assert not np.allclose(np.array(out[:, :, 2]), np.array(out2[:, :, 2]))


def test_batched_rows_boolean_and_additive_masks(key_block):
    """Rows at their own depths (a batched verify forward's mask), per head and shared."""
    B, H, Hk, L, S = 3, 6, 2, 5, 30
    q, k, v = qkv(B, H, Hk, L, S, seed=1)
    offsets = np.array([25, 10, 3])  # first query's position per row
    see = np.arange(S)[None, None, :] <= offsets[:, None, None] + np.arange(L)[None, :, None]
    boolean = mx.array(see[:, None])  # (B, 1, L, S)
    additive = mx.array(np.where(see, 0.0, -np.inf).astype(np.float32)[:, None])
    per_head = mx.broadcast_to(boolean, (B, H, L, S))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=additive)
    for mask in (boolean, additive, per_head):
        got = gpu_attention.attention(q, k, v, 0.3, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_takes_verify_widths_in_half_precision_only():
    def takes(L, dtype=mx.bfloat16, mask=None, H=8, Hk=2):
        q = mx.zeros((1, H, L, 64), dtype=dtype)
        k = mx.zeros((1, Hk, 100, 64), dtype=dtype)
        return gpu_attention.takes(q, k, mask, None)

    assert takes(4) and takes(gpu_attention.MAX_WIDTH) and takes(17, mx.float16)
    assert takes(2, mask=mx.ones((2, 100), dtype=mx.bool_))  # a batched row: cuDNN takes array masks
    assert not takes(1) and not takes(3)  # MLX's vector kernel: no graph to build
    assert not takes(gpu_attention.MAX_WIDTH + 1)  # a prefill chunk: cuDNN, its shapes repeat
    assert not takes(8, mx.float32)  # cuDNN never takes float32
    q = mx.zeros((1, 8, 8, 64), dtype=mx.bfloat16)
    assert not gpu_attention.takes(q, mx.zeros((1, 2, 9, 64), dtype=mx.bfloat16), None, mx.zeros((8,)))  # sinks


@pytest.mark.parametrize("L,S", [(65, 65), (100, 4100), (130, 5000), (512, 9000)])
def test_a_bucketed_prefill_chunk_equals_mlx_causal_attention(L, S, monkeypatch):
    """Queries padded to a bucket, keys to a multiple of BUCKET_KEYS (small here), an array mask:
    the real rows equal MLX's own causal attention of the chunk, whether the chunk starts the
    prompt (L == S) or extends a cached one."""
    monkeypatch.setattr(gpu_attention, "BUCKET_KEYS", 1024)
    q, k, v = qkv(1, 4, 2, L=L, S=S)
    ours = gpu_attention.bucketed(q, k, v, 0.25, mx.fast.scaled_dot_product_attention)
    mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert ours.shape == mlx.shape
    np.testing.assert_allclose(np.array(ours), np.array(mlx), rtol=1e-4, atol=1e-5)


def test_takes_short_causal_prefill_chunks_in_buckets():
    def takes(L, dtype=mx.bfloat16, mask="causal"):
        q = mx.zeros((1, 8, L, 64), dtype=dtype)
        return gpu_attention.takes_bucketed(q, mx.zeros((1, 2, 9000, 64), dtype=dtype), mask, None)

    assert takes(gpu_attention.MAX_WIDTH + 1) and takes(gpu_attention.BUCKET_QUERIES[-1], mx.float16)
    assert not takes(gpu_attention.MAX_WIDTH)  # a verify forward: the plain ops
    assert not takes(gpu_attention.BUCKET_QUERIES[-1] + 1)  # a long chunk: its own shape (they repeat)
    assert not takes(200, mx.float32) and not takes(200, mask=None)
    assert not takes(200, mask=mx.ones((200, 9000), dtype=mx.bool_))
    for dim, cudnn in ((128, True), (80, True), (256, False), (100, False)):  # cuDNN's head sizes only
        q = mx.zeros((1, 8, 200, dim), dtype=mx.bfloat16)
        assert gpu_attention.takes_bucketed(q, mx.zeros((1, 2, 9000, dim), dtype=mx.bfloat16), "causal", None) is cudnn


def test_build_for_builds_each_bucket_of_each_attention_shape(target, monkeypatch):
    """Every bucket up to the context window, for each (heads, kv heads, head size) the model's
    attention layers have; nothing where the routing isn't installed (off MLX CUDA)."""
    monkeypatch.setattr(gpu_attention, "_original", None)
    assert gpu_attention.build_for(target.model, 9000, mx.bfloat16) == 0
    monkeypatch.setattr(gpu_attention, "_original", mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(gpu_attention, "BUCKET_KEYS", 2048)
    assert gpu_attention.build_for(target.model, 5000, mx.float32) == 0  # cuDNN never takes float32
    assert gpu_attention.build_for(target.model, 5000, mx.bfloat16) == 3 * len(gpu_attention.BUCKET_QUERIES)
    monkeypatch.setattr(gpu_attention, "BUILD_KEYS", 4096)  # no deeper than this
    assert gpu_attention.build_for(target.model, 50000, mx.bfloat16) == 2 * len(gpu_attention.BUCKET_QUERIES)
    assert gpu_attention._causal_bias.cache_info().currsize == 0  # the deepest mask not kept


@pytest.mark.parametrize("long_lived", [True, False])
def test_a_long_lived_engine_builds_the_graphs_at_its_start(tiny_model_dir, monkeypatch, long_lived):
    """serve and mcp (long-lived) build the buckets' graphs at the start, for the engine's own
    context window; a one-shot engine (generate, benchmark) doesn't spend that time."""
    from engine import Engine

    calls = []
    monkeypatch.setattr(gpu_attention, "build_for", lambda *a: calls.append(a) or 0)
    with Engine(str(tiny_model_dir), context_window=1000, prefix_cache=False, long_lived=long_lived) as engine:
        engine.encode("warm")
        assert [(window, dtype) for _, window, dtype in calls] == ([(1000, mx.float32)] if long_lived else [])


def test_a_long_lived_engine_on_cuda_runs_a_warm_turns_forwards_at_its_start(tiny_model_dir, monkeypatch):
    """On MLX CUDA, which readies each kernel the first time a process runs it, serve's and
    mcp's engine runs one forward of each width a warm turn runs, last at its start, on a
    scratch cache: the prefix cache holds none of it and the first request decodes as without."""
    import engine.engine as engine_module
    from engine import Engine, GenerationRequest
    from engine.base.events import Done
    from engine.decoding.verify import WARM_WIDTHS
    from engine.model.target import Target

    widths, forward = [], Target.forward
    monkeypatch.setattr(Target, "forward", lambda self, tokens, *a: widths.append(len(tokens)) or forward(self, tokens, *a))
    prompt = list(range(5, 70))

    def first_reply(engine):
        return next(ev for ev in engine.generate(GenerationRequest(prompt, max_tokens=12)) if isinstance(ev, Done)).token_ids

    start, replies = {}, {}
    for cuda in (False, True):
        monkeypatch.setattr(engine_module, "on_cuda", lambda: cuda)
        widths.clear()
        # a fixed draft cap, batch and chunk: no measurement at the start runs forwards of its own
        with Engine(str(tiny_model_dir), max_draft=4, max_batch=1, prefill_chunk=64, long_lived=True) as engine:
            start[cuda] = list(widths)
            assert engine.cached_prefix_tokens([0] * 1000) == 0
            replies[cuda] = first_reply(engine)
    warm = list(WARM_WIDTHS)  # (attention_crossover's probe at load runs before them, once a process)
    assert start[True][-len(warm):] == warm and start[False][-len(warm):] != warm
    with Engine(str(tiny_model_dir), max_draft=4, max_batch=1, prefill_chunk=64, prefix_cache=False) as plain:
        assert replies[True] == replies[False] == first_reply(plain)


def test_the_warm_widths_take_each_kernel_a_warm_turn_takes():
    """A decode step, 2 rows (MLX's quantized kernel), narrow_qmm's rows, a chunk in each bucket
    and past wide_dequantize's threshold, at the default thresholds: moving one moves these."""
    from engine.decoding.verify import WARM_WIDTHS
    from engine.kernels import narrow_qmm, wide_dequantize

    assert {1, 2} <= set(WARM_WIDTHS)
    assert any(narrow_qmm.FASTER_FROM <= w <= narrow_qmm.MAX_ROWS for w in WARM_WIDTHS)
    for low, high in zip((gpu_attention.MAX_WIDTH, *gpu_attention.BUCKET_QUERIES), gpu_attention.BUCKET_QUERIES):
        assert any(low < w <= high for w in WARM_WIDTHS), (low, high)
    assert max(WARM_WIDTHS) >= wide_dequantize.MIN_ROWS


def test_not_installed_off_cuda():
    if gpu_attention.wanted():
        pytest.skip("this machine runs MLX CUDA")
    assert gpu_attention.install() is False
    assert mx.fast.scaled_dot_product_attention is not gpu_attention._routed


@pytest.mark.parametrize("depth", [0, 5, 8, 13])
def test_prefill_chunks_end_at_multiples_of_the_size(depth):
    chunks = prefill_chunks(30, 8, depth=depth)
    assert chunks[0][0] == 0 and chunks[-1][1] == 30
    assert all(a == b for (_, a), (b, _) in zip(chunks, chunks[1:]))  # contiguous
    assert all((depth + stop) % 8 == 0 for _, stop in chunks[:-1])
    assert all(0 < stop - start <= 8 for start, stop in chunks)


@pytest.mark.parametrize("depth", [0, 5, 13, 15])
def test_a_prefill_that_fits_in_one_chunk_is_one(depth):
    """A warm turn's few tokens stay one forward even where they cross a multiple of the size."""
    assert prefill_chunks(8, 8, depth=depth) == [(0, 8)]
    assert prefill_chunks(5, 8, depth=depth) == [(0, 5)]
    assert prefill_chunks(0, 8, depth=depth) == []
