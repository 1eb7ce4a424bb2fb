"""Prefill chunk chosen by measurement and cached per key; doctor's prefill estimate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine import Engine
from engine.tuning import prefill_chunk as pc
from engine.tuning import prefill_estimate as pe
from engine.tuning.prefill_estimate import matmul_params, predict_prefill, prefill_flops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chunk_is_measured_once_and_keyed(cache_home, target, monkeypatch):
    assert pc.chunk_for(target) == pc.DEFAULT_CHUNK
    monkeypatch.setattr(pc, "CANDIDATES", (64, 128))
    monkeypatch.setattr(pc, "MEASURE_TOKENS", 256)
    found = pc.tune_chunk(target)
    assert found["chunk"] in (64, 128) and set(found["seconds"]) == {"64", "128"}
    assert pc.chunk_for(target) == found["chunk"]
    assert pc.tune_chunk(target)["measured_at"] == found["measured_at"]  # cached, not re-measured
    key = pc.chunk_key(target)
    for change in ({"device": "x"}, {"mlx": "0.0"}, {"model": "other"}, {"dtype": "bfloat16"}):
        assert pc.chunk_path({**key, **change}) != pc.chunk_path(key)
    data = json.loads(pc.chunk_path(key).read_text())
    data["chunk"] = -3  # a damaged file is ignored
    pc.chunk_path(key).write_text(json.dumps(data))
    assert pc.chunk_for(target) == pc.DEFAULT_CHUNK


def test_engine_uses_the_measured_chunk_unless_given(cache_home, tiny_model_dir, target, monkeypatch):
    monkeypatch.setattr(pc, "CANDIDATES", (96,))
    monkeypatch.setattr(pc, "MEASURE_TOKENS", 128)
    pc.tune_chunk(target)
    with Engine(str(tiny_model_dir), prefix_cache=False) as e:
        assert e.prefill_chunk == 96
    with Engine(str(tiny_model_dir), prefix_cache=False, prefill_chunk=40) as e:
        assert e.prefill_chunk == 40


def test_flops_count(target):
    # The tiny qwen3: 2 layers, hidden 64, 4 query heads and 2 kv heads of 16, MLP 128, untied head.
    vocab, h, layers = target.vocab_size, 64, 2
    per_layer = h * 64 + 2 * (h * 32) + 64 * h + 3 * h * 128
    assert matmul_params(target) == layers * per_layer + vocab * h
    # A prefill reads no logits, and the last layer's attention output feeds no cache: of that
    # layer only the key and value projections run.
    f = prefill_flops(target, 100)
    assert f["weights"] == 2 * ((layers - 1) * per_layer + 2 * (h * 32)) * 100
    assert f["attention"] == (layers - 1) * 2 * 4 * (16 + 16) * 100 * 101 / 2


def test_prediction_from_two_chunks_is_near_the_full_run(target):
    from engine.tuning.prefill_chunk import time_prefill

    import numpy as np

    ids = np.random.default_rng(0).integers(0, target.vocab_size, size=2048).tolist()
    time_prefill(target, ids[:256], 256)
    full = min(time_prefill(target, ids, 256) for _ in range(2))
    predicted = predict_prefill(target, 2048, 256)
    assert 0.2 < predicted / full < 5  # a loaded machine: the order, not the digits


def test_random_keys_of_a_prediction_are_in_the_models_dtype(tiny_model_dir):
    """The prediction's random cache is the model's dtype: float32 keys under a bf16 model made its
    attention a float32 one (off cuDNN on an H200: an 8k prefill predicted at 25x its estimate)."""
    from engine.kernels.attention_crossover import attention_calls
    from engine.model.target import load_target

    import mlx.core as mx

    bf16 = load_target(str(tiny_model_dir), dtype="bfloat16")
    cache = pe.filled_cache(bf16, 40, attention_calls(bf16))
    assert all(c.keys.dtype == mx.bfloat16 and c.values.dtype == mx.bfloat16 and c.offset == 40 for c in cache)
    assert pe.predict_prefill(bf16, 96, 32) > 0


def test_matmul_rate_is_timed_in_the_models_dtype(target, monkeypatch):
    """The estimate's rate is MLX's matmul in the dtype the model computes in (a GPU's float32
    1024^3 product runs far under its bf16 prefill); a CPU times its float32 product at 1024."""
    rates = pe.blas_rates("float16", repeats=1)
    assert rates["mlx_dtype"] == "float16" and rates["mlx_n"] == pe.CPU_MATMUL_N and rates["mlx_gflops"] > 0
    asked = []
    monkeypatch.setattr(pe, "blas_rates", lambda dtype: asked.append(dtype) or {**rates, "mlx_dtype": dtype})
    report = pe.prefill_report(target, sizes=(64,), chunk=32)
    assert asked == [target.dtype] and report["mlx_dtype"] == target.dtype


def test_doctor_prints_estimate_beside_measured(tiny_model_dir, cache_home):
    env = {**os.environ, "MLX_DSPARK_CACHE_DIR": str(cache_home)}
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "doctor", "--model", str(tiny_model_dir),
                        "--prefill-tokens", "1024", "--json"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["tokens"]: row for row in json.loads(r.stdout)["prefill"]["sizes"]}
    assert set(rows) == {1024, 8192, 32768}
    assert rows[1024]["measured_s"] > 0 and rows[1024]["estimate_s"] > 0
    assert "measured_s" not in rows[32768] and rows[32768]["predicted_s"] > rows[8192]["predicted_s"]
    text = subprocess.run([sys.executable, "-m", "agent_bridge", "doctor", "--model", str(tiny_model_dir),
                           "--no-roofline"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0 and "MLX's float32 at 1024x1024x1024" in text.stdout, text.stderr
    bad = subprocess.run([sys.executable, "-m", "agent_bridge", "doctor", "--prefill-tokens", "x"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
