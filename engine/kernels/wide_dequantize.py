"""Prefill chunks through each quantised weight dequantized for that forward, on MLX CUDA.

MLX CUDA's quantized matmul ran a 16,384-token prefill of the 8-bit 8B yardstick at 192 TFLOP/s
on an H200, no faster than at 2048 or 4096 tokens a chunk; the same chunks as `x @ dequantize(W).T`,
a transient copy of each weight in the activations' dtype, ran at 445 TFLOP/s (2048 a chunk)
and 549 (4096), and on resident dequantized weights at 608-648 (scripts/profile_prefill_gpu.py,
2026-12-04). The copy costs a read of the packed weight and a write of the wide one per forward,
which a chunk of MIN_ROWS tokens or more repays (an estimate from the figures above: for the 8B,
~5 ms of copies against ~19 ms of quantized matmul at 256 rows); verify and decode forwards (a few rows)
keep the quantized kernels, which read one byte a weight instead of three, and no wide copy stays
resident. Only the engine's prefill takes this path (`prefilling()` around its forwards), so
mlx-lm's own loop over the same model (the benchmark's peer) is untouched.
`MLX_DSPARK_WIDE_DEQUANTIZE=0` turns it off; `1` turns it on on any device (the tests, on CPU).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from engine.base.platform import on_cuda

MIN_ROWS = 256  # tokens in one forward (prefill chunks are 1024-4096; a prompt's last one may be shorter)
_state = threading.local()
_original = None


def linear(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """What `layer(x)` computes, through its weight dequantized to x's dtype."""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                      bits=layer.bits, mode=layer.mode).astype(x.dtype)
    y = x @ w.T
    return y + layer["bias"] if "bias" in layer else y


def takes(x: mx.array) -> bool:
    """Inside `prefilling()`, a forward of at least MIN_ROWS tokens."""
    return getattr(_state, "prefilling", False) and x.size // x.shape[-1] >= MIN_ROWS


@contextmanager
def prefilling():
    """Forwards built in this block (on this thread) are prefill chunks."""
    before = getattr(_state, "prefilling", False)
    _state.prefilling = True
    try:
        yield
    finally:
        _state.prefilling = before


def _routed(self, x):
    return linear(self, x) if takes(x) else _original(self, x)


def wanted() -> bool:
    """MLX CUDA (measured there; Metal's quantized kernels are not), or as the variable says."""
    env = os.environ.get("MLX_DSPARK_WIDE_DEQUANTIZE")
    if env in ("0", "1"):
        return env == "1"
    return on_cuda()


def install() -> bool:
    """Route wide prefill forwards of every QuantizedLinear through `linear` where `wanted()` (idempotent)."""
    global _original
    if _original is None and wanted():
        _original = nn.QuantizedLinear.__call__
        nn.QuantizedLinear.__call__ = _routed
    return _original is not None


def uninstall() -> None:
    global _original
    if _original is not None:
        nn.QuantizedLinear.__call__ = _original
        _original = None
