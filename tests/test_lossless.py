"""Greedy lookup decoding equals plain mlx-lm greedy decoding, token for token.

The matrix: two architectures (qwen3, llama) x 20 prompts (copy-heavy and not) x
draft caps 1, 4, 16, 64. A random tiny model rarely repeats its prompt, so every
prompt is also run with a corpus that holds the reference output, intact and
corrupted: long drafts are then accepted in full, or rejected at every position.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine import Engine, GenerationRequest
from engine.engine import engine_stream

MAX_TOKENS = 40
CAPS = (1, 4, 16, 64)

CODE = '''def rename_symbol(path, old, new):
    text = open(path).read()
    return text.replace(old, new)


class Engine:
    def __init__(self, model):
        self.model = model
'''


def prompts(engine: Engine) -> list[list[int]]:
    rng = random.Random(1234)
    vocab = engine.target.vocab_size
    chat = [
        "Rename `model` to `target` in this file and re-emit it:\n" + CODE,
        "Re-emit this file unchanged:\n" + CODE,
        "Explain what this does:\n" + CODE[:80],
        "Write a haiku about the sea.",
        "What is 17 * 23?",
        "for i in range(10):\n    print(i, i * i)\n" * 3,
        "Continue: The quick brown fox jumps over the lazy dog. The quick brown",
        "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    ]
    out = [engine.render_chat([{"role": "user", "content": c}]) for c in chat]
    out += [engine.encode(c) for c in chat[:4]]  # raw text, no template
    for n in (1, 2, 7, 33):  # random token soup
        out.append([rng.randrange(vocab) for _ in range(n)])
    for n in (3, 9, 25, 64):  # repeated patterns: lookup drafts a lot
        pattern = [rng.randrange(vocab) for _ in range(n)]
        out.append((pattern * (200 // n + 2))[:200])
    assert len(out) == 20
    return out


def mlx_lm_greedy(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain mlx-lm decoding of the same model: the reference."""

    def run(target):
        out = []
        steps = generate_step(
            mx.array(prompt, dtype=mx.uint32),
            target.model,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=0.0),
            prompt_cache=make_prompt_cache(target.model),
            stream=engine_stream(),
        )
        for tok, _ in steps:
            if tok in target.eos_token_ids:
                break
            out.append(int(tok))
        return out

    return engine.call(run)


def lookup_ids(engine: Engine, prompt, cap, corpus=(), max_tokens=MAX_TOKENS) -> tuple[list[int], object]:
    done = list(engine.generate(GenerationRequest(prompt, max_tokens=max_tokens, mode="lookup", max_draft=cap, corpus=list(corpus))))[-1]
    return done.token_ids, done.stats


def corrupt(seq: list[int], every: int, vocab: int) -> list[int]:
    return [(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(seq)]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engine(request, tiny_model_dir, tiny_llama_dir):
    path = tiny_model_dir if request.param == "qwen3" else tiny_llama_dir
    with Engine(str(path)) as e:
        yield e


def test_greedy_lookup_equals_mlx_lm(engine):
    vocab = engine.target.vocab_size
    accepted_long = 0
    for i, prompt in enumerate(prompts(engine)):
        ref = mlx_lm_greedy(engine, prompt, MAX_TOKENS)
        corpora = [(), [prompt + ref], [corrupt(prompt + ref, 5, vocab)], [corrupt(prompt + ref, 13, vocab)]]
        for cap in CAPS:
            for corpus in corpora:
                ids, stats = lookup_ids(engine, prompt, cap, corpus)
                assert ids == ref, f"prompt {i}, cap {cap}, corpus {len(corpus)}: {ids} != {ref}"
                if stats.accepted_by_position and len(stats.accepted_by_position) >= 8:
                    accepted_long += 1
    assert accepted_long > 0, "no run accepted a draft of 8+ tokens: the matrix did not exercise long drafts"


def test_engine_baseline_equals_mlx_lm(engine):
    for prompt in prompts(engine)[:6]:
        done = list(engine.generate(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mode="baseline")))[-1]
        assert done.token_ids == mlx_lm_greedy(engine, prompt, MAX_TOKENS)
