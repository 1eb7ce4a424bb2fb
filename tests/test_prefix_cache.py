"""Prefix cache: the same greedy tokens with it as without it, in every way a prompt can reuse KV."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from engine import Engine, GenerationRequest
from engine.caches.radix_tree import RadixTree
from greedy_ties import assert_same_greedy_away_from_ties
from tiny_models import build_tiny_model

# -- the radix tree alone (payloads are plain lists standing for KV segments) -----------


def make_tree() -> RadixTree:
    return RadixTree(cut=lambda p, a, b: p[a:b], size=len, seed=b"m")


def used(path):
    return [(node.tokens, k) for node, k in path]


def test_tree_longest_match_and_split():
    t = make_tree()
    t.insert([1, 2, 3, 4, 5], lambda a, b: list("abcde")[a:b])
    assert used(t.match([1, 2, 3, 9])) == [([1, 2, 3, 4, 5], 3)]  # diverges mid-edge
    assert used(t.match([7])) == []
    t.insert([1, 2, 3, 8], lambda a, b: list("abcX")[a:b])  # splits the edge after 3 tokens
    assert [n.tokens for n in t.root.children.values()] == [[1, 2, 3]]
    upper = t.root.children[1]
    assert upper.payload == list("abc")
    assert {tuple(n.tokens): n.payload for n in upper.children.values()} == {(4, 5): list("de"), (8,): ["X"]}
    assert used(t.match([1, 2, 3, 4, 5, 6])) == [([1, 2, 3], 3), ([4, 5], 2)]
    assert t.n_tokens == 6 and t.nbytes == 6 and t.n_nodes == 3
    # the key of a position doesn't depend on how edges are cut
    other = make_tree()
    other.insert([1, 2, 3, 4, 5], lambda a, b: list("abcde")[a:b])
    assert other.root.children[1].key == upper.children[4].key
    # a prefix of a cached edge adds nothing
    t.insert([1, 2], lambda a, b: pytest.fail("nothing new to cache"))
    assert t.n_nodes == 3


def test_tree_lru_evicts_leaves_and_respects_pins():
    t = make_tree()
    a = t.insert([1, 2, 3], lambda x, y: [0] * (y - x))
    b = t.insert([1, 2, 4], lambda x, y: [0] * (y - x))
    c = t.insert([5, 6], lambda x, y: [0] * (y - x))
    assert t.lru_leaf() is a[-1]  # least recently used; inner node [1, 2] is no leaf
    t.touch([a[-1]])
    assert t.lru_leaf() is b[-1]
    assert t.lru_leaf(pinned={b[-1]}) is c[-1]
    t.remove_leaf(b[-1])
    t.remove_leaf(a[-1])
    assert b[0].tokens == [1, 2] and t.lru_leaf(pinned={c[-1]}) is b[0]  # [1, 2] became a leaf
    assert t.n_tokens == 4


# -- the engine with and without the cache ------------------------------------------------


def rand_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 380) for _ in range(n)]


def gen(engine: Engine, prompt: list[int], mode: str = "baseline", n: int = 12):
    done = engine.submit(GenerationRequest(prompt, max_tokens=n, mode=mode)).result()
    return done.token_ids, done.stats


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    yield engine
    engine.close()


def same(cached: Engine, plain: Engine, prompt: list[int], mode: str = "baseline") -> int:
    """Generate with both; assert equal tokens; return the cached-token count."""
    got, stats = gen(cached, prompt, mode)
    want, _ = gen(plain, prompt, mode)
    assert_same_greedy_away_from_ties(plain, prompt, want, got)  # a cached prefix: other chunk shapes
    assert stats.cached_tokens + stats.prefilled_tokens == len(prompt)
    return stats.cached_tokens


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_append_only_turns(tiny_model_dir, plain, mode):
    with Engine(str(tiny_model_dir), prefill_chunk=64) as e:
        prompt = rand_tokens(300, 1)
        assert same(e, plain, prompt, mode) == 0
        for turn in range(3):
            out, _ = gen(e, prompt, mode)
            prompt = prompt + out + rand_tokens(40, 10 + turn)
            assert same(e, plain, prompt, mode) >= len(prompt) - 40 - 1
        s = e.cache_stats()
        assert s["hits"] >= 3 and s["entries"] >= 1 and s["bytes_per_token"] > 0
        assert e.info()["prefix_cache"]["kind"] == "segments"


def test_divergence_and_interleaved_branches(tiny_model_dir, plain):
    with Engine(str(tiny_model_dir)) as e:
        base = rand_tokens(200, 2)
        a = base + rand_tokens(60, 3)
        b = base[:150] + rand_tokens(80, 4)  # diverges inside the cached edge
        assert same(e, plain, a) == 0
        assert same(e, plain, b) == 150
        a2 = a + rand_tokens(30, 5)
        b2 = b + rand_tokens(30, 6)
        for prompt, want in ((a2, len(a)), (b2, len(b)), (a2, len(a2) - 1), (b2, len(b2) - 1)):
            assert same(e, plain, prompt, "lookup") >= want
        assert same(e, plain, rand_tokens(50, 7)) == 0  # a stranger
        # same prompt again: everything but the last token is reused
        assert same(e, plain, a) == len(a) - 1


def test_eviction_under_tiny_budget_and_disk_restart(tiny_model_dir, plain, tmp_path):
    prompts = [rand_tokens(250, 20 + i) for i in range(3)]
    # 250 tokens of this model's KV are ~128 KB: a 0.2 MB budget holds about one prompt
    with Engine(str(tiny_model_dir), prefix_cache_max_ram_mb=0.2, prefix_cache_dir=tmp_path) as e:
        for p in prompts:
            same(e, plain, p)
        s = e.cache_stats()
        assert s["evictions"] >= 1 and s["ram_bytes"] <= 0.2 * (1 << 20)
        assert s["disk_files"] >= 1
        # evicted prefixes come back from disk
        assert same(e, plain, prompts[0] + rand_tokens(20, 30)) == 250
        assert same(e, plain, prompts[2] + rand_tokens(20, 31), "lookup") == 250
    with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e2:  # a restart
        assert e2.cache_stats()["disk_files"] >= 3
        for i, p in enumerate(prompts):
            assert same(e2, plain, p + rand_tokens(15, 40 + i)) == 250
        assert e2.cache_stats()["disk_loads"] >= 3


def test_eviction_without_disk(tiny_model_dir, plain):
    with Engine(str(tiny_model_dir), prefix_cache_max_ram_mb=0.1) as e:
        prompts = [rand_tokens(150, 50 + i) for i in range(3)]  # ~83 KB of KV with the output
        for p in prompts:
            same(e, plain, p)
        assert e.cache_stats()["evictions"] >= 2
        assert same(e, plain, prompts[0] + [17, 18]) == 0  # gone, prefilled again, still right
        assert same(e, plain, prompts[0] + [17, 18, 19]) == 152


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    # head_dim 32: the smallest that KV quantisation (groups of 32) takes
    return build_tiny_model(tmp_path_factory.mktemp("tiny-wide"), arch="qwen3", seed=3, hidden=128)


def test_kv_bits(wide_model_dir, tmp_path):
    with Engine(str(wide_model_dir), prefix_cache=False, kv_bits=8) as plain8, \
            Engine(str(wide_model_dir), kv_bits=8, prefix_cache_dir=tmp_path) as e8, \
            Engine(str(wide_model_dir)) as full:
        prompt = rand_tokens(300, 60)
        same(e8, plain8, prompt)
        gen(full, prompt)
        p2 = prompt[:200] + rand_tokens(50, 61)
        assert same(e8, plain8, p2, "lookup") == 200
        quantised, unquantised = e8.cache_stats()["bytes_per_token"], full.cache_stats()["bytes_per_token"]
        assert 0 < quantised < unquantised / 3  # 8 bits + scales against float32
    with Engine(str(wide_model_dir), kv_bits=8, prefix_cache_dir=tmp_path) as again, \
            Engine(str(wide_model_dir), prefix_cache=False, kv_bits=8) as plain8:
        assert same(again, plain8, p2 + [30]) == len(p2)
    with Engine(str(wide_model_dir), kv_bits=4, prefix_cache_dir=tmp_path) as four:
        assert four.cache_stats()["disk_files"] == 0  # another identity: the 8-bit files aren't its
    with pytest.raises(ValueError, match="kv_bits"):
        Engine(str(wide_model_dir), kv_bits=3)


def _written(tiny_model_dir, cache_dir, prompts, plain) -> list[Path]:
    with Engine(str(tiny_model_dir), prefix_cache_dir=cache_dir) as e:
        for p in prompts:
            same(e, plain, p)
    files = sorted(Path(cache_dir).rglob("*.safetensors"))
    assert files
    return files


def test_corrupt_and_truncated_files_are_skipped(tiny_model_dir, plain, tmp_path, caplog):
    prompts = [rand_tokens(200, 70), rand_tokens(200, 71)]
    files = _written(tiny_model_dir, tmp_path, prompts, plain)
    by_first = {}
    from engine.caches.kv_disk import read_tokens

    for f in files:
        by_first[read_tokens(f)[0]] = f
    corrupt, truncated = by_first[prompts[0][0]], by_first[prompts[1][0]]
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in the KV data: loads fine, must not be trusted
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="engine"):
        with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e:
            assert same(e, plain, prompts[0] + [20, 21]) == 0
            assert same(e, plain, prompts[1] + [20, 21]) == 0
            assert e.cache_stats()["disk_skipped"] == 2
    assert sum("skipping" in r.message for r in caplog.records) == 2
    assert not corrupt.exists() and not truncated.exists()


def test_garbage_in_cache_dir(tiny_model_dir, plain, tmp_path):
    files = _written(tiny_model_dir, tmp_path, [rand_tokens(120, 80)], plain)
    folder = files[0].parent
    # a file named like ours whose header is noise, and one that isn't safetensors at all
    (folder / f"{files[0].name.split('_')[0]}_{'0' * 32}_{'1' * 32}.safetensors").write_bytes(b"\xff" * 64)
    (folder / "notes.txt").write_text("hello")
    with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e:
        assert same(e, plain, rand_tokens(120, 80) + [9]) == 120


def test_disk_cap_is_enforced(tiny_model_dir, plain, tmp_path):
    cap_mb = 0.3
    with Engine(str(tiny_model_dir), prefix_cache_max_ram_mb=0.1, prefix_cache_dir=tmp_path,
                prefix_cache_max_disk_mb=cap_mb) as e:
        prompts = [rand_tokens(200, 90 + i) for i in range(6)]  # ~100 KB of KV each
        for p in prompts:
            same(e, plain, p)
        assert same(e, plain, prompts[-1] + [11]) == 200
    total = sum(f.stat().st_size for f in tmp_path.rglob("*.safetensors"))
    assert 0 < total <= cap_mb * (1 << 20)
    with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e:
        assert same(e, plain, prompts[0] + [12]) == 0  # the oldest went first
        assert same(e, plain, prompts[-1] + [12]) == 200


def test_other_models_directory(tiny_model_dir, tiny_llama_dir, plain, tmp_path, caplog):
    files = _written(tiny_model_dir, tmp_path, [rand_tokens(150, 100)], plain)
    prompt = rand_tokens(150, 100) + [5]
    with Engine(str(tiny_llama_dir), prefix_cache=False) as llama_plain:
        with Engine(str(tiny_llama_dir), prefix_cache_dir=tmp_path) as llama:
            assert llama.cache_stats()["disk_files"] == 0
            assert same(llama, llama_plain, prompt) == 0
            # a qwen3 file copied into the llama's folder: its keys can't match (identity seeds
            # them), and even renamed to a matching key its metadata gives it away
            mine = next(p for p in tmp_path.iterdir() if p.name != files[0].parent.name)
            parent = llama.prefix_cache.tree.root.key[:32]
            fake = mine / f"{parent}_{'a' * 32}_{files[0].name.split('_')[2]}"
            fake.write_bytes(files[0].read_bytes())
        with caplog.at_level(logging.WARNING, logger="engine"):
            with Engine(str(tiny_llama_dir), prefix_cache_dir=tmp_path) as llama:
                assert same(llama, llama_plain, prompt) == 150  # its own file, not the fake
                assert same(llama, llama_plain, prompt[:100] + [6, 7]) == 100
    assert files[0].exists()  # another model's file is never deleted by reading


def test_sliding_window_model_uses_checkpoints(tmp_path_factory):
    import json

    d = build_tiny_model(tmp_path_factory.mktemp("tiny-swa"), arch="llama", seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    (d / "config.json").write_text(json.dumps(cfg))
    with Engine(str(d), prefix_cache=False) as plain, Engine(str(d)) as e:
        assert e.cache_stats()["kind"] == "checkpoint"
        prompt = rand_tokens(200, 110)
        assert same(e, plain, prompt) == 0
        out, _ = gen(e, prompt)
        turn2 = prompt + out + rand_tokens(30, 111)
        assert same(e, plain, turn2) >= len(prompt) + len(out) - 1
        assert same(e, plain, prompt[:150] + [8, 9]) == 0  # no checkpoint mid-way: full prefill
        out2, _ = gen(e, turn2)
        turn3 = turn2 + out2 + [10]
        assert same(e, plain, turn3, "lookup") >= len(turn3) - 2


def test_no_prefix_cache_flag(tiny_model_dir):
    import argparse

    from agent_bridge.commands.common import add_engine_args, engine_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--no-prefix-cache"])
    e = engine_from_args(args)
    try:
        assert e.cache_stats() is None
        prompt = rand_tokens(60, 120)
        gen(e, prompt)
        assert gen(e, prompt)[1].cached_tokens == 0
    finally:
        e.close()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-bits", "3"])


def test_cancel_mid_prefill_then_reuse(tiny_model_dir, plain):
    from engine import CancelledError, PrefillProgress

    with Engine(str(tiny_model_dir), prefill_chunk=32) as e:
        base = rand_tokens(300, 130)
        same(e, plain, base)
        prompt = base + rand_tokens(300, 131)
        job = e.submit(GenerationRequest(prompt, max_tokens=8))
        seen = []
        with pytest.raises(CancelledError):
            for ev in job:
                if isinstance(ev, PrefillProgress):
                    seen.append(ev.done)
                    if not job.cancelled:
                        job.cancel()
                        # read after the cancel: the engine can only have gone further, never less far
                        at_cancel = job.prefilled
        assert 300 <= seen[0]  # progress counts the cached part
        assert max(seen) <= at_cancel + 32  # the chunk under way when the cancel came is the last
        assert same(e, plain, prompt) == 300
        assert e.cache_stats()["hits"] == 2
