/* CPU prefill kernels that need a fast float32 exp: the online softmax step of the blockwise
   attention (cpu_attention.py) and SwiGLU (cpu_swiglu.py).

   numpy's float32 exp runs at about 6 cycles an element here (no SIMD path on AVX2), as
   slow as an attention tile's two matmuls, and MLX's CPU exp and sigmoid are slower still.
   Both kernels use an 8-wide exp (Cephes' expf: range reduction by ln 2 and a degree-6
   polynomial, about 1 ulp), written with GCC/Clang vector types so it compiles to AVX2 or
   NEON. Compiled at first use by engine/native.py; callers keep their own fallback. */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* Lane-wise a if mask else b (C has no ?: on vectors); casts between same-size vectors
   reinterpret the bits. */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }

static inline v8f vmax(v8f a, v8f b) { return select8(a > b, a, b); }

static inline v8f vmin(v8f a, v8f b) { return select8(a < b, a, b); }

/* exp(x) with x clamped to [-87, 88]: below, exp(-87) is about 1.6e-38, which adds nothing
   a softmax row sum of at least 1 (or 1 + exp in a sigmoid) can see; above, float32 overflows. */
static inline v8f exp8(v8f x) {
    x = vmax(x, splat(-87.0f));
    x = vmin(x, splat(88.0f));
    const v8f magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v8f n = (x * splat(1.44269504088896341f) + magic) - magic;
    v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* The online softmax's step over one score tile, in two passes a row (max, then exp and sum)
   where numpy takes six.
   s: rows x n scores (row stride ld). Row r may see its first
   clamp(first_visible + r / rep + 1, 0, n) columns (the causal limit; pass first_visible >= n
   for none); the rest become 0. On return s holds exp(s - m_new), and for each row
   m = m_new (the running max), l = l * c + sum of the row, acc's row (dv wide, stride
   ld_acc) scaled by c, where c = exp(m_old - m_new). */
void softmax_tile(float *s, int64_t rows, int64_t n, int64_t ld, float *m, float *l, float *acc,
                  int64_t dv, int64_t ld_acc, int64_t first_visible, int64_t rep) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * ld;
        int64_t cnt = first_visible + r / rep + 1;
        cnt = cnt < 0 ? 0 : (cnt > n ? n : cnt);
        if (cnt == 0) {
            memset(row, 0, n * sizeof(float));
            continue;
        }
        int64_t full = cnt & ~(int64_t)7, quad = cnt & ~(int64_t)31;
        /* four running maxima: one chain of dependent max steps would wait on each other */
        v8f vm = splat(-INFINITY), vm1 = vm, vm2 = vm, vm3 = vm;
        for (int64_t j = 0; j < quad; j += 32) {
            vm = vmax(vm, load8(row + j));
            vm1 = vmax(vm1, load8(row + j + 8));
            vm2 = vmax(vm2, load8(row + j + 16));
            vm3 = vmax(vm3, load8(row + j + 24));
        }
        for (int64_t j = quad; j < full; j += 8) vm = vmax(vm, load8(row + j));
        vm = vmax(vmax(vm, vm1), vmax(vm2, vm3));
        float top = -INFINITY;
        for (int i = 0; i < 8; i++) top = vm[i] > top ? vm[i] : top;
        for (int64_t j = full; j < cnt; j++) top = row[j] > top ? row[j] : top;
        float m_new = m[r] > top ? m[r] : top;
        float c = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);

        v8f mv = splat(m_new), sum = splat(0.0f), sum1 = sum;
        int64_t pair = cnt & ~(int64_t)15;
        for (int64_t j = 0; j < pair; j += 16) { /* two sums, two exps in flight */
            v8f e = exp8(load8(row + j) - mv), e1 = exp8(load8(row + j + 8) - mv);
            store8(row + j, e);
            store8(row + j + 8, e1);
            sum += e;
            sum1 += e1;
        }
        for (int64_t j = pair; j < full; j += 8) {
            v8f e = exp8(load8(row + j) - mv);
            store8(row + j, e);
            sum += e;
        }
        sum += sum1;
        if (full < cnt) { /* the tail, through the same exp: padded, the padding not summed */
            float buf[8] = {0};
            memcpy(buf, row + full, (cnt - full) * sizeof(float));
            v8f e = exp8(load8(buf) - mv);
            store8(buf, e);
            for (int64_t j = full; j < cnt; j++) {
                row[j] = buf[j - full];
                sum[0] += buf[j - full];
            }
        }
        if (cnt < n) memset(row + cnt, 0, (n - cnt) * sizeof(float));
        float total = 0.0f;
        for (int i = 0; i < 8; i++) total += sum[i];
        l[r] = l[r] * c + total;
        m[r] = m_new;
        if (c != 1.0f) {
            float *a = acc + r * ld_acc;
            for (int64_t j = 0; j < dv; j++) a[j] *= c;
        }
    }
}

/* out = silu(gate) * x = gate * x / (1 + exp(-gate)), for n elements. */
void swiglu(const float *gate, const float *x, float *out, int64_t n) {
    int64_t full = n & ~(int64_t)7;
    for (int64_t j = 0; j < full; j += 8) {
        v8f g = load8(gate + j);
        store8(out + j, g * load8(x + j) / (splat(1.0f) + exp8(-g)));
    }
    if (full < n) {
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + full, (n - full) * sizeof(float));
        memcpy(u, x + full, (n - full) * sizeof(float));
        v8f r = load8(g) * load8(u) / (splat(1.0f) + exp8(-load8(g)));
        memcpy(out + full, &r, (n - full) * sizeof(float));
    }
}

/* CBLAS sgemm with 64-bit integers (numpy's bundled OpenBLAS: scipy_cblas_sgemm64_). */
typedef void (*sgemm64_fn)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                           const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                           int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* One work item of the blockwise attention, all in C so the thread holds no GIL: `rows` query
   rows q (rows x d, scaled, position-major over `rep` heads) against keys [0, last_key) of one
   kv head (k: row stride ldk; v: dv wide, row stride ldv), key_block keys a tile. m, l and acc
   (rows x dv) carry the online softmax; the caller divides acc by l. first_pos: the position
   of row 0 under the causal mask (row r sees keys <= first_pos + r / rep), or < 0 for none. */
void attention_rows(sgemm64_fn sgemm, const float *q, int64_t rows, int64_t d, const float *k, int64_t ldk,
                    const float *v, int64_t ldv, int64_t dv, int64_t last_key, int64_t key_block, float *tile,
                    float *m, float *l, float *acc, int64_t first_pos, int64_t rep) {
    for (int64_t k0 = 0; k0 < last_key; k0 += key_block) {
        int64_t n = last_key - k0 < key_block ? last_key - k0 : key_block;
        sgemm(ROW_MAJOR, NO_TRANS, TRANS, rows, n, d, 1.0f, q, d, k + k0 * ldk, ldk, 0.0f, tile, key_block);
        softmax_tile(tile, rows, n, key_block, m, l, acc, dv, dv, first_pos < 0 ? n : first_pos - k0, rep);
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, dv, n, 1.0f, tile, key_block, v + k0 * ldv, ldv, 1.0f, acc, dv);
    }
}

/* Every (batch row, kv head) of a small attention in one call (a decode or verify forward: the
   per-item calls from Python cost more than the work). q: (B, Hkv, rows, d), each head's rows
   position-major over `rep` query heads and scaled; k, v: row b, head h at k + b * kb + h * kh
   (rows of stride ldk / ldv). first_pos: per batch row, the position of its first query under the
   causal mask, or NULL for none. out: (B, Hkv, rows, dv), softmax(q k^T) v; m and l: (B, Hkv,
   rows) scratch; tile: rows x key_block scratch. */
void attention_heads(sgemm64_fn sgemm, const float *q, int64_t B, int64_t hkv, int64_t rows, int64_t d,
                     const float *k, int64_t kb, int64_t kh, int64_t ldk, const float *v, int64_t vb, int64_t vh,
                     int64_t ldv, int64_t dv, int64_t keys, const int64_t *first_pos, int64_t rep,
                     int64_t key_block, float *tile, float *m, float *l, float *out) {
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < hkv; h++) {
            int64_t item = b * hkv + h;
            float *mi = m + item * rows, *li = l + item * rows, *acc = out + item * rows * dv;
            for (int64_t r = 0; r < rows; r++) {
                mi[r] = -INFINITY;
                li[r] = 0.0f;
            }
            memset(acc, 0, rows * dv * sizeof(float));
            int64_t last_key = first_pos ? first_pos[b] + rows / rep : keys;
            attention_rows(sgemm, q + item * rows * d, rows, d, k + b * kb + h * kh, ldk, v + b * vb + h * vh, ldv,
                           dv, last_key, key_block, tile, mi, li, acc, first_pos ? first_pos[b] : -1, rep);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < dv; j++) acc[r * dv + j] /= li[r]; /* as the Python caller's acc /= l */
        }
    }
}
