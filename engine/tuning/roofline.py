"""Roofline: memory bandwidth, the plain-decode ceiling it sets, and what the cost
curve allows a perfect drafter (for `doctor` and the server's /machine)."""

from __future__ import annotations

import time

from engine.base.platform import physical_memory_bytes
from engine.tuning.cost_curve import CostCurve, curve_key, load_cost_curve, measure_cost_curve


# -- roofline ----------------------------------------------------------------------------------


# The probe's buffer: this many times the last-level cache, at least PROBE_MIN_BYTES, and
# at most PROBE_MEMORY_SHARE of the machine's memory (reads from RAM, not from a cache).
PROBE_CACHE_MULTIPLE = 8
PROBE_MIN_BYTES = 256 << 20
PROBE_MEMORY_SHARE = 1 / 8
PROBE_COLUMNS = 4096  # the buffer read as a (rows, 4096) float32 matrix times a vector


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs; macOS sysctl), or 64 MiB where neither says."""
    import glob
    import subprocess

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    if not sizes:
        for key in ("hw.l3cachesize", "hw.l2cachesize"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                break
            if out.isdigit() and int(out) > 0:
                sizes.append(int(out))
    return max(sizes, default=64 << 20)


def probe_bytes() -> int:
    """Bytes the bandwidth probe reads: far beyond the last-level cache, bounded by memory."""
    want = max(PROBE_MIN_BYTES, PROBE_CACHE_MULTIPLE * last_level_cache_bytes())
    cap = int(PROBE_MEMORY_SHARE * (physical_memory_bytes() or 8 << 30))  # unknown: assume 8 GiB
    return max(PROBE_COLUMNS * 4, min(want, cap)) // (PROBE_COLUMNS * 4) * (PROBE_COLUMNS * 4)


def measure_bandwidth(nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second streaming a float32 matrix (`probe_bytes()`) through a matrix-vector
    product, best of `repeats`. A matvec reads every byte once and is memory-bound. On a GPU
    MLX runs it on the device; on a CPU MLX's ops run on one thread, so numpy's BLAS (threaded
    over all cores) reads it: one thread's sum reads a fraction of what decoding gets."""
    import mlx.core as mx

    rows = (nbytes or probe_bytes()) // (PROBE_COLUMNS * 4)
    if mx.default_device().type == mx.gpu:
        a = mx.random.uniform(shape=(rows, PROBE_COLUMNS))
        v = mx.ones((PROBE_COLUMNS,))
        mx.eval(a, v)
        run, size = (lambda: mx.eval(a @ v)), a.nbytes
    else:
        import numpy as np

        a = np.ones((rows, PROBE_COLUMNS), dtype=np.float32)  # written, so its pages are mapped
        v = np.ones(PROBE_COLUMNS, dtype=np.float32)
        run, size = (lambda: a @ v), a.nbytes
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return size / best


def model_bytes(target) -> int:
    from mlx.utils import tree_flatten

    return int(sum(p.nbytes for _, p in tree_flatten(target.model.parameters())))


def kv_bytes_per_position(target) -> int:
    """Bytes of keys and values one context position holds, over the attention layers (from
    the config; layers of other kinds, where `layer_types` names them, hold none)."""
    import mlx.core as mx

    from engine.model.config import text_config

    c = text_config(target.config)
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c.get("hidden_size") or 0) // heads)
    kinds = c.get("layer_types")
    layers = sum("attention" in str(k) for k in kinds) if isinstance(kinds, list) else int(c.get("num_hidden_layers") or 0)
    itemsize = getattr(mx, target.dtype, mx.float32).size
    return 2 * layers * kv_heads * head_dim * itemsize


def roofline(target, curve: CostCurve, bandwidth: float | None = None) -> dict:
    """Memory bandwidth, the plain-decode ceiling it sets for this model, measured plain
    decoding (a width-1 step), and the best speedup the curve allows a perfect drafter.

    A plain step reads the weights and the KV cache at its depth, so the ceiling at a depth is
    bandwidth / (weights + KV). A measured step proves the machine streams at least that many
    bytes per second: where the probe read less (a busy machine, caches), the bandwidth shown
    is the one the measurement implies, so no ceiling sits under a measured speed."""
    probe = measure_bandwidth() if bandwidth is None else bandwidth
    nbytes, per_position = model_bytes(target), kv_bytes_per_position(target)
    read = {depth: nbytes + per_position * depth for depth in curve.depths}
    implied = max((read[d] / curve.step_seconds(1, d) for d in curve.depths), default=0.0) if curve.measured else 0.0
    bw = max(probe, implied)
    depths = {}
    for depth in curve.depths:
        width, speedup = curve.best_perfect_speedup(depth)
        step = curve.step_seconds(1, depth)
        depths[str(depth)] = {
            "plain_step_ms": round(step * 1e3, 3),
            "plain_tok_s": round(1.0 / step, 1),
            "ceiling_tok_s": round(bw / read[depth], 1),
            "cost": {str(w): round(curve.relative(w, depth), 3) for w in (2, 4, 8, 16, 32, 64)},
            "best_width": width,
            "best_speedup_perfect_drafter": round(speedup, 2),
        }
    report = {
        "bandwidth_gb_s": round(bw / 1e9, 2),
        "bandwidth_probe_gb_s": round(probe / 1e9, 2),
        "bandwidth_source": "probe" if probe >= implied else "plain decode (the probe read less)",
        "model_bytes": nbytes,
        "kv_bytes_per_position": per_position,
        "plain_decode_ceiling_tok_s": round(bw / nbytes, 1),
        "curve_measured": curve.measured,
        "curve_measured_at": curve.measured_at,
        "by_depth": depths,
    }
    if curve.rollback:  # recurrent layers: how a draft is taken back, and what each way cost
        depth, plain = curve.depths[0], curve.step_seconds(1, curve.depths[0])
        report["rollback"] = curve.rollback
        report["rollback_cost"] = {
            mode: {str(w): round(curve.for_rollback(mode).step_seconds(w, depth) / plain, 3) for w in (4, 16)}
            for mode in sorted(curve.rollback_seconds)}
    return report


def machine_report(target, kv_bits: int | None = None) -> dict:
    """The roofline for `target` on this machine (for `doctor` and the server's /machine):
    the cached cost curve, else a quick one-depth measurement of a few seconds."""
    curve = load_cost_curve(curve_key(target, kv_bits))
    quick = curve is None
    if quick:
        curve = measure_cost_curve(target, widths=(1, 2, 4, 8, 16, 32, 64), depths=(512,), repeats=2,
                                   kv_bits=kv_bits)
    report = roofline(target, curve)
    report["curve"] = "quick (one depth; `mlx-dspark tune` measures the full curve)" if quick else "cached"
    return report
