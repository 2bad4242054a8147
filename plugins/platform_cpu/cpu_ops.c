/* Element-wise layers of a decoder in one pass each, for float32 and bfloat16 on the CPU:
 * RMSNorm, SiLU-and-multiply and rotary embeddings (rotate-half form); and greedy sampling's
 * argmax over the logits.
 *
 * Built on first use by corellm.native and called through ctypes (kernels.py).
 * Each replaces a chain of torch ops (RMSNorm: pow, mean, add, rsqrt, mul, mul; RoPE: two
 * index lookups, eight multiplies, two subtractions, two additions and two concatenations) that
 * each read and write the whole tensor and pay a dispatch. Rows are independent and each is
 * computed in a fixed order, so a row's result does not depend on the batch around it.
 *
 * Built with -ffp-contract=off: RoPE's multiplies and adds round as torch's separate ops do
 * (bit-equal to the torch path); RMSNorm's sum of squares and SiLU's exp differ from torch's
 * in the last bits (a different summation order and exp implementation). -ffast-math turns
 * divisions into a reciprocal estimate plus a Newton step, which gives NaN for an infinite
 * divisor: SiLU clamps exp's argument (exp(88) is finite; the result is -0 either way), and an
 * RMSNorm row holding an infinity comes out NaN where torch gives zeros (the input is broken
 * already).
 *
 * bfloat16: arithmetic in float32, rounded to bf16 wherever the torch code of the layer rounds
 * (every bf16 op of torch computes in float32 and rounds its result once): RMSNorm's normalized
 * row before the weight multiplies it, SiLU before the up projection multiplies it, RoPE's
 * cos/sin tables and each product and sum. So RoPE stays bit-equal to the torch code in bf16
 * too, and RMSNorm and SiLU differ only where their float32 value lies within float32 rounding
 * of a bf16 rounding boundary.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "corellm_pool.h"     /* the platform's thread pool */
#include "corellm_tile.h"     /* the platform's vector types (vf: one register of floats) and
                                 * bf16 conversions (corellm_bf16.h) */

/* bf16 rounding of a float32 value, kept as float32 (the value torch's next op reads). */
static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

/* Per element type: LD reads a value as float32; FIN rounds a layer's final value for storing;
 * RND rounds an intermediate value where the torch code of that dtype stores one (nothing in
 * float32, to bf16 and back in bf16). */
#define LD_f32(v) (v)
#define FIN_f32(v) (v)
#define RND_f32(v) (v)
#define LD_bf16(v) from_bf16(v)
#define FIN_bf16(v) to_bf16(v)
#define RND_bf16(v) round_bf16(v)

/* Loops run on the platform's thread pool (corellm_pool.h), a chunk of rows per call of a loop
 * body; a call of fewer than GRAIN_ELEMS elements runs on the calling thread. */
#define GRAIN_ELEMS 32768
static inline int64_t grain_rows(int64_t row_elems) {
    return row_elems > 0 ? (GRAIN_ELEMS + row_elems - 1) / row_elems : 1;
}

/* out[r, :] = w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)), the normalized row rounded as
 * torch stores it before the weight multiplies it. Row r of x is at
 * (r / inner) * outer_stride + (r % inner) * inner_stride; out is contiguous [rows, n]. */
#define RMS_NORM(T)                                                                          \
typedef struct {                                                                             \
    const T##_t *x, *w;                                                                      \
    T##_t *out;                                                                              \
    int64_t outer_stride, inner_stride, inner, n;                                            \
    float eps;                                                                               \
} rms_norm_args_##T;                                                                         \
static void rms_norm_rows_##T(void *ctx, int64_t r0, int64_t r1, int tid) {                  \
    const rms_norm_args_##T *a = ctx;                                                        \
    const int64_t n = a->n;                                                                  \
    (void)tid;                                                                               \
    for (int64_t r = r0; r < r1; ++r) {                                                      \
        const T##_t *xr = a->x + (r / a->inner) * a->outer_stride                            \
                          + (r % a->inner) * a->inner_stride;                                \
        T##_t *o = a->out + r * n;                                                           \
        float acc[16] = {0};                                                                 \
        int64_t i = 0;                                                                       \
        for (; i + 16 <= n; i += 16)                                                         \
            for (int j = 0; j < 16; ++j) {                                                   \
                const float v = LD_##T(xr[i + j]);                                           \
                acc[j] += v * v;                                                             \
            }                                                                                \
        float sum = 0.f;                                                                     \
        for (int j = 0; j < 16; ++j) sum += acc[j];                                          \
        for (; i < n; ++i) sum += LD_##T(xr[i]) * LD_##T(xr[i]);                             \
        const float inv = 1.f / sqrtf(sum / (float)n + a->eps);                              \
        for (int64_t k = 0; k < n; ++k)                                                      \
            o[k] = FIN_##T(LD_##T(a->w[k]) * RND_##T(LD_##T(xr[k]) * inv));                  \
    }                                                                                        \
}                                                                                            \
void corellm_rms_norm_##T(const T##_t *x, int64_t outer_stride, int64_t inner_stride,       \
                          int64_t inner, const T##_t *w, T##_t *out, int64_t rows, int64_t n, \
                          float eps) {                                                       \
    rms_norm_args_##T a = {x, w, out, outer_stride, inner_stride, inner, n, eps};            \
    corellm_parallel_for(rows, grain_rows(n), rms_norm_rows_##T, &a);                        \
}

/* out[t, :] = silu(x[t, :d]) * x[t, d:] for x [rows, 2d] contiguous, out [rows, d]; the SiLU
 * rounded as torch stores it before the product. */
#define SILU_AND_MUL(T)                                                                      \
typedef struct { const T##_t *x; T##_t *out; int64_t d; } silu_args_##T;                     \
static void silu_and_mul_rows_##T(void *ctx, int64_t t0, int64_t t1, int tid) {              \
    const silu_args_##T *a = ctx;                                                            \
    const int64_t d = a->d;                                                                  \
    (void)tid;                                                                               \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        const T##_t *g = a->x + t * 2 * d, *u = g + d;                                       \
        T##_t *o = a->out + t * d;                                                           \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < d; ++i) {                                                    \
            const float gi = LD_##T(g[i]);                                                   \
            o[i] = FIN_##T(RND_##T(gi / (1.f + expf(fminf(-gi, 88.f)))) * LD_##T(u[i]));     \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
void corellm_silu_and_mul_##T(const T##_t *x, T##_t *out, int64_t rows, int64_t d) {         \
    silu_args_##T a = {x, out, d};                                                           \
    corellm_parallel_for(rows, grain_rows(2 * d), silu_and_mul_rows_##T, &a);                \
}

/* Rotate, in place, the first rot dims of each of the heads of token t of x (head h of token
 * t at x + t * token_stride + h * head_stride) by the cos/sin row of positions[t] (float32
 * tables [P, rot / 2], rounded to the heads' dtype as torch converts them): x1' = x1 cos -
 * x2 sin, x2' = x2 cos + x1 sin over the two halves, each product rounded as torch stores it. */
#define ROPE(T)                                                                              \
static void rope_one_##T(T##_t *x, int64_t token_stride, int64_t head_stride, int64_t heads, \
                         int64_t t, const float *c, const float *s, int64_t half) {         \
    for (int64_t h = 0; h < heads; ++h) {                                                    \
        T##_t *x1 = x + t * token_stride + h * head_stride, *x2 = x1 + half;                 \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < half; ++i) {                                                 \
            const float a = LD_##T(x1[i]), b = LD_##T(x2[i]);                                \
            const float ci = RND_##T(c[i]), si = RND_##T(s[i]);                              \
            x1[i] = FIN_##T(RND_##T(a * ci) - RND_##T(b * si));                              \
            x2[i] = FIN_##T(RND_##T(b * ci) + RND_##T(a * si));                              \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
typedef struct {                                                                             \
    T##_t *q, *k;                                                                            \
    int64_t q_token_stride, q_head_stride, q_heads, k_token_stride, k_head_stride, k_heads;  \
    const int64_t *positions;                                                                \
    const float *cos_table, *sin_table;                                                      \
    int64_t half;                                                                            \
} rope_args_##T;                                                                             \
static void rope_tokens_##T(void *ctx, int64_t t0, int64_t t1, int tid) {                    \
    const rope_args_##T *a = ctx;                                                            \
    (void)tid;                                                                               \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        const float *c = a->cos_table + a->positions[t] * a->half;                           \
        const float *s = a->sin_table + a->positions[t] * a->half;                           \
        rope_one_##T(a->q, a->q_token_stride, a->q_head_stride, a->q_heads, t, c, s, a->half); \
        rope_one_##T(a->k, a->k_token_stride, a->k_head_stride, a->k_heads, t, c, s, a->half); \
    }                                                                                        \
}                                                                                            \
int corellm_rope_##T(T##_t *q, int64_t q_token_stride, int64_t q_head_stride,                \
                     int64_t q_heads, T##_t *k, int64_t k_token_stride,                      \
                     int64_t k_head_stride, int64_t k_heads, const int64_t *positions,       \
                     int64_t tokens, const float *cos_table, const float *sin_table,         \
                     int64_t table_rows, int64_t rot) {                                      \
    for (int64_t t = 0; t < tokens; ++t)       /* outside the tables: nothing is rotated */  \
        if (positions[t] < 0 || positions[t] >= table_rows) return -1;                       \
    rope_args_##T a = {q, k, q_token_stride, q_head_stride, q_heads, k_token_stride,         \
                       k_head_stride, k_heads, positions, cos_table, sin_table, rot / 2};    \
    corellm_parallel_for(tokens, grain_rows((q_heads + k_heads) * rot), rope_tokens_##T, &a); \
    return 0;                                                                                \
}

RMS_NORM(f32)
RMS_NORM(bf16)
SILU_AND_MUL(f32)
SILU_AND_MUL(bf16)
ROPE(f32)
ROPE(bf16)

/* out[r] = the index of the first maximum of row r of x [rows, n] (row stride ld), NaN counting
 * as the maximum (its first occurrence), as torch's max(dim=-1).indices and argmax give it: greedy
 * sampling's pass over the logits, one row per thread at a time, a vector register of running
 * maxima and their indices per row. (NaN is found from the bits: this file is built with
 * -ffast-math, under which a float comparison may not see it.) */
typedef struct { const float *x; int64_t ld, n; int64_t *out; } argmax_args;

static void argmax_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    const argmax_args *a = ctx;
    const int64_t n = a->n;
    (void)tid;
    for (int64_t r = r0; r < r1; ++r) {
        const float *xr = a->x + r * a->ld;
        const uint32_t *bits = (const uint32_t *)xr;
        int64_t best_i = 0, i = 0;
        float best = xr[0];
        int nan = 0;
        if (n >= 2 * VW && n < ((int64_t)1 << 31)) {
            vf bv = load(xr);
            vi bidx, idx, vnan = ((vi)bv & 0x7fffffff) > 0x7f800000;
            for (int l = 0; l < VW; ++l) { bidx[l] = l; idx[l] = l + VW; }
            for (i = VW; i + VW <= n; i += VW, idx += VW) {
                const vf v = load(xr + i);
                const vi m = v > bv;
                bv = vselect(m, v, bv);
                bidx = (idx & m) | (bidx & ~m);
                vnan |= ((vi)v & 0x7fffffff) > 0x7f800000;
            }
            best = bv[0];
            best_i = bidx[0];
            for (int l = 0; l < VW; ++l) {
                nan |= vnan[l];
                if (bv[l] > best || (bv[l] == best && bidx[l] < best_i)) {
                    best = bv[l];
                    best_i = bidx[l];
                }
            }
        }
        for (; i < n; ++i) {
            nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
            if (xr[i] > best) { best = xr[i]; best_i = i; }
        }
        if (nan)                                      /* the first NaN (the rare case) */
            for (best_i = 0; (bits[best_i] & 0x7fffffffu) <= 0x7f800000u; ++best_i) {}
        a->out[r] = best_i;
    }
}

void corellm_argmax_f32(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out) {
    argmax_args a = {x, ld, n, out};
    corellm_parallel_for(rows, grain_rows(n), argmax_rows, &a);
}
