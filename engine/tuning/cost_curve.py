"""The verify cost curve: what a forward of width k costs here, measured and cached.

A verify pass over k tokens costs cost(k) times a plain one-token step. The curve
depends on the machine (BLAS, GPU, memory bandwidth), the model, its
dtype/quantisation and the KV cache's bits, so it is measured once per such key and
cached as JSON under the user's cache directory. `draft_control.py` reads it per
round; `roofline.py` reports it.

On models with recurrent layers a rejected draft is taken back either from a per-position
capture made during the verify pass or by a snapshot and a replay of the kept tokens
(engine/caches/rollback.py, engine/caches/state_capture.py). Both are timed, the cheaper is the curve's
`rollback` and its seconds are the curve's, so `--max-draft auto` plans with what runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.base.measurements import MeasurementStore, cached_or_measured
from engine.base.ranks import share
from engine.base.platform import device_name
from engine.caches.kv_segments import fresh_cache
from engine.caches.rollback import DEFAULT_ROLLBACK, ROLLBACK_MODES, mark, needs_replay, take_back
from engine.caches import state_capture
from engine.kernels import quantized_route
from engine.kernels.cpu_attention import MAX_WIDTH

CURVE_FORMAT = 2  # 2: CPU decode and verify forwards on the compiled attention and SwiGLU (cheaper batched)
DEFAULT_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # interpolated between
DEFAULT_DEPTHS = (256, 2048, 8192)
DEFAULT_REPEATS = 4
QUICK_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # a re-measure on the request path
# Without a measurement, assume each extra token in a verify pass costs 15% of a
# one-token step (a small model on a CPU); a large model or a GPU is cheaper.
DEFAULT_MARGINAL_COST = 0.15


# -- where curves live --------------------------------------------------------------

# cost-curve-<digest of key>.json; what it settles per process is each key's curve for requests
CURVES = MeasurementStore("cost-curve")


def curve_key(target, kv_bits: int | None = None, **overrides) -> dict:
    """What a cost curve depends on. `overrides` replace fields (tests, other devices)."""
    import mlx.core as mx

    key = {
        "format": CURVE_FORMAT,
        "device": device_name(),
        "mlx": mx.__version__,
        "model": target.identity,
        "dtype": target.dtype,
        "quantization": target.config.get("quantization") or None,
        "kv_bits": kv_bits,
    }
    key.update(quantized_route.measurement_key())  # a curve under another routing is another curve
    key.update(overrides)
    return key


def curve_path(key: dict) -> Path:
    return CURVES.path(key)


# -- the curve ------------------------------------------------------------------------


@dataclass
class CostCurve:
    """Seconds of one verify forward, per context depth (rows) and width (columns)."""

    widths: list[int]
    depths: list[int]
    seconds: list[list[float]]
    key: dict = field(default_factory=dict)
    measured: bool = True  # False: the conservative default, not this machine's numbers
    measured_at: str = ""
    measure_s: float = 0.0
    # recurrent models: how a draft is taken back ("capture" or "replay", the cheaper
    # measured), with each way's seconds (same shape as `seconds`); "" and {} otherwise
    rollback: str = ""
    rollback_seconds: dict = field(default_factory=dict)

    @classmethod
    def default(cls, key: dict | None = None) -> "CostCurve":
        widths = list(range(1, MAX_WIDTH + 1))
        k = key or {}
        # MLX's CPU quantized_matmul doesn't batch: a width-16 pass cost 15-50x width 1 here
        # (4096x4096, 4/8-bit and mxfp4), so unmeasured, a quantised target on CPU doesn't draft.
        quantised_cpu = bool(k.get("quantization")) and str(k.get("device", "")).startswith("cpu")
        marginal = 1.0 if quantised_cpu else DEFAULT_MARGINAL_COST
        row = [1.0 + marginal * (w - 1) for w in widths]
        return cls(widths, [0], [row], key=dict(key or {}), measured=False)

    def _row_at(self, depth: int) -> list[float]:
        """Seconds per width at `depth`, linear between measured depths, clamped outside."""
        d = self.depths
        if depth <= d[0]:
            return self.seconds[0]
        for i in range(1, len(d)):
            if depth <= d[i]:
                t = (depth - d[i - 1]) / (d[i] - d[i - 1])
                return [a + t * (b - a) for a, b in zip(self.seconds[i - 1], self.seconds[i])]
        return self.seconds[-1]

    def step_seconds(self, width: int, depth: int) -> float:
        """Interpolated seconds of a forward over `width` tokens at `depth` tokens of context."""
        row, ws = self._row_at(depth), self.widths
        width = max(ws[0], min(width, ws[-1]))
        for i in range(1, len(ws)):
            if width <= ws[i]:
                t = (width - ws[i - 1]) / (ws[i] - ws[i - 1])
                return row[i - 1] + t * (row[i] - row[i - 1])
        return row[0]

    def relative(self, width: int, depth: int) -> float:
        """cost(width) / cost(1) at this depth."""
        return self.step_seconds(width, depth) / self.step_seconds(1, depth)

    def costs(self, depth: int, max_width: int = MAX_WIDTH) -> list[float]:
        """[cost(1), cost(2), ... cost(max_width)] relative to width 1 at `depth`."""
        return [self.relative(w, depth) for w in range(1, max_width + 1)]

    def for_rollback(self, mode: str) -> "CostCurve":
        """This curve as measured with the other way of taking back a draft (recurrent models)."""
        return CostCurve(self.widths, self.depths, self.rollback_seconds[mode], key=self.key,
                         measured=self.measured, rollback=mode, rollback_seconds=self.rollback_seconds)

    def best_perfect_speedup(self, depth: int, max_width: int = MAX_WIDTH) -> tuple[int, float]:
        """(width, (width)/cost(width)): the most a drafter that is always right could gain."""
        costs = self.costs(depth, max_width)
        return max(((w, w / c) for w, c in zip(range(1, max_width + 1), costs)), key=lambda x: x[1])

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "widths": self.widths,
            "depths": self.depths,
            "seconds": self.seconds,
            "measured": self.measured,
            "measured_at": self.measured_at,
            "measure_s": self.measure_s,
            "rollback": self.rollback,
            "rollback_seconds": self.rollback_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(
            widths=[int(w) for w in d["widths"]],
            depths=[int(x) for x in d["depths"]],
            seconds=[[float(s) for s in row] for row in d["seconds"]],
            key=dict(d.get("key") or {}),
            measured=bool(d.get("measured", True)),
            measured_at=str(d.get("measured_at", "")),
            measure_s=float(d.get("measure_s", 0.0)),
            rollback=str(d.get("rollback", "")),
            rollback_seconds={str(m): [[float(x) for x in row] for row in rows]
                              for m, rows in (d.get("rollback_seconds") or {}).items()},
        )


# -- measuring -------------------------------------------------------------------------------


def measure_cost_curve(
    target,
    widths: tuple[int, ...] | list[int] = DEFAULT_WIDTHS,
    depths: tuple[int, ...] | list[int] = DEFAULT_DEPTHS,
    repeats: int = DEFAULT_REPEATS,
    key: dict | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    seed: int = 0,
    kv_bits: int | None = None,
) -> CostCurve:
    """Time target forwards of each width at each context depth (median of `repeats` sweeps).

    The context is random token ids: attention cost depends on its length, not its text.
    Each pass is rolled back, so every width is measured at the same depth. Where taking
    back a draft involves recurrent layers (engine/caches/rollback.py), a pass of width w is charged
    taking back half of it, as if half the draft were rejected, once per way: with a
    per-position capture and with a replay of the kept tokens. The cheaper way over the
    whole curve is its `rollback` (replay where the model can't be captured).
    """
    import mlx.core as mx
    import numpy as np


    widths = sorted(set(int(w) for w in widths))
    if not widths or widths[0] != 1:
        raise ValueError("cost curve widths must include 1 (the plain-decoding step)")
    window = target.context_window
    depths = sorted(set(min(int(d), window - widths[-1] - 1) for d in depths))
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    t_start = time.perf_counter()
    modes: list[str] = []
    rows: dict[str, list] = {}
    total = len(depths) * len(widths) * repeats
    done = 0
    for depth in depths:
        cache = fresh_cache(target, kv_bits)  # the cache the engine decodes with
        context = rng.integers(0, vocab, size=depth + 1).tolist()
        for s in range(0, depth, 512):
            target.forward(context[s : min(s + 512, depth)], cache)
            mx.eval([c.state for c in cache])
        if not modes:
            modes = list(ROLLBACK_MODES) if needs_replay(cache) else ["none"]
        for _ in range(3):  # warm up: the first passes after a prefill run slow
            before = mark(cache)
            target.forward(context[depth:], cache)
            mx.eval([c.state for c in cache])
            take_back(cache, before, 1, 0, replay=None)

        def timed_pass(tokens: list[int], mode: str) -> float:
            """One verify pass, and taking half of it back the `mode` way; the cache is left as found."""
            w = len(tokens)
            before = mark(cache)
            t0 = time.perf_counter()
            with state_capture.recording(mode == "capture" and w > 1) as tape:
                logits = target.forward(tokens, cache)
            mx.eval(mx.argmax(logits, axis=-1))  # what the verify loop reads back
            if mode != "none" and w > 1:
                captured = state_capture.bind(tape, cache, w)  # through the module: tests replace it
                if mode == "capture" and captured is None and not tape.over_budget:
                    modes.remove("capture")  # this model's recurrences can't be captured
                # (over the memory budget the pass replays, as the verify loop's round would)
                kept = w // 2
                take_back(cache, before, w, kept, replay=lambda: target.forward(tokens[:kept], cache),
                          captured=captured)
                mx.eval([c.state for c in cache])
            dt = time.perf_counter() - t0
            take_back(cache, before, w, 0, replay=None)
            return dt

        # Whole sweeps over the widths, median pass per width: a burst of interference
        # from other processes then spoils one pass of several widths, not a width. (Not the
        # best pass: on a busy machine wide passes suffer more, and the verify loop sees that.)
        passes = {m: [[] for _ in widths] for m in modes}
        draws = {w: rng.integers(0, vocab, size=w).tolist() for w in widths}
        for sweep in range(repeats + 1):  # sweep 0 warms every shape up
            for i, w in enumerate(widths):
                for mode in list(modes):
                    dt = timed_pass(draws[w], mode)
                    if sweep and mode in modes:
                        passes[mode][i].append(dt)
                if sweep:
                    done += 1
                    if on_progress:
                        on_progress(f"depth {depth} width {w} pass {sweep}/{repeats}", done, total)
        for mode in modes:
            row = [round(statistics.median(p), 7) for p in passes[mode]]
            # Interference on a shared machine only ever adds time: a narrower pass measured
            # slower than a wider one was disturbed, so it is capped at the wider one's time.
            for i in range(len(row) - 2, -1, -1):
                row[i] = min(row[i], row[i + 1])
            rows.setdefault(mode, []).append(row)
        del cache
    rows = {m: r for m, r in rows.items() if m in modes}
    pick = pick_rollback(rows) if "none" not in rows else ""
    return CostCurve(
        widths=widths,
        depths=depths,
        seconds=rows[pick or "none"],
        key=dict(key or {}),
        measured=True,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        measure_s=round(time.perf_counter() - t_start, 3),
        rollback=pick,
        rollback_seconds=rows if pick else {},
    )


def pick_rollback(seconds_by_mode: dict[str, list[list[float]]]) -> str:
    """The way of taking back a draft whose verify passes cost least over the whole curve
    (every width and depth counted alike; on a tie, capture: no replay in the loop)."""
    return min(seconds_by_mode, key=lambda m: (sum(map(sum, seconds_by_mode[m])), m != "capture"))


def state_rollback(target, kv_bits: int | None = None) -> str:
    """How this target's recurrent layers take back a draft: `target.state_rollback` where
    set, else the measured curve's pick (`mlx-dspark tune`), else DEFAULT_ROLLBACK."""
    if getattr(target, "state_rollback", None):
        return target.state_rollback
    key = curve_key(target, kv_bits)
    curve = CURVES.recall(str(curve_path(key))) or load_cost_curve(key)
    return (curve.rollback if curve is not None else "") or DEFAULT_ROLLBACK


def load_cost_curve(key: dict) -> CostCurve | None:
    """The cached curve for exactly this key, or None (absent, unreadable, or another key's)."""
    data = CURVES.load(key)
    try:
        curve = CostCurve.from_dict(data) if data is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    return curve if curve is not None and curve.measured else None


def save_cost_curve(curve: CostCurve) -> Path:
    path = CURVES.save(curve.to_dict())
    # the next request settles on the new curve: every curve forgotten (split over ranks, the record
    # is the leader's, under its key; each rank's own settled curve goes too)
    CURVES.forget()
    return path


def tune(target, kv_bits: int | None = None, refresh: bool = False, **measure_kwargs) -> CostCurve:
    """The cached curve for this target and machine; measured (and cached) if absent or `refresh`."""
    key = curve_key(target, kv_bits)
    return cached_or_measured(lambda: load_cost_curve(key), save=save_cost_curve, refresh=refresh,
                              measure=lambda: measure_cost_curve(target, key=key, kv_bits=kv_bits, **measure_kwargs))


RECHECK_WIDTHS = (1, 16)
RECHECK_TOLERANCE = 0.25


def curve_still_holds(target, curve: CostCurve, kv_bits: int | None = None) -> bool:
    """Re-time two widths at the curve's first depth (a second or so): does the cached
    curve still describe this machine? Off by more than a quarter at either width means
    something under it changed (another BLAS, a cached file from another setup)."""
    widths = [w for w in RECHECK_WIDTHS if w <= curve.widths[-1]]
    now = measure_cost_curve(target, widths=widths, depths=curve.depths[:1], repeats=3, kv_bits=kv_bits)
    for w, seconds in zip(now.widths, now.seconds[0]):
        cached = curve.step_seconds(w, now.depths[0])
        if abs(seconds - cached) > RECHECK_TOLERANCE * cached:
            return False
    return True


def curve_for_requests(target, kv_bits: int | None = None) -> CostCurve:
    """The curve a request path may use: the cached one once re-checked (re-measured,
    quickly, where it no longer holds), else the conservative default (measuring in
    full takes a minute; `mlx-dspark tune` does it). Settled once per process."""
    key = curve_key(target, kv_bits)
    memo_key = str(curve_path(key))  # the path holds the cache dir and the key's digest
    settled = CURVES.recall(memo_key)
    if settled is None:
        curve = load_cost_curve(key)
        if curve is not None and not share(curve_still_holds(target, curve, kv_bits)):  # the leader's clock decides
            curve = share(measure_cost_curve(target, widths=QUICK_WIDTHS, depths=curve.depths, repeats=2,
                                             key=key, kv_bits=kv_bits))
            save_cost_curve(curve)
        settled = CURVES.remember(memo_key, curve or CostCurve.default(key))
    return settled
