"""The persistent batched KV store (engine/caches/batch_cache.py): rows at different depths verify
ragged drafts (a 17-token verbatim copy among short ones) in one forward and give what each
sequence gets alone; drafts rejected by different amounts per row roll each row back to its
own length; a sequence leaves mid-batch (the last row moves into its slot) and another joins;
a row runs alone exactly as a KVCache; the engine joins each sequence once and the prefix
cache gets its KV. Model: a tiny random qwen3 (real MLX forwards, real engine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, GenerationRequest
from engine.caches.batch_cache import GROW_TOKENS, BatchCache, RowCache
from engine.decoding.batch_verify import Forward, choose_batch, run_forwards
from engine.caches.kv_segments import fresh_cache
from engine.caches.rollback import mark, take_back

from greedy_ties import argmax_equal_away_from_ties, assert_same_greedy_away_from_ties
from test_batch_cost import synthetic


def prefilled(target, tokens):
    cache = fresh_cache(target, None)
    target.forward(tokens, cache)
    mx.eval([c.state for c in cache])
    return cache


def close(a, b, tol=2e-4):
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)))) < tol


def test_ragged_rows_verify_together_roll_back_apart_and_leave(target):
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(0, target.vocab_size, size=n).tolist()  # noqa: E731
    contexts = [draw(n) for n in (3, 40, GROW_TOKENS + 30)]  # the last one makes the buffers grow
    alone = [prefilled(target, c) for c in contexts]
    rows = [prefilled(target, c) for c in contexts]
    store = BatchCache()
    for c in rows:
        store.join(c)
    assert all(isinstance(layer, RowCache) for c in rows for layer in c)
    assert [c[0].offset for c in rows] == [len(x) for x in contexts]
    widths = [(1, 5, 17), (3, 1, 2), (17, 8, 1), (2, 2, 2), (6, 1, 9)]  # 17: a verbatim copy
    kept = [(1, 3, 0), (0, 1, 2), (17, 4, 1), (2, 0, 1), (5, 1, 3)]  # accepted per row: each its own offset
    for step, (ws, ks) in enumerate(zip(widths, kept)):
        if step == 2:  # the first leaves mid-batch (the last row moves into its slot); a new one joins
            store.leave(rows[0])
            assert store.used == 2 and rows[2][0].slot == 0 and type(rows[0][0]).__name__ == "KVCache"
            assert close(rows[0][0].keys[..., : rows[0][0].offset, :], alone[0][0].keys[..., : alone[0][0].offset, :])
            newcomer = draw(70)
            rows[0], alone[0] = prefilled(target, newcomer), prefilled(target, newcomer)
            store.join(rows[0])
            assert rows[0][0].slot == 2
        drafts = [draw(w) for w in ws]
        marks = [(mark(r), mark(a)) for r, a in zip(rows, alone)]
        forwards = [Forward(d, r) for d, r in zip(drafts, rows)]
        assert run_forwards(target, forwards) == 3  # one batched forward
        for f, d, a, k, (mr, ma) in zip(forwards, drafts, alone, ks, marks):
            ref = target.forward(d, a)
            assert f.result[0].shape == ref.shape
            assert close(f.result[0], ref)
            assert argmax_equal_away_from_ties(f.result[0], ref)  # batched and alone: float32 rounding apart
            assert f.picks() == mx.argmax(f.result[0], axis=-1).tolist()  # read for every row at once
            take_back(f.cache, mr, len(d), k, replay=None)
            take_back(a, ma, len(d), k, replay=None)
        assert [r[0].offset for r in rows] == [a[0].offset for a in alone]
    lengths = [a[0].offset for a in alone]
    for r in rows:
        store.leave(r)
    assert store.used == 0 and store.keys == []  # an empty batch gives its memory back
    for r, a, n in zip(rows, alone, lengths):
        assert r[0].offset == n
        for lr, la in zip(r, a):
            assert close(lr.keys[..., :n, :], la.keys[..., :n, :]) and close(lr.values[..., :n, :], la.values[..., :n, :])


def test_a_row_alone_is_a_kvcache(target):
    """A forward the scheduler doesn't batch runs on its row alone: bit for bit a KVCache's."""
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, target.vocab_size, size=n).tolist() for n in (12, 30)]
    rows = [prefilled(target, c) for c in contexts]
    plain = prefilled(target, contexts[1])
    store = BatchCache()
    for c in rows:
        store.join(c)
    for draft in ([5, 6, 7], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]):
        f = Forward(draft, rows[1])
        run_forwards(target, [f], synthetic(lambda b: 1.0))  # batching pays nothing: alone
        assert mx.array_equal(f.result[0], target.forward(draft, plain))
        assert rows[1][0].offset == plain[0].offset and rows[0][0].offset == 12  # the other row untouched
        take_back(rows[1], [c.offset - len(draft) for c in rows[1]], len(draft), 1, replay=None)
        plain_marks = [c.offset - len(draft) for c in plain]
        take_back(plain, plain_marks, len(draft), 1, replay=None)


def test_taps_are_batched_per_row(target):
    """Drafter heads' hidden-state taps come out of the batched forward per row."""
    rng = np.random.default_rng(2)
    contexts = [rng.integers(0, target.vocab_size, size=n).tolist() for n in (9, 33)]
    rows, alone = [prefilled(target, c) for c in contexts], [prefilled(target, c) for c in contexts]
    store = BatchCache()
    for c in rows:
        store.join(c)
    taps = (-1, 0)
    drafts = [[3, 4], [5, 6, 7, 8, 9]]
    forwards = [Forward(d, r, taps) for d, r in zip(drafts, rows)]
    run_forwards(target, forwards)
    for f, d, a in zip(forwards, drafts, alone):
        logits, hidden = target.forward_tapped(d, a, taps)
        assert close(f.result[0], logits) and close(f.result[1], hidden)


def test_verbatim_copies_wider_than_the_surface_join_the_batch():
    fw = lambda *widths: [Forward(list(range(w)), []) for w in widths]  # noqa: E731
    widths = lambda fs: sorted(len(f.tokens) for f in fs)  # noqa: E731
    everywhere = synthetic(widest=32)  # batching pays at every measured width, up to 32
    assert everywhere.is_batched(33) and not synthetic(widest=8).is_batched(15)
    assert widths(choose_batch(fw(17, 33, 30), everywhere)) == [17, 30, 33]
    # four rows in the batch: rows without a forward compute padding, so the batch is priced at 4
    flat = synthetic(lambda b: 1.0, widest=32)  # batching saves nothing: each alone
    assert choose_batch(fw(2, 2), flat, rows=4) == []


def test_a_sequence_decoding_alone_never_joins_the_batch(tiny_engine, tiny_model_dir):
    """One request at a time (an agent's turns): its KV is not copied into a batch row and out
    again; the output is the engine's alone, and the next turn finds its context cached."""
    ids = tiny_engine.encode("def area(w, h):\n    return w * h\n\ndef area(w, h):\n    return")
    expected = tiny_engine.submit(GenerationRequest(ids, max_tokens=30, mode="lookup")).result().token_ids
    with Engine(str(tiny_model_dir), max_batch=4) as engine:
        joins = []
        store = engine._batch
        join = store.join
        store.join = lambda cache, owner=None: (joins.append(owner), join(cache, owner))[1]
        first = engine.submit(GenerationRequest(ids, max_tokens=30, mode="lookup")).result()
        again = engine.submit(GenerationRequest(ids + first.token_ids, max_tokens=5, mode="lookup")).result()
        assert_same_greedy_away_from_ties(tiny_engine, ids, expected, first.token_ids)
        assert joins == [] and store.used == 0 and engine.load()["batched_rounds"] == 0
        assert again.stats.cached_tokens >= len(ids) + len(first.token_ids) - 1


def test_engine_joins_each_sequence_once_and_the_prefix_cache_gets_its_kv(tiny_engine, tiny_model_dir):
    prompts = ["a b c a b c a b c a b", "The quick brown fox " * 8, " ".join(f"v{i} = {i % 5}" for i in range(30))]
    ids = [tiny_engine.encode(p) for p in prompts]
    expected = [tiny_engine.submit(GenerationRequest(i, max_tokens=30, mode="lookup")).result().token_ids for i in ids]
    with Engine(str(tiny_model_dir), max_batch=3, prefill_chunk=16) as engine:
        joins, leaves = [], []
        store = engine._batch
        join, leave = store.join, store.leave
        store.join = lambda cache, owner=None: (joins.append(owner), join(cache, owner))[1]
        store.leave = lambda cache: (leaves.append(1), leave(cache))[1]
        jobs = [engine.submit(GenerationRequest(i, max_tokens=30, mode="lookup")) for i in ids]
        done = [j.result() for j in jobs]
        for i, want, d in zip(ids, expected, done):  # batched vs alone: other kernels' rounding
            assert_same_greedy_away_from_ties(tiny_engine, i, want, d.token_ids)
        assert engine.load()["batched_rounds"] > 0
        # once each at most (not per round; one that decoded alone never joined), out as often
        assert 2 <= len(joins) <= 3 and len(set(map(id, joins))) == len(joins)
        assert len(leaves) == len(joins) and store.used == 0
        # the next turn of each conversation finds its whole context in the prefix cache
        for i, d in zip(ids, done):
            follow = i + d.token_ids + tiny_engine.encode(" and then")
            again = engine.submit(GenerationRequest(follow, max_tokens=10, mode="lookup")).result()
            assert again.stats.cached_tokens >= len(i) + len(d.token_ids) - 1
            fresh = tiny_engine.submit(GenerationRequest(follow, max_tokens=10, mode="lookup")).result().token_ids
            assert_same_greedy_away_from_ties(tiny_engine, follow, fresh, again.token_ids)


def test_cancelled_or_failed_sequences_give_their_rows_back(tiny_model_dir, target):
    with Engine(str(tiny_model_dir), max_batch=2, prefix_cache=False) as engine:
        ids = engine.encode("one two three one two three one two")
        # long enough that neither ends before it is cancelled: long drafts of a loop end 200 tokens
        # in a few rounds, and the reader may trail the engine by a few
        jobs = [engine.submit(GenerationRequest(ids, max_tokens=2000, mode="lookup")) for _ in range(2)]
        for j in jobs:
            next(ev for ev in j if type(ev).__name__ == "Tokens")  # both decode, batched
        assert engine.call(lambda t: engine._batch.used) == 2
        for j in jobs:
            j.cancel()
            assert j.result().finish_reason == "cancelled"
        assert engine.call(lambda t: engine._batch.used) == 0
    # a job that ended without leaving (an error mid-round): the scheduler drops its row by owner
    store = BatchCache()
    rows = [prefilled(target, [1, 2, 3]), prefilled(target, [4, 5])]
    owners = [object(), object()]
    for owner, c in zip(owners, rows):
        store.join(c, owner=owner)
    store.drop(owners[0])
    assert store.used == 1 and rows[1][0].slot == 0 and rows[0][0].store is None


def _unfit(self, target, forwards, width=None):
    raise TypeError("this model's attention takes no per-row offsets")


def _no_room(self, cache, owner=None):
    raise MemoryError("no room for the batch's buffers")


@pytest.mark.parametrize("method,fails,why", [("forward", _unfit, "per-row offsets"), ("join", _no_room, "no room")],
                         ids=["forward", "join"])
def test_a_batch_that_fails_leaves_the_sequences_running_alone(tiny_engine, tiny_model_dir, monkeypatch,
                                                                method, fails, why):
    """A model the batched forward doesn't fit, or a join without room (out of memory, say): the
    engine goes on, every sequence runs alone with the output it would have had, the batch is
    marked failed, and the next request is served."""
    monkeypatch.setattr(BatchCache, method, fails)
    ids = [tiny_engine.encode(p) for p in ("a b c a b c a b c a b", "The quick brown fox " * 8)]
    expected = [tiny_engine.submit(GenerationRequest(i, max_tokens=20, mode="lookup")).result().token_ids for i in ids]
    with Engine(str(tiny_model_dir), max_batch=2, prefix_cache=False) as engine:
        jobs = [engine.submit(GenerationRequest(i, max_tokens=20, mode="lookup")) for i in ids]
        for i, want, j in zip(ids, expected, jobs):
            assert_same_greedy_away_from_ties(tiny_engine, i, want, j.result().token_ids)
        assert engine.load()["batched_rounds"] == 0 and why in engine._batch.failed
        again = engine.submit(GenerationRequest(ids[0], max_tokens=5, mode="lookup")).result()
        assert again.finish_reason in ("length", "stop")


def test_a_batched_forward_pads_to_a_width_measured_no_dearer(target):
    """Where 4 rows of 3 tokens measured slower than 4 rows of 4 (the measured cell is capped to
    the wider one's time), the batched forward runs 4 tokens wide: each row's logits and KV are
    what the 3-wide forward gives, and nothing past a row's length is read afterwards."""
    from engine.tuning.batch_cost import BatchSurface

    widths = [1, 2, 3, 4, 8]
    raw = {1: [1.0, 1.1, 1.2, 1.3, 1.6], 4: [2.0, 2.2, 3.5, 2.6, 3.2]}  # 4 rows: width 3 slower than 4
    capped = {b: [min(row[i:]) for i in range(len(row))] for b, row in raw.items()}
    surface = BatchSurface([1, 4], widths, [capped[1], capped[4]])
    assert surface.padded_width(4, 3) == 4 and surface.padded_width(4, 2) == 2 and surface.padded_width(4, 4) == 4
    assert surface.padded_width(1, 3) == 3 and surface.padded_width(4, 5) == 5  # alone; unmeasured: as is
    assert surface.step_seconds(4, 3) == surface.step_seconds(4, 4)

    rng = np.random.default_rng(5)
    contexts = [rng.integers(0, target.vocab_size, size=n).tolist() for n in (7, 20, 33, 50)]
    drafts = [[1, 2, 3], [4], [5, 6], [7, 8, 9]]
    results = {}
    for width in (None, 4):
        rows = [prefilled(target, c) for c in contexts]
        store = BatchCache()
        for c in rows:
            store.join(c)
        forwards = [Forward(d, c) for d, c in zip(drafts, rows)]
        store.forward(target, forwards, width)
        after = [Forward([9], c) for c in rows]  # the next round reads only what each row holds
        store.forward(target, after)
        results[width] = ([f.result[0] for f in forwards + after], [c[0].offset for c in rows])
    (plain, offsets), (padded, padded_offsets) = results[None], results[4]
    assert offsets == padded_offsets == [n + len(d) + 1 for n, d in zip((7, 20, 33, 50), drafts)]
    assert all(mx.allclose(a, b, atol=2e-4) for a, b in zip(plain, padded))
