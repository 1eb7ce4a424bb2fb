"""The engine's wide forwards through each quantised weight dequantized for that forward, on MLX CUDA.

MLX CUDA's quantized matmul ran a 16,384-token prefill of the 8-bit 8B yardstick at 192 TFLOP/s
on an H200, no faster than at 2048 or 4096 tokens a chunk; the same chunks as `x @ dequantize(W).T`,
a transient copy of each weight in the activations' dtype, ran at 445 TFLOP/s (2048 a chunk)
and 549 (4096), and on resident dequantized weights at 608-648 (scripts/profile_prefill_gpu.py,
2026-12-04). The copy costs a read of the packed weight and a write of the wide one per forward,
about 25 ms for the 8B's 7.4 GB, which only a forward of MIN_ROWS rows or more repays: at a depth
of 2048, quantized against dequantized, 10.5 against 35.4 ms at 1 row, 28.3 / 38.5 at 64 and 128,
37.0 / 42.0 at 256, 50.3 / 42.7 at 384, 57.8 / 45.3 at 512 (scripts/profile_verify_gpu.py, same
H200). So prefill chunks take it, and a batched forward where its streams' rows add up to that
many; decode and a verify pass (64 rows at most) keep the quantized kernels, which read one byte
a weight instead of three. No wide copy stays resident.

Only the engine's own forwards take this path (`Target` builds them inside `engine_forward()`), so
mlx-lm's loop over the same model (the benchmark's peer) is untouched. Every engine forward of a
width goes the same way (prefill, verify, tune's cost curve), so `auto` plans with what runs.
`MLX_DSPARK_WIDE_DEQUANTIZE=0` turns it off, `1` on on any device (the tests, on CPU);
`MLX_DSPARK_WIDE_DEQUANTIZE_ROWS=N` moves the threshold.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from engine.base.errors import EngineError
from engine.base.forward_context import forward_context, get_context
from engine.base.platform import on_cuda

MIN_ROWS = 384  # rows (tokens over the batch) in one forward from which the dequantized copy pays (H200)
_original = None  # QuantizedLinear.__call__ while the route is installed
min_rows = MIN_ROWS  # MIN_ROWS unless MLX_DSPARK_WIDE_DEQUANTIZE_ROWS sets it at install()


def linear(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """What `layer(x)` computes, through its weight dequantized to x's dtype."""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                      bits=layer.bits, mode=layer.mode).astype(x.dtype)
    y = x @ w.T
    return y + layer["bias"] if "bias" in layer else y


def takes(x: mx.array) -> bool:
    """Inside `engine_forward()`, a forward of at least `min_rows` rows."""
    return get_context().engine_forward and x.size // x.shape[-1] >= min_rows


def engine_forward():
    """Forwards built in this block (on this thread) are the engine's."""
    return forward_context(engine_forward=True)


def _routed(self, x):
    return linear(self, x) if takes(x) else _original(self, x)


def wanted() -> bool:
    """MLX CUDA (measured there; Metal's quantized kernels are not), or as the variable says."""
    env = os.environ.get("MLX_DSPARK_WIDE_DEQUANTIZE")
    if env in ("0", "1"):
        return env == "1"
    return on_cuda()


def routed_rows() -> int | None:
    """The rows from which engine forwards take the dequantized path; None where none do."""
    return min_rows if _original is not None else None


def measurement_key() -> dict:
    """What a measurement of engine forwards (cost curve, prefill chunk) depends on here: the rows
    from which they take another kernel, where any do (nothing on a CPU or Metal, so keys stay)."""
    rows = routed_rows()
    return {} if rows is None else {"wide_dequantize_rows": rows}


def _rows_wanted() -> int:
    env = os.environ.get("MLX_DSPARK_WIDE_DEQUANTIZE_ROWS", "").strip()
    if not env:
        return MIN_ROWS
    try:
        rows = int(env)
    except ValueError:
        rows = 0
    if rows < 1:
        raise EngineError(f"MLX_DSPARK_WIDE_DEQUANTIZE_ROWS must be a whole number >= 1, not {env!r}")
    return rows


def install() -> bool:
    """Route wide engine forwards of every QuantizedLinear through `linear` where `wanted()` (idempotent)."""
    global _original, min_rows
    if _original is None and wanted():
        min_rows = _rows_wanted()
        _original = nn.QuantizedLinear.__call__
        nn.QuantizedLinear.__call__ = _routed
    return _original is not None


def uninstall() -> None:
    global _original, min_rows
    if _original is not None:
        nn.QuantizedLinear.__call__ = _original
        _original = None
    min_rows = MIN_ROWS
