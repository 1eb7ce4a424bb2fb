"""Quantised targets: lossless against mlx-lm on the same quantised model, and a cost
curve that sees what a quantised verify pass costs.

Tiny random models are quantised by mlx-lm's own converter (4- and 8-bit affine,
mxfp4), kept in float32 where they are not quantised so that the engine (float32 on
CPU) and mlx-lm's own load compute the same thing. The reference is mlx-lm loading
the directory itself and decoding with generate_step.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as mlx_lm_load

from engine import Engine
from engine.tuning.cost_curve import CostCurve, curve_key, measure_cost_curve
from engine.tuning.draft_control import DraftController
from engine.engine import engine_stream
from test_lossless import corrupt, lookup_ids
from tiny_models import WINDOW, build_family_model, build_tiny_model

MAX_TOKENS = 32


@pytest.fixture(autouse=True)
def stay_quantized(monkeypatch):
    """These tests are about quantised compute: a CPU would otherwise run these small models
    on their dequantized weights (engine/model/target.py `dequantize_here`)."""
    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", "0")


def quantise(src, dst, bits: int, mode: str = "affine"):
    from mlx_lm.convert import convert

    convert(str(src), str(dst), quantize=True, q_bits=bits, q_group_size=32, q_mode=mode, dtype="float32")
    return dst


def mlx_lm_reference(engine: Engine, path, prompt: list[int], dequantize: bool = False) -> list[int]:
    """mlx-lm's own load of the quantised directory (its weights dequantized by mlx-lm if
    `dequantize`, in float32), greedy, on the engine's thread."""

    def run(_target):
        model, tokenizer = mlx_lm_load(str(path))
        if dequantize:
            from mlx_lm.utils import dequantize_model

            model = dequantize_model(model)
            model.set_dtype(mx.float32)
        out = []
        for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=MAX_TOKENS,
                                    sampler=make_sampler(temp=0.0), stream=engine_stream()):
            if tok in tokenizer.eos_token_ids:
                break
            out.append(int(tok))
        return out

    return engine.call(run)


CASES = [("qwen3", 4, "affine"), ("qwen3", 8, "affine"), ("qwen3", 4, "mxfp4"),
         ("qwen3_next", 4, "affine"), ("gpt_oss", 8, "affine"), ("lfm2", 4, "mxfp4")]


@pytest.mark.parametrize("family,bits,mode", CASES)
def test_quantised_lookup_equals_mlx_lm(tmp_path, family, bits, mode):
    src = (build_tiny_model(tmp_path / "src", arch="qwen3", seed=2) if family == "qwen3"
           else build_family_model(tmp_path / "src", family, seed=2))
    path = quantise(src, tmp_path / "q", bits, mode)
    with Engine(str(path)) as engine:
        assert engine.target.config.get("quantization", {}).get("bits") == bits
        assert any(k.endswith("scales") for k, _ in tree_flatten(engine.target.model.parameters()))
        vocab = engine.target.vocab_size
        rng = random.Random(bits)
        for plen in (9, 2 * WINDOW + 1):
            prompt = [rng.randrange(vocab) for _ in range(plen)]
            ref = mlx_lm_reference(engine, path, prompt)
            ids, stats = lookup_ids(engine, prompt, 16, [prompt + ref], max_tokens=MAX_TOKENS)
            assert ids == ref
            if len(ref) >= 8:
                assert stats.generated_tokens / stats.rounds > 2
            for every in (3, 7):
                ids, _ = lookup_ids(engine, prompt, 16, [corrupt(prompt + ref, every, vocab)], max_tokens=MAX_TOKENS)
                assert ids == ref, f"corrupted every {every}"


def test_cost_curve_of_a_quantised_hybrid(tmp_path):
    """The curve measures the quantised forward, rollback and replay included (the old
    rollback could not undo a pass on recurrent layers), keyed by the quantisation."""
    path = quantise(build_family_model(tmp_path / "src", "qwen3_next", seed=2), tmp_path / "q", 4)
    with Engine(str(path)) as engine:
        def run(target):
            key = curve_key(target)
            curve = measure_cost_curve(target, widths=(1, 2, 8), depths=(40,), repeats=1, key=key)
            # after measuring, the model still decodes as mlx-lm does from a fresh cache
            return key, curve

        key, curve = engine.call(run)
        assert key["quantization"]["bits"] == 4
        assert curve.measured and len(curve.seconds[0]) == 3
        assert all(s > 0 for s in curve.seconds[0])


def test_unmeasured_quantised_cpu_target_does_not_draft():
    """Without a measured curve, a quantised target on CPU assumes each extra verify
    token costs a whole step (MLX's CPU quantized_matmul doesn't batch), so `auto`
    doesn't draft; float targets keep the usual default."""
    quantised = CostCurve.default({"device": "cpu:x", "quantization": {"bits": 4, "group_size": 64}})
    assert DraftController(quantised, depth=100).cap == 0
    plain = CostCurve.default({"device": "cpu:x", "quantization": None})
    assert DraftController(plain, depth=100).cap > 0


def test_small_quantized_model_runs_dequantized_on_cpu(tmp_path, monkeypatch):
    """On a CPU a small quantised model runs on its dequantized weights (the same values,
    BLAS speed): the target says so, its identity (cache keys) differs from the quantised
    run's, and lookup decoding equals mlx-lm's greedy decoding of the dequantized model."""
    from engine.model.target import load_target

    path = quantise(build_tiny_model(tmp_path / "src", arch="qwen3", seed=2), tmp_path / "q", 8)
    monkeypatch.delenv("MLX_DSPARK_DEQUANTIZE")
    plain = load_target(path)
    assert plain.config["dequantized_from"]["bits"] == 8 and "quantization" not in plain.config
    assert not any(v.dtype == mx.uint32 for _, v in tree_flatten(plain.model.parameters()))
    assert load_target(path, dequantize=False).identity != plain.identity
    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", "0")
    assert load_target(path).config["quantization"]["bits"] == 8
    monkeypatch.delenv("MLX_DSPARK_DEQUANTIZE")

    with Engine(str(path)) as engine:
        rng = random.Random(5)
        prompt = [rng.randrange(engine.target.vocab_size) for _ in range(20)]
        ref = mlx_lm_reference(engine, path, prompt, dequantize=True)
        ids, _ = lookup_ids(engine, prompt, 16, [prompt + ref], max_tokens=MAX_TOKENS)
        assert ids == ref
