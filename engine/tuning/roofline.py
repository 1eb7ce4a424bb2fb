"""Roofline: memory bandwidth, the plain-decode ceiling it sets, and what the cost
curve allows a perfect drafter (for `doctor` and the server's /machine)."""

from __future__ import annotations

import time

from engine.tuning.cost_curve import CostCurve, curve_key, load_cost_curve, measure_cost_curve


# -- roofline ----------------------------------------------------------------------------------


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second reading a large float32 array (best of `repeats`)."""
    import mlx.core as mx

    x = mx.random.uniform(shape=(megabytes * (1 << 20) // 4,))
    mx.eval(x)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        mx.eval(mx.sum(x))
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def model_bytes(target) -> int:
    from mlx.utils import tree_flatten

    return int(sum(p.nbytes for _, p in tree_flatten(target.model.parameters())))


def roofline(target, curve: CostCurve, bandwidth: float | None = None) -> dict:
    """Memory bandwidth, the plain-decode ceiling it sets for this model, measured plain
    decoding (a width-1 step), and the best speedup the curve allows a perfect drafter."""
    bw = measure_bandwidth() if bandwidth is None else bandwidth
    nbytes = model_bytes(target)
    depths = {}
    for depth in curve.depths:
        width, speedup = curve.best_perfect_speedup(depth)
        step = curve.step_seconds(1, depth)
        depths[str(depth)] = {
            "plain_step_ms": round(step * 1e3, 3),
            "plain_tok_s": round(1.0 / step, 1),
            "cost": {str(w): round(curve.relative(w, depth), 3) for w in (2, 4, 8, 16, 32, 64)},
            "best_width": width,
            "best_speedup_perfect_drafter": round(speedup, 2),
        }
    report = {
        "bandwidth_gb_s": round(bw / 1e9, 2),
        "model_bytes": nbytes,
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
