"""Issue 35 item 4: the roofline's bandwidth probe reads the memory as decoding does (all
cores, or the GPU, over a buffer far larger than the caches), so its plain-decode ceiling is
never under a measured plain decode.

A plain decode step reads the weights and the KV cache at its depth; doing that N times a
second proves the memory delivers (weights + KV) x N bytes per second. So the probe must read
at least that fast on any machine: the bundled model's step is measured by the same code
`doctor` uses (engine/tuning/cost_curve.py), and the comparison is a physical lower bound,
not a timing threshold."""

from __future__ import annotations

import pytest

from engine.base.bundled import REFERENCE_MODEL_DIR
from engine.base.platform import physical_memory_bytes
from engine.tuning import roofline as rl
from engine.tuning.cost_curve import measure_cost_curve

DEPTH = 256


@pytest.fixture(scope="module")
def bundled():
    from engine.model.target import load_target

    return load_target(REFERENCE_MODEL_DIR)


def test_probe_reads_a_buffer_far_beyond_the_caches():
    size = rl.probe_bytes()
    cap = rl.PROBE_MEMORY_SHARE * (physical_memory_bytes() or 8 << 30)
    assert size % (rl.PROBE_COLUMNS * 4) == 0
    assert size >= min(cap, rl.PROBE_CACHE_MULTIPLE * rl.last_level_cache_bytes()) - rl.PROBE_COLUMNS * 4
    assert size >= min(cap, 256 << 20) - rl.PROBE_COLUMNS * 4
    assert size > rl.last_level_cache_bytes() and size <= cap


def test_last_level_cache_is_a_cache_size():
    assert (1 << 20) <= rl.last_level_cache_bytes() <= (4 << 30)


def test_probe_reads_at_least_what_a_plain_decode_reads(bundled):
    curve = measure_cost_curve(bundled, widths=(1, 2), depths=(DEPTH,), repeats=3)
    step = curve.step_seconds(1, DEPTH)
    read_per_token = rl.model_bytes(bundled) + rl.kv_bytes_per_position(bundled) * DEPTH
    decode_reads = read_per_token / step  # bytes per second a plain decode demonstrably streams
    probe = rl.measure_bandwidth()
    assert probe >= decode_reads, (probe / 1e9, decode_reads / 1e9)
    report = rl.roofline(bundled, curve, bandwidth=probe)
    assert report["bandwidth_source"] == "probe"
    at = report["by_depth"][str(DEPTH)]
    assert at["ceiling_tok_s"] >= at["plain_tok_s"], report
    assert report["plain_decode_ceiling_tok_s"] >= at["plain_tok_s"], report


def test_a_probe_that_reads_less_never_puts_the_ceiling_under_the_measurement(bundled):
    # a probe disturbed by other work: the measured step still bounds the bandwidth from below
    curve = measure_cost_curve(bundled, widths=(1, 2), depths=(DEPTH,), repeats=1)
    report = rl.roofline(bundled, curve, bandwidth=1e6)
    at = report["by_depth"][str(DEPTH)]
    assert report["bandwidth_probe_gb_s"] == 0.0 and report["bandwidth_source"] != "probe"
    assert at["ceiling_tok_s"] >= at["plain_tok_s"] * 0.999, report


def test_kv_bytes_per_position_of_the_bundled_model(bundled):
    c = bundled.config  # float32 on CPU: keys and values of each layer's KV heads
    expected = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * (4 if bundled.dtype == "float32" else 2)
    assert rl.kv_bytes_per_position(bundled) == expected
