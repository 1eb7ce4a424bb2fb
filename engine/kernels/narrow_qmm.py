"""A quantised layer over a few rows (2 to MAX_ROWS) on MLX CUDA: each weight read once, on tensor cores.

MLX CUDA 0.32 sends one row to its matrix-vector kernel (one warp an output, each weight read
once) and anything wider to a CUTLASS kernel tiled for long prompts. On an H200, 8-bit 8B
yardstick, depth 2048, the engine's forward took 10.5 ms at 1 row, 19.7 at 4-8 and 28.3 at 64
(scripts/profile_verify_gpu.py): a verify pass of 16-64 drafted tokens, or 4-8 streams' decode,
paid two to three single steps for what reads the same weights once. Decode on a GPU is bound by
reading weights, so a few rows should cost about what one does.

This kernel computes `x @ dequantize(W).T` with the roles swapped: W's output features are the rows
of PTX's m16n8k16 product (16 a block), x's rows its 8 columns (x padded to 1, 2, 4 or 8 tiles of
8). A block's 8 warps split K; each step a lane loads 16 bytes of two feature rows (16 weights
at 8 bits, 32 at 4), dequantizes them in registers (fp32, rounded to x's dtype) straight into its A
fragment, reads the matching 8-byte pieces of x as its B fragments, and issues one `mma.sync` per 16
k per tile of 8 rows, with the next step's 16-byte words already loading. No shared memory but the
block's final sum over its warps. Affine 4- and 8-bit weights, groups of 32, 64 or 128, K a
multiple of 64 (8-bit) or 128 (4-bit), N of 16, bf16 or fp16 activations in the scales' dtype;
anything else keeps MLX's kernels. The sums are fp32 as in MLX's kernels, in another order: the same
values to rounding, as any two GEMM kernels (lossless speculation compares the target with itself
through the engine's own forwards, whichever kernel they take).

Measured 2026-12-05 on an H200 (mlx-cuda-13 0.32.4; tests/test_narrow_qmm.py passes there), the
engine's forward of the 8-bit 8B yardstick at depth 2048 (scripts/profile_verify_gpu.py), ms:

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 |
|---|---|---|---|---|---|---|---|
| MLX's kernels | 11.8 | 14.1 | 21.8 | 21.8 | 22.6 | 26.4 | 30.5 |
| narrow_qmm | - | 15.9 | 15.9 | 15.9 | 18.1 | 18.1 | 26.7 |

So engine forwards of FASTER_FROM to MAX_ROWS rows take it by default on MLX CUDA
(engine/kernels/quantized_route.py routes; `MLX_DSPARK_NARROW_QMM_ROWS` sets the range). Each
(dtype, bits, group, tiles) instance took 1.3-2.4 s to build on first use in a process (a second
process paid 1.3-1.5 s again), hence four tile counts, not eight (2 and 4 tiles cost the same,
above), built at load by `build_for()`, not in a user's first requests.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 64  # rows (tokens over the batch) one forward may bring: 8 tiles of 8
FASTER_FROM = 4  # rows from which it beats MLX's kernels (measured above; at 2 MLX's are faster)
TILE_COUNTS = (1, 2, 4, 8)  # the instances compiled: x's rows padded to one of these tiles of 8
WARPS = 8  # warps a block, splitting K: enough blocks in flight for a 4096-wide layer on 132 SMs
TILE_N = 16  # output features a block
TILE_ROWS = 8  # rows of x a tensor-core tile (x is padded to a multiple)
DTYPES = (mx.bfloat16, mx.float16)

HEADER = """
// One m16n8k16 tensor-core product, fp32 sums: d += a (16x16, row) * b (16x8, col), per PTX's fragment layout.
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two values in one register, the first in the low half (a fragment's lower k).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
"""

# A warp's step: 16 features (lane group g holds features g and g + 8) by TK = 4 * VALS of k, lane t of
# the group loading VALS consecutive k of both (16 bytes each). The products sum over k, so k may be
# renumbered inside a step as long as W and x agree: mma kk's fragment slots 2t, 2t+1 hold
# k = 16-byte chunk t's 4kk, 4kk+1 and slots 2t+8, 2t+9 its 4kk+2, 4kk+3, for W (A) and x (B) alike.
# Each lane then dequantizes only its own loaded words and reads x as 8-byte pieces.
SOURCE = """
    constexpr int VALS = 128 / BITS;   // weights in one lane's 16 bytes of a row: 16 (8-bit) or 32 (4-bit)
    constexpr int TK = 4 * VALS;       // k a warp covers a step
    constexpr int KK = VALS / 4;       // mma instructions a step (k 16 each) per tile of 8 rows
    __shared__ float sums[WARPS][MT][16 * 8];

    const int K = x_shape[1];
    const int N = w_shape[0];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * 16;
    const int steps = K / TK;
    const int groups = K / GROUP;
    const int64_t row_vecs = (int64_t)K * BITS / 128;  // 16-byte words a row of W
    const uint4* w_lo = reinterpret_cast<const uint4*>(w) + (int64_t)(n0 + g) * row_vecs + t;
    const uint4* w_hi = w_lo + 8 * row_vecs;
    const T* s_lo = scales + (int64_t)(n0 + g) * groups;
    const T* s_hi = s_lo + 8 * groups;
    const T* b_lo = biases + (int64_t)(n0 + g) * groups;
    const T* b_hi = b_lo + 8 * groups;
    const T* x_lane = x + (int64_t)g * K + t * VALS;  // row g of each tile of 8 rows

    float acc[MT][4];
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

    // The next step's words are loaded before this step's are used: loads in flight while we compute.
    int step = warp;
    uint4 next_lo, next_hi;
    if (step < steps) { next_lo = w_lo[step * 4]; next_hi = w_hi[step * 4]; }
    for (; step < steps; step += WARPS) {
      const uint4 cur_lo = next_lo, cur_hi = next_hi;
      if (step + WARPS < steps) { next_lo = w_lo[(step + WARPS) * 4]; next_hi = w_hi[(step + WARPS) * 4]; }
      const int k = step * TK + t * VALS;
      const float scale_lo = static_cast<float>(s_lo[k / GROUP]), bias_lo = static_cast<float>(b_lo[k / GROUP]);
      const float scale_hi = static_cast<float>(s_hi[k / GROUP]), bias_hi = static_cast<float>(b_hi[k / GROUP]);
      const uint32_t* words_lo = reinterpret_cast<const uint32_t*>(&cur_lo);
      const uint32_t* words_hi = reinterpret_cast<const uint32_t*>(&cur_hi);
      #pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        float lo[4], hi[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * kk + j;
          const uint32_t mask = (1u << BITS) - 1u;
          lo[j] = static_cast<float>((words_lo[i * BITS / 32] >> ((i * BITS) % 32)) & mask) * scale_lo + bias_lo;
          hi[j] = static_cast<float>((words_hi[i * BITS / 32] >> ((i * BITS) % 32)) & mask) * scale_hi + bias_hi;
        }
        const uint32_t a[4] = {pack2<T>(lo[0], lo[1]), pack2<T>(hi[0], hi[1]), pack2<T>(lo[2], lo[3]), pack2<T>(hi[2], hi[3])};
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xv = *reinterpret_cast<const uint2*>(x_lane + (int64_t)mt * 8 * K + step * TK + 4 * kk);
          const uint32_t b[2] = {xv.x, xv.y};
          mma_16816<T>(acc[mt], a, b);
        }
      }
    }
    // acc[mt]: features g (0, 1) and g + 8 (2, 3), rows 2t and 2t + 1 of tile mt.
    for (int mt = 0; mt < MT; ++mt) {
      sums[warp][mt][g * 8 + 2 * t] = acc[mt][0];
      sums[warp][mt][g * 8 + 2 * t + 1] = acc[mt][1];
      sums[warp][mt][(g + 8) * 8 + 2 * t] = acc[mt][2];
      sums[warp][mt][(g + 8) * 8 + 2 * t + 1] = acc[mt][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < MT * 8 * 16; i += WARPS * 32) {
      const int n = i % 16, m = i / 16;
      float total = 0.0f;
      for (int w_ = 0; w_ < WARPS; ++w_) total += sums[w_][m / 8][n * 8 + m % 8];
      out[(int64_t)m * N + n0 + n] = static_cast<T>(total);
    }
"""

_kernel = None


def kernel():
    """The compiled kernel (built on first use: MLX compiles each template's instance once)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="narrow_qmm", input_names=["x", "w", "scales", "biases"], output_names=["out"],
            source=SOURCE, header=HEADER)
    return _kernel


def fits(layer: nn.QuantizedLinear, x: mx.array) -> bool:
    """Whether this kernel computes `layer(x)`: 2 to MAX_ROWS rows, a layout it reads."""
    k = x.shape[-1]
    rows = x.size // k
    if not 2 <= rows <= MAX_ROWS or x.dtype not in DTYPES:
        return False
    if layer.mode != "affine" or layer.bits not in (4, 8) or layer.group_size not in (32, 64, 128):
        return False
    scales = layer["scales"]
    step_k = 4 * 128 // layer.bits  # k a warp covers a step: four lanes' 16 bytes of a row
    return scales.dtype == x.dtype and k % step_k == 0 and scales.shape[0] % TILE_N == 0


def linear(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """What `layer(x)` computes, for `fits(layer, x)`."""
    k = x.shape[-1]
    rows = x.size // k
    tiles = next(t for t in TILE_COUNTS if t * TILE_ROWS >= rows)
    x2 = x.reshape(rows, k)
    if tiles * TILE_ROWS > rows:
        x2 = mx.concatenate([x2, mx.zeros((tiles * TILE_ROWS - rows, k), dtype=x.dtype)])
    n = layer["scales"].shape[0]
    out = kernel()(
        inputs=[x2, layer["weight"], layer["scales"], layer["biases"]],
        template=[("T", x.dtype), ("BITS", layer.bits), ("GROUP", layer.group_size), ("MT", tiles),
                  ("WARPS", WARPS)],
        grid=(n // TILE_N * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(tiles * TILE_ROWS, n)], output_dtypes=[x.dtype])[0]
    y = out[:rows].reshape(*x.shape[:-1], n)
    return y + layer["bias"] if "bias" in layer else y


def build_for(model: nn.Module) -> int:
    """Compile the instances `model`'s quantised layers would take, now (at load) rather than in
    the first requests that bring each row count; returns how many were built."""
    layouts = {}
    for _, layer in model.named_modules():
        if isinstance(layer, nn.QuantizedLinear):
            x = mx.zeros((TILE_ROWS, layer["scales"].shape[-1] * layer.group_size), dtype=layer["scales"].dtype)
            if fits(layer, x):
                layouts.setdefault((x.dtype, layer.bits, layer.group_size), (layer, x))
    for layer, x in layouts.values():
        mx.eval([linear(layer, mx.zeros((tiles * TILE_ROWS, x.shape[-1]), dtype=x.dtype)) for tiles in TILE_COUNTS])
    return len(layouts) * len(TILE_COUNTS)
