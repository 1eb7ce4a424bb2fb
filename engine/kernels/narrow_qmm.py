"""A quantised layer over a few rows (2 to MAX_ROWS) on MLX CUDA: each weight read once, on tensor cores.

MLX CUDA 0.32 sends one row to its matrix-vector kernel (one warp an output, each weight read
once) and anything wider to a CUTLASS kernel tiled for long prompts. On an H200, 8-bit 8B
yardstick, depth 2048, the engine's forward took 10.5 ms at 1 row, 19.7 at 4-8 and 28.3 at 64
(scripts/profile_verify_gpu.py): a verify pass of 16-64 drafted tokens, or 4-8 streams' decode,
paid two to three single steps for what reads the same weights once. Decode on a GPU is bound by
reading weights, so a few rows should cost about what one does.

This kernel computes `x @ dequantize(W).T` with the roles swapped: W's output features are the rows
of PTX's m16n8k16 product, x's rows its 8 columns (x padded to 1, 2, 4 or 8 tiles of 8). A block
of 8 warps computes 32 features (FEATURE_GROUPS groups of 16), its warps splitting K; each step a
lane loads 16 bytes of each of its four feature rows (16 weights at 8 bits, 32 at 4), dequantizes
them in registers (fp32, rounded to x's dtype) straight into its A fragments, reads the matching
8-byte pieces of x once as its B fragments for both groups, and issues one `mma.sync` per 16 k per
group per tile of 8 rows, with the next step's words, scales and biases already loading. No shared
memory but the block's final sum over its warps, added in warp order. Affine 4- and 8-bit weights,
groups of 32, 64 or 128, K a multiple of 64 (8-bit) or 128 (4-bit), N of 32, bf16 or fp16
activations in the scales' dtype; anything else keeps MLX's kernels. The sums are fp32 as in MLX's
kernels, in another order: the same values to rounding, as any two GEMM kernels (lossless
speculation compares the target with itself through the engine's own forwards, whichever kernel
they take).

Why two groups a warp: with one, every block reads all of x for its 16 features, so x's reads (from
L2) were as many bytes as the weights' at 8 rows and eight times as many at 64. Two groups halve
them. Measured 2026-12-06 on an H100 (mlx-cuda-13 0.32.4), the engine's forward of the 8-bit 8B
yardstick at depth 2048 (`measure_cost_curve`, median of 3 sweeps, a narrower width capped at a
wider one's time), one process, one group a warp and two alternating, ms (two runs of ours, one of MLX's):

| rows | 1 | 2 | 4-16 | 24-32 | 48-64 |
|---|---|---|---|---|---|
| MLX's kernels | 9.2 | 12.7 | 21.3 | 26.2 | 28.9-30.4 |
| one group a warp | 10.8 / 9.2 | 17.6 / 16.6 | 17.6 / 17.1 | 21.0 / 19.8 | 29.8 / 28.2 |
| two groups a warp | 10.3 / 9.0 | 19.7 / 15.4 | 19.7 / 15.6 | 19.7 / 18.8 | **23.6 / 22.6** |

(Another H100 the same day, the same probe: one group 24.6 / 27.9 / 33.2 ms at 4-16 / 24-32 /
48-64 rows, two groups 17.5 / 20.5 / 23.8.) Outputs are bit for bit the one-group kernel's (same
products, same order; checked there for bf16, 8-bit, groups of 64). Four groups a warp read no faster than one (more registers a thread,
fewer blocks; not profiled), and int-to-float by exponent bits instead of a conversion
instruction changed nothing (one run).
So engine forwards of FASTER_FROM to MAX_ROWS rows take it by default on MLX CUDA
(engine/kernels/quantized_route.py routes; `MLX_DSPARK_NARROW_QMM_ROWS` sets the range); at 2 rows
MLX's kernel is faster. Each (dtype, bits, group, tiles) instance took 1.3-2.4 s to build on first
use in a process (a second process paid 1.3-1.5 s again), hence six tile counts, not eight, built
at load by `build_for()`, not in a user's first requests.

Which six: a forward costs what its tile count does, and verify forwards run at multiples of 8 rows
on MLX CUDA (engine/decoding/verify.py `verify_width`), so every count is met. On an H200
(2026-12-06, the 8-bit 8B yardstick's forward at depth 2048, two runs alternating) 3 tiles took
17.1-17.6 ms where 4 took 20.0-21.2, and 6 tiles 22.5 where 8 took 23.6-24.3; 5 and 7 saved up to
1.3 ms more each, not worth two more builds at every load. Splitting K over 2-8 blocks (fp32 partial
sums added after) was slower in all but two of 100 layer shapes and row counts on an H100, and no
faster in the forward. MLX's own kernel, faster alone from 8 rows, made the forward slower: on the
H100 through the model's 3-D x, on the H200 through x reshaped to 2-D (22.1-32.0 ms at 8-64 rows
against this kernel's 15.9-23.6 there; docs/benchmarks.md).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

VERSION = 3  # the kernel's revision and tile counts, in the cost curve's key: a curve measured under others is measured again
MAX_ROWS = 64  # rows (tokens over the batch) one forward may bring: 8 tiles of 8
FASTER_FROM = 4  # rows from which it beats MLX's kernels (measured above; at 2 MLX's are faster)
TILE_COUNTS = (1, 2, 3, 4, 6, 8)  # the instances compiled: x's rows padded to one of these tiles of 8
WARPS = 8  # warps a block, splitting K: enough blocks in flight for a 4096-wide layer on 132 SMs
FEATURE_GROUPS = 2  # groups of 16 output features a warp computes, reading x once for them all
TILE_N = 16 * FEATURE_GROUPS  # output features a block
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

# A warp's step: FEATURE_GROUPS groups of 16 features (lane group g holds features g and g + 8 of each)
# by TK = 4 * VALS of k, lane t of the group loading VALS consecutive k of each row (16 bytes). The
# products sum over k, so k may be renumbered inside a step as long as W and x agree: mma kk's
# fragment slots 2t, 2t+1 hold k = 16-byte chunk t's 4kk, 4kk+1 and slots 2t+8, 2t+9 its 4kk+2,
# 4kk+3, for W (A) and x (B) alike. Each lane then dequantizes only its own loaded words and reads x
# as 8-byte pieces, once for all its groups (the module says why).
SOURCE = """
    constexpr int VALS = 128 / BITS;   // weights in one lane's 16 bytes of a row: 16 (8-bit) or 32 (4-bit)
    constexpr int TK = 4 * VALS;       // k a warp covers a step
    constexpr int KK = VALS / 4;       // mma instructions a step (k 16 each) per group per tile of 8 rows
    __shared__ float sums[MT][FG][16 * 8];

    const int K = x_shape[1];
    const int N = w_shape[0];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * 16 * FG;
    const int steps = K / TK;
    const int groups = K / GROUP;
    const int64_t row_vecs = (int64_t)K * BITS / 128;  // 16-byte words a row of W
    const uint4* w_row = reinterpret_cast<const uint4*>(w) + (int64_t)(n0 + g) * row_vecs + t;
    const T* s_row = scales + (int64_t)(n0 + g) * groups;
    const T* b_row = biases + (int64_t)(n0 + g) * groups;
    const T* x_lane = x + (int64_t)g * K + t * VALS;  // row g of each tile of 8 rows

    float acc[FG][MT][4];
    #pragma unroll
    for (int f = 0; f < FG; ++f)
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc[f][mt][0] = acc[f][mt][1] = acc[f][mt][2] = acc[f][mt][3] = 0.0f;

    // The next step's words, scales and biases load before this step's are used: loads in flight
    // while we compute. Row r of a group: features 16f (h = 0) and 16f + 8 (h = 1) from the lane's g.
    uint4 next_w[FG][2];
    T next_s[FG][2], next_b[FG][2];
    int step = warp;
    if (step < steps) {
      const int gi = (step * TK + t * VALS) / GROUP;
      #pragma unroll
      for (int f = 0; f < FG; ++f)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t r = 16 * f + 8 * h;
          next_w[f][h] = w_row[r * row_vecs + step * 4];
          next_s[f][h] = s_row[r * groups + gi];
          next_b[f][h] = b_row[r * groups + gi];
        }
    }
    for (; step < steps; step += WARPS) {
      uint4 cur_w[FG][2];
      float cur_s[FG][2], cur_b[FG][2];
      #pragma unroll
      for (int f = 0; f < FG; ++f)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          cur_w[f][h] = next_w[f][h];
          cur_s[f][h] = static_cast<float>(next_s[f][h]);
          cur_b[f][h] = static_cast<float>(next_b[f][h]);
        }
      if (step + WARPS < steps) {
        const int gi = ((step + WARPS) * TK + t * VALS) / GROUP;
        #pragma unroll
        for (int f = 0; f < FG; ++f)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t r = 16 * f + 8 * h;
            next_w[f][h] = w_row[r * row_vecs + (step + WARPS) * 4];
            next_s[f][h] = s_row[r * groups + gi];
            next_b[f][h] = b_row[r * groups + gi];
          }
      }
      #pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        uint32_t b[MT][2];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xv = *reinterpret_cast<const uint2*>(x_lane + (int64_t)mt * 8 * K + step * TK + 4 * kk);
          b[mt][0] = xv.x;
          b[mt][1] = xv.y;
        }
        #pragma unroll
        for (int f = 0; f < FG; ++f) {
          const uint32_t* words_lo = reinterpret_cast<const uint32_t*>(&cur_w[f][0]);
          const uint32_t* words_hi = reinterpret_cast<const uint32_t*>(&cur_w[f][1]);
          float lo[4], hi[4];
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int i = 4 * kk + j;
            const uint32_t mask = (1u << BITS) - 1u;
            lo[j] = static_cast<float>((words_lo[i * BITS / 32] >> ((i * BITS) % 32)) & mask) * cur_s[f][0] + cur_b[f][0];
            hi[j] = static_cast<float>((words_hi[i * BITS / 32] >> ((i * BITS) % 32)) & mask) * cur_s[f][1] + cur_b[f][1];
          }
          const uint32_t a[4] = {pack2<T>(lo[0], lo[1]), pack2<T>(hi[0], hi[1]), pack2<T>(lo[2], lo[3]), pack2<T>(hi[2], hi[3])};
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_16816<T>(acc[f][mt], a, b[mt]);
        }
      }
    }
    // acc[f][mt]: features 16f + g (0, 1) and 16f + g + 8 (2, 3), rows 2t and 2t + 1 of tile mt.
    // The warps' sums are added in warp order, one warp at a time: the same order on every run.
    for (int w_ = 0; w_ < WARPS; ++w_) {
      if (warp == w_) {
        #pragma unroll
        for (int f = 0; f < FG; ++f)
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            float* s = sums[mt][f];
            const int i0 = g * 8 + 2 * t, i1 = (g + 8) * 8 + 2 * t;
            if (w_ == 0) {
              s[i0] = acc[f][mt][0]; s[i0 + 1] = acc[f][mt][1]; s[i1] = acc[f][mt][2]; s[i1 + 1] = acc[f][mt][3];
            } else {
              s[i0] += acc[f][mt][0]; s[i0 + 1] += acc[f][mt][1]; s[i1] += acc[f][mt][2]; s[i1 + 1] += acc[f][mt][3];
            }
          }
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < MT * 8 * 16 * FG; i += WARPS * 32) {
      const int n = i % (16 * FG), m = i / (16 * FG);
      out[(int64_t)m * N + n0 + n] = static_cast<T>(sums[m / 8][n / 16][(n % 16) * 8 + m % 8]);
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
                  ("WARPS", WARPS), ("FG", FEATURE_GROUPS)],
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
