"""The web app's one door to the engine's tuning and cache: everything it reads about cost
curves and the prefix cache goes through these functions (the engine's public API), so that
moving code inside engine/ touches this file only."""

from __future__ import annotations

from typing import Any, Callable


def cost_curve(engine: Any) -> dict:
    """The verify cost curve requests use (this machine's, or the conservative default), with
    per depth: cost relative to width 1, plain tokens/s, and a perfect drafter's best speedup."""
    from engine import CostCurve, curve_key, load_cost_curve

    kv_bits = getattr(engine, "kv_bits", None)

    def read(target):
        key = curve_key(target, kv_bits)
        return load_cost_curve(key) or CostCurve.default(key)

    curve = engine.inspect(read)  # a file read: this process alone, also when split
    by_depth = []
    for depth in curve.depths:
        width, speedup = curve.best_perfect_speedup(depth)
        step = curve.step_seconds(1, depth)
        by_depth.append({"depth": depth, "relative": [round(curve.relative(w, depth), 4) for w in curve.widths],
                         "plain_tok_s": round(1.0 / step, 2) if step > 0 else 0.0,
                         "best_width": width, "best_speedup": round(speedup, 3)})
    return {**curve.to_dict(), "by_depth": by_depth}


def retune(engine: Any, depths: list[int] | None, repeats: int | None,
           on_progress: Callable[[str, int, int], None]) -> dict:
    """Measure the cost curve again (blocks the engine for its duration) and make new requests use it."""
    kwargs = {k: v for k, v in (("depths", depths), ("repeats", repeats)) if v}
    # split over ranks, every rank measures (its forwards need them all); progress shows on one process only
    shown = None if engine.ranks.split else on_progress
    engine.call(_retune, getattr(engine, "kv_bits", None), kwargs, shown)
    return cost_curve(engine)


def _retune(target, kv_bits, kwargs: dict, on_progress) -> None:
    from engine import forget_measurements, tune

    tune(target, kv_bits, refresh=True, on_progress=on_progress, **kwargs)
    forget_measurements()  # what this process settled on: new requests read the new curve


def cache_view(engine: Any, limit: int = 40) -> dict:
    return {"stats": engine.cache_stats(), "branches": engine.cache_branches(limit)}


def drop_cache(engine: Any, disk: bool) -> dict:
    engine.drop_cache(disk)
    return cache_view(engine)
