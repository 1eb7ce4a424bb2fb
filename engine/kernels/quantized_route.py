"""Which kernel each quantised layer of the engine's forwards takes, by the forward's rows, on MLX CUDA.

- from `MLX_DSPARK_WIDE_DEQUANTIZE_ROWS` rows (default wide_dequantize.MIN_ROWS, 384): the weight
  dequantized for the forward (engine/kernels/wide_dequantize.py: prefill chunks, wide batches);
- `MLX_DSPARK_NARROW_QMM_ROWS` rows, FIRST-LAST (default narrow_qmm.FASTER_FROM to MAX_ROWS, 4-64;
  0: none): engine/kernels/narrow_qmm.py, each weight read once on tensor cores (a verify pass, a
  few streams' decode), where it reads the layout, on MLX CUDA only;
- anything else, one row included: MLX's own quantized kernels.

Only the engine's own forwards are routed (`Target` builds them inside `engine_forward()`), so
mlx-lm's loop over the same model (the benchmark's peer) is untouched. Every engine forward of a
width goes the same way (prefill, verify, tune's cost curve), so `auto` plans with what runs, and
`measurement_key()` keeps measurements under one routing apart from another's.
`MLX_DSPARK_WIDE_DEQUANTIZE=0` turns the route off (both kernels of ours), `1` on on any device
(the tests, on CPU; narrow_qmm runs only on MLX CUDA).
"""

from __future__ import annotations

import os

import mlx.nn as nn

from engine.base.errors import EngineError
from engine.base.forward_context import forward_context, get_context
from engine.base.platform import on_cuda
from engine.kernels import narrow_qmm, wide_dequantize

_original = None  # QuantizedLinear.__call__ while the route is installed
min_rows = wide_dequantize.MIN_ROWS  # from here up, dequantized; set at install()
narrow_rows = (0, 0)  # forwards of this many rows, first to last, take narrow_qmm ((0, 0): none); set at install()


def engine_forward():
    """Forwards built in this block (on this thread) are the engine's."""
    return forward_context(engine_forward=True)


def _routed(self, x):
    if get_context().engine_forward:
        rows = x.size // x.shape[-1]
        if rows >= min_rows:
            return wide_dequantize.linear(self, x)
        if narrow_rows[0] <= rows <= narrow_rows[1] and narrow_qmm.fits(self, x):
            return narrow_qmm.linear(self, x)
    return _original(self, x)


def wanted() -> bool:
    """MLX CUDA (measured there; Metal's quantized kernels are not), or as the variable says."""
    env = os.environ.get("MLX_DSPARK_WIDE_DEQUANTIZE")
    if env in ("0", "1"):
        return env == "1"
    return on_cuda()


def wide_rows() -> int | None:
    """The rows from which engine forwards take the dequantized path; None where none do."""
    return min_rows if _original is not None else None


def measurement_key() -> dict:
    """What a measurement of engine forwards (cost curve, prefill chunk) depends on here: the rows
    at which they take other kernels, where any do, and narrow_qmm's revision (nothing on a CPU or
    Metal, so keys stay)."""
    if _original is None:
        return {}
    if not narrow_rows[1]:
        return {"wide_dequantize_rows": min_rows}
    return {"wide_dequantize_rows": min_rows, "narrow_qmm_rows": "%d-%d" % narrow_rows,
            "narrow_qmm_version": narrow_qmm.VERSION}


def _rows_from_env(name: str, default: int, low: int) -> int:
    """The variable's rows: a whole number from low."""
    env = os.environ.get(name, "").strip()
    if not env:
        return default
    if not env.isdecimal() or int(env) < low:
        raise EngineError(f"{name} must be a whole number >= {low}, not {env!r}")
    return int(env)


def _narrow_from_env() -> tuple[int, int]:
    """`MLX_DSPARK_NARROW_QMM_ROWS`: FIRST-LAST within what the kernel takes, 0 for none; unset, the
    rows where it was measured faster (narrow_qmm.FASTER_FROM to MAX_ROWS)."""
    name = "MLX_DSPARK_NARROW_QMM_ROWS"
    env = os.environ.get(name, "").strip()
    if not env:
        return narrow_qmm.FASTER_FROM, narrow_qmm.MAX_ROWS
    if env == "0":
        return 0, 0
    first, _, last = env.partition("-")
    if first.isdecimal() and last.isdecimal() and 2 <= int(first) <= int(last) <= narrow_qmm.MAX_ROWS:
        return int(first), int(last)
    raise EngineError(f"{name} must be FIRST-LAST rows from 2 to {narrow_qmm.MAX_ROWS} "
                      f"(default {narrow_qmm.FASTER_FROM}-{narrow_qmm.MAX_ROWS}), or 0: off; not {env!r}")


def install() -> bool:
    """Route every QuantizedLinear of engine forwards by rows where `wanted()` (idempotent)."""
    global _original, min_rows, narrow_rows
    if _original is None and wanted():
        min_rows = _rows_from_env("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", wide_dequantize.MIN_ROWS, 1)
        narrow = _narrow_from_env()
        narrow_rows = narrow if on_cuda() else (0, 0)  # the kernel runs on MLX CUDA alone
        _original = nn.QuantizedLinear.__call__
        nn.QuantizedLinear.__call__ = _routed
    return _original is not None


def uninstall() -> None:
    global _original, min_rows, narrow_rows
    if _original is not None:
        nn.QuantizedLinear.__call__ = _original
        _original = None
    min_rows = wide_dequantize.MIN_ROWS
    narrow_rows = (0, 0)


def build_for(model) -> int:
    """Compile the narrow_qmm instances this model's forwards will take, at load (0 where none will)."""
    return narrow_qmm.build_for(model) if _original is not None and narrow_rows[1] else 0
