"""Warm turns: piece tokenising equals a full encode, the lookup index continued equals one
rebuilt, and the live cache (the last request's KV continued in place) gives the same tokens."""

from __future__ import annotations

import json
import random

import pytest

from engine import Engine, GenerationRequest
from engine.drafting.lookup import ContextIndexCache, TokenIndex
from engine.caches.radix_tree import common_prefix
from engine.base.piece_encoder import PieceEncoder

from test_prefix_cache import gen, rand_tokens, same


def _tokenizer(path):
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(path))


def _bundled_tokenizer():
    from engine.base.bundled import default_model_path

    return _tokenizer(default_model_path())


AWKWARD = ["  two leading spaces", "trailing  \n\n", "\tünïcödé → ✓ 漢字", "", " ", "\n",
           'print("<|im_start|> inside a string")', "x" * 300, "{\"a\": [1, 2]}\r\n", "emoji 🙂\u200b"]


def _conversation(rng: random.Random, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent. " + rng.choice(AWKWARD)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choice(AWKWARD) for _ in range(3))})
        msgs.append({"role": "assistant", "content": rng.choice(AWKWARD) + f" turn {t}"})
    return msgs


@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_piece_encoder_equals_full_encode(which, tiny_model_dir):
    tok = _tokenizer(tiny_model_dir) if which == "tiny" else _bundled_tokenizer()
    enc = PieceEncoder(tok, checks=0)  # no built-in re-check: this test is the check
    assert enc.splitter is not None, "piece tokenising should be on for a ChatML tokenizer"
    rng = random.Random(5)
    for turns in range(1, 12):
        msgs = _conversation(rng, turns)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert enc.encode(text) == list(tok.encode(text, add_special_tokens=False))
    assert enc.hits > enc.misses  # earlier turns' pieces were reused
    # text without any special token, and text that starts or ends on one
    for text in ("plain text only", "<|im_start|>user\nhi", "hi<|im_end|>", "<|im_end|><|im_start|>"):
        assert enc.encode(text) == list(tok.encode(text, add_special_tokens=False))


def test_piece_encoder_on_claude_code_fixture(fixtures_dir):
    from agent_bridge.apis.anthropic_api import parse_request
    from agent_bridge.chat.chat_request import fold_system_messages

    tok = _bundled_tokenizer()
    enc = PieceEncoder(tok, checks=0)
    for line in (fixtures_dir / "claude-code/long-session.jsonl").read_text().splitlines():
        req = parse_request(json.loads(line)["body"], 4096)
        text = tok.apply_chat_template(fold_system_messages(req.messages), tools=req.tools, tokenize=False,
                                       add_generation_prompt=True, **req.template_kwargs)
        assert enc.encode(text) == list(tok.encode(text, add_special_tokens=False))


def test_engine_render_chat_uses_pieces(tiny_model_dir):
    with Engine(str(tiny_model_dir), prefix_cache=False) as e:
        msgs = _conversation(random.Random(1), 4)
        want = list(e.tokenizer.encode(e.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                       tokenize=False), add_special_tokens=False))
        assert e.render_chat(msgs) == want
        more = msgs + [{"role": "user", "content": "more"}]
        assert e.render_chat(more) == list(e.tokenizer.encode(e.tokenizer.apply_chat_template(
            more, add_generation_prompt=True, tokenize=False), add_special_tokens=False))
        assert e._pieces.hits > 0


def _same_index(a: TokenIndex, b: TokenIndex) -> None:
    assert a.tokens == b.tokens
    assert a.heads == b.heads and a.prev == b.prev


def test_token_index_continued_equals_rebuilt():
    rng = random.Random(3)
    contexts = ContextIndexCache()
    prev: list[int] = []
    for step in range(30):
        keep = rng.randrange(0, len(prev) + 1) if prev and rng.random() < 0.5 else len(prev)
        tokens = prev[:keep] + [rng.randrange(0, 6) for _ in range(rng.randrange(0, 80))]
        index = contexts.index_for(tokens)
        _same_index(index, TokenIndex(tokens))
        generated = [rng.randrange(0, 6) for _ in range(rng.randrange(0, 10))]
        index.extend(generated)  # what a drafter commits during the request
        contexts.keep(index)
        prev = tokens + generated
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([5] * 1000 + [1], [5] * 1000 + [2]) == 1000


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    yield engine
    engine.close()


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_live_cache_continues_in_place(tiny_model_dir, plain, mode):
    with Engine(str(tiny_model_dir), prefill_chunk=64) as e:
        prompt = rand_tokens(260, 11)
        assert same(e, plain, prompt, mode) == 0
        for turn in range(3):  # an agent's turns: the reply, then a tool result
            out, _ = gen(e, prompt, mode)
            live = e.prefix_cache.live[1]
            prompt = prompt + out + rand_tokens(30, 20 + turn)
            assert same(e, plain, prompt, mode) >= len(prompt) - 31
            # the same request again, then an extension: each continued the cache object in place
            assert e.prefix_cache.live[1] is live
        # a prompt that diverges inside the live tokens: the live cache is cut back, not copied
        live = e.prefix_cache.live[1]
        cut = prompt[:200] + rand_tokens(25, 40)
        assert same(e, plain, cut, mode) == 200
        assert e.prefix_cache.live[1] is live
        # a stranger, then the old conversation again: served from the tree's segments
        assert same(e, plain, rand_tokens(90, 41), mode) == 0
        assert same(e, plain, prompt + [17, 18], mode) >= len(prompt) - 1 - 30


def test_live_cache_with_quantised_kv(tmp_path_factory):
    from tiny_models import build_tiny_model

    wide = build_tiny_model(tmp_path_factory.mktemp("wide-warm"), arch="qwen3", seed=3, hidden=128)
    with Engine(str(wide), kv_bits=8, prefix_cache=False) as ref, Engine(str(wide), kv_bits=8) as e:
        prompt = rand_tokens(150, 50)
        for turn in range(3):
            got, stats = gen(e, prompt)
            want, _ = gen(ref, prompt)
            assert got == want
            prompt = (prompt + got)[: len(prompt) + 4] + rand_tokens(20, 60 + turn)  # diverges in the reply
        assert stats.cached_tokens > 150


def test_scripts_skip_cleanly_without_fixtures(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for script, args in (("replay_agent.py", ["--fixtures", str(tmp_path / "absent.jsonl")]),
                         ("profile_warm_turn.py", ["--fixture", str(tmp_path / "absent.jsonl")])):
        run = subprocess.run([sys.executable, str(root / "scripts" / script), *args], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "skipped" in run.stdout + run.stderr


def test_the_replay_starts_serve_with_a_window_that_holds_the_session():
    """long-session's 38k tokens overrun the bundled model's 32,768: the replay gives `serve` a
    window that holds them (mlx_lm.server enforces none) instead of failing turn 5 with a 400."""
    import importlib.util
    from pathlib import Path

    from engine.base.bundled import default_model_path

    spec = importlib.util.spec_from_file_location(
        "replay_agent", Path(__file__).resolve().parents[1] / "scripts" / "replay_agent.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    model = str(default_model_path())
    assert replay.session_window(model, [15378, 38182], None) == 40960
    assert replay.session_window(model, [15181, 15539], None) is None  # it fits: serve's own default
    assert replay.session_window(model, [15378, 38182], 65536) == 65536  # given: as given
