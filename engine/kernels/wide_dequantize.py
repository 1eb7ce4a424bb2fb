"""A quantised layer through its weight dequantized for the forward: what MLX CUDA's wide forwards take.

MLX CUDA's quantized matmul ran a 16,384-token prefill of the 8-bit 8B yardstick at 192 TFLOP/s
on an H200, no faster than at 2048 or 4096 tokens a chunk; the same chunks as `x @ dequantize(W).T`,
a transient copy of each weight in the activations' dtype, ran at 445 TFLOP/s (2048 a chunk)
and 549 (4096), and on resident dequantized weights at 608-648 (scripts/profile_prefill_gpu.py,
2026-12-04). The copy costs a read of the packed weight and a write of the wide one per forward,
about 25 ms for the 8B's 7.4 GB, which only a forward of MIN_ROWS rows or more repays: at a depth
of 2048, quantized against dequantized, 10.5 against 35.4 ms at 1 row, 28.3 / 38.5 at 64 and 128,
37.0 / 42.0 at 256, 50.3 / 42.7 at 384, 57.8 / 45.3 at 512 (scripts/profile_verify_gpu.py, same
H200). So prefill chunks take it, and a batched forward where its streams' rows add up to that
many; decode and a verify pass (64 rows at most) keep quantized kernels (MLX's, or narrow_qmm's
where asked for), which read one byte a weight instead of three. No wide copy stays resident.
engine/kernels/quantized_route.py routes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MIN_ROWS = 384  # rows (tokens over the batch) in one forward from which the dequantized copy pays (H200)


def linear(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """What `layer(x)` computes, through its weight dequantized to x's dtype."""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                      bits=layer.bits, mode=layer.mode).astype(x.dtype)
    y = x @ w.T
    return y + layer["bias"] if "bias" in layer else y
