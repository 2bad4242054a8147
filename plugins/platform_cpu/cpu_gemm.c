/* corellm's own GEMM for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), the matmul of a
 * linear layer, in fp32 on a copy of W packed once at load time (fp32, or bf16 weights widened
 * to fp32 as they are read).
 *
 * Built on first use by the CPU platform's native.py (cc -O3 -march=native -ffp-contract=fast)
 * and called through ctypes (gemm.py). It is one of the GEMM paths that gemm.py measures per
 * weight shape and row bucket at start-up ("native"): it is used only where it measured faster
 * than the libraries' paths on the machine at hand.
 *
 * Layout: W is packed in panels of NR = 2 vector widths of columns, [ceil(N / NR)][K][NR]
 * (zero-padded), so the NR weights of one k are one contiguous pair of vectors and a panel is
 * one contiguous stream.
 * Micro-kernel: the MR x NR tiles of csrc/corellm_tile.h (shared with other native
 * libraries), each accumulated over the whole of K in registers and stored once.
 * The platform's thread pool (corellm_pool.h) shares out the panels of each block of MC rows
 * (a thread streams the panels it claims), and a block of MC rows of x stays in cache while all
 * the panels pass over it.
 * bf16 weights: half the bytes to stream, each widened to fp32 in registers (a shift), exactly.
 * For a block of more than one tile's rows a panel is widened once into a per-thread scratch and
 * the fp32 tiles run on it, so the widening is not repeated per tile.
 *
 * CPUs with AVX512-BF16 (built with -march=native there): bf16 weights are packed in pairs of k,
 * [ceil(N / NR)][ceil(K / 2)][NR][2], and a bf16 input (not widened) meets them in
 * dot-product instructions, each multiplying two bf16 pairs exactly and adding both products
 * to an fp32 accumulator (odd k first, then even; denormals flushed): twice the multiply-adds
 * of an fp32 FMA per instruction, and no widening.
 *
 * Summation order: each output is one sum over k in order, in fp32 (with bf16 dot products:
 * over the pairs of k in order, each pair's odd product added before its even one, denormals
 * flushed), so a row's result does not depend on the other rows or on the thread count (tests
 * compare with float64).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "corellm_pool.h"
#include "corellm_tile.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

#define MC 192          /* rows of x per block: 192 x K floats stay in L2 while panels pass */

/* Rows per tile: MR (8 with AVX-512) for calls of up to MR_SMALL_M rows (decode batches), where a
 * panel streamed from memory feeds more multiply-adds per byte; 6 for more rows, where the panels
 * are in cache and the taller tile gains nothing (it measured even to slightly slower there).
 * 64 is also the edge of the GEMM plans' row buckets (cpu.py). */
#define MR_SMALL_M 64
#define MR_LARGE_M 6

int corellm_gemm_nr(void) { return NR; }
int corellm_gemm_mr(void) { return MR; }     /* rows per tile for calls of up to MR_SMALL_M */

/* 1 where bf16 weights meet a bf16 input in dot-product instructions (then corellm_gemm_bf16
 * takes bf16 rows of x), 0 where they are widened to meet an fp32 input. */
int corellm_gemm_bf16_dot(void) { return BF16_DOT; }

/* The packed size of an [n, k] weight, in elements (fp32 or bf16). */
int64_t corellm_gemm_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }
int64_t corellm_gemm_packed_size_bf16(int64_t n, int64_t k) {
    return corellm_gemm_packed_size(n, BF16_DOT ? (k + 1) / 2 * 2 : k);
}

/* W [n, k], row stride ldw -> out [ceil(n / NR)][k][NR], zero-padded (elements of 4 or 2
 * bytes: fp32 or bf16, copied as they are). */
typedef struct { const void *w; int64_t ldw, n, k; void *out; } pack_args;
#define PACK(W)                                                                               \
static void pack_panels_##W(void *ctx, int64_t p0, int64_t p1, int tid) {                     \
    const pack_args *a = ctx;                                                                 \
    const W##_t *w = a->w;                                                                    \
    const int64_t ldw = a->ldw, n = a->n, k = a->k;                                           \
    (void)tid;                                                                                \
    for (int64_t p = p0; p < p1; ++p) {                                                       \
        W##_t *o = (W##_t *)a->out + p * k * NR;                                              \
        for (int64_t j = 0; j < NR; ++j) {                                                    \
            const int64_t col = p * NR + j;                                                   \
            if (col < n) {                                                                    \
                const W##_t *src = w + col * ldw;                                             \
                for (int64_t kk = 0; kk < k; ++kk) o[kk * NR + j] = src[kk];                  \
            } else {                                                                          \
                for (int64_t kk = 0; kk < k; ++kk) o[kk * NR + j] = 0;                        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}                                                                                             \
void corellm_gemm_pack_##W(const W##_t *w, int64_t ldw, int64_t n, int64_t k, W##_t *out) {  \
    pack_args a = {w, ldw, n, k, out};                                                        \
    corellm_parallel_for((n + NR - 1) / NR, 1, pack_panels_##W, &a);                          \
}
PACK(f32)
#if !BF16_DOT
PACK(bf16)
#else
/* W [n, k] bf16 -> out [ceil(n / NR)][ceil(k / 2)][NR][2]: each column's pair (k even, k odd)
 * is one 32-bit lane; zero-padded in n and, for odd k, in the last pair. */
static void pack_panels_pairs(void *ctx, int64_t p0, int64_t p1, int tid) {
    const pack_args *a = ctx;
    const bf16_t *w = a->w;
    const int64_t ldw = a->ldw, n = a->n, k = a->k, k2 = (k + 1) / 2 * 2;
    (void)tid;
    for (int64_t p = p0; p < p1; ++p) {
        bf16_t *o = (bf16_t *)a->out + p * k2 * NR;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            const bf16_t *src = col < n ? w + col * ldw : NULL;
            for (int64_t kk = 0; kk < k2; ++kk)
                o[(kk / 2 * NR + j) * 2 + (kk & 1)] = src && kk < k ? src[kk] : 0;
        }
    }
}

void corellm_gemm_pack_bf16(const bf16_t *w, int64_t ldw, int64_t n, int64_t k, bf16_t *out) {
    pack_args a = {w, ldw, n, k, out};
    corellm_parallel_for((n + NR - 1) / NR, 1, pack_panels_pairs, &a);
}
#endif

TILES(f32, load_f32)
#if !BF16_DOT
TILES(bf16, load_bf16)
#endif

#if BF16_DOT
/* One tile with bf16 dot products: rows [0, R) of a bf16 x (row stride lda) times one panel
 * of pairs b, plus bias (NR floats or NULL), into c (row stride ldc). */
static inline __m512 dot(__m512 acc, __m512i w, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)pair));
}
#define DOT_KERNEL(R)                                                                         \
static void dot_tile_##R(int64_t k, const bf16_t *a, int64_t lda, const bf16_t *b,           \
                         const float *bias, float *c, int64_t ldc) {                          \
    __m512 c0[R], c1[R];                                                                      \
    const __m512 z0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                     \
    const __m512 z1 = bias ? _mm512_loadu_ps(bias + VW) : _mm512_setzero_ps();                \
    for (int r = 0; r < R; ++r) { c0[r] = z0; c1[r] = z1; }                                   \
    const int64_t pairs = k / 2;                                                              \
    _Pragma("GCC unroll 4")                                                                    \
    for (int64_t q = 0; q < pairs; ++q) {                                                     \
        const __m512i b0 = _mm512_loadu_si512(b + q * 2 * NR);                                \
        const __m512i b1 = _mm512_loadu_si512(b + q * 2 * NR + 2 * VW);                       \
        for (int r = 0; r < R; ++r) {                                                         \
            uint32_t pair;                                                                    \
            memcpy(&pair, a + r * lda + 2 * q, sizeof pair);                                  \
            c0[r] = dot(c0[r], b0, pair);                                                     \
            c1[r] = dot(c1[r], b1, pair);                                                     \
        }                                                                                     \
    }                                                                                         \
    if (k & 1) {                       /* the last k alone: its pair's upper half is zero */  \
        const __m512i b0 = _mm512_loadu_si512(b + pairs * 2 * NR);                            \
        const __m512i b1 = _mm512_loadu_si512(b + pairs * 2 * NR + 2 * VW);                   \
        for (int r = 0; r < R; ++r) {                                                         \
            const uint32_t pair = a[r * lda + k - 1];                                         \
            c0[r] = dot(c0[r], b0, pair);                                                     \
            c1[r] = dot(c1[r], b1, pair);                                                     \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < R; ++r) {                                                             \
        _mm512_storeu_ps(c + r * ldc, c0[r]);                                                 \
        _mm512_storeu_ps(c + r * ldc + VW, c1[r]);                                            \
    }                                                                                         \
}
DOT_KERNEL(1) DOT_KERNEL(2) DOT_KERNEL(3) DOT_KERNEL(4) DOT_KERNEL(5) DOT_KERNEL(6)
DOT_KERNEL(7) DOT_KERNEL(8)
_Static_assert(MR == 8, "bf16 dot-product tiles: 1 to 8 rows (AVX-512's MR)");
typedef void (*dot_tile_fn)(int64_t, const bf16_t *, int64_t, const bf16_t *, const float *,
                            float *, int64_t);
static const dot_tile_fn dot_tiles[MR + 1] = {0, dot_tile_1, dot_tile_2, dot_tile_3,
                                              dot_tile_4, dot_tile_5, dot_tile_6, dot_tile_7,
                                              dot_tile_8};
#endif

/* A bf16 panel of k rows as fp32, for a block of rows that would otherwise convert it once
 * per tile. */
static void widen(const bf16_t *b, int64_t k, float *out) {
    for (int64_t i = 0; i < k * NR; i += VW) store(out + i, load_bf16(b + i));
}

/* n fp32 values rounded to bf16 as torch rounds them: to nearest even, NaN -> 0x7fc0. */
static void round_bf16(bf16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

/* exp(x) for x in [-87.3, 88], each lane to within about 2 ulp: x = n ln2 + r with |r| <=
 * ln2 / 2, exp(r) by Cephes' degree-7 polynomial and 2^n put into the exponent bits. */
static inline vf vexp(vf x) {
    const vf magic = bcast(12582912.f);                 /* 1.5 * 2^23: rounds to an integer */
    const vf t = x * bcast(1.44269504088896341f) + magic;
    const vf n = t - magic;
    vf r = x - n * bcast(0.693359375f);
    r = r - n * bcast(-2.12194440e-4f);
    vf p = bcast(1.9875691500e-4f);
    p = p * r + bcast(1.3981999507e-3f);
    p = p * r + bcast(8.3334519073e-3f);
    p = p * r + bcast(4.1665795894e-2f);
    p = p * r + bcast(1.6666665459e-1f);
    p = p * r + bcast(5.0000001201e-1f);
    p = p * (r * r) + r + bcast(1.f);
    const vi scale = (((vi)t - (vi)magic) + 127) << 23;  /* t's low bits hold n */
    return p * (vf)scale;
}

static inline vf vclamp(vf x, float lo, float hi) {     /* NaN stays NaN */
    const vf vlo = bcast(lo), vhi = bcast(hi);
    return vselect(x < vlo, vlo, vselect(x > vhi, vhi, x));
}


/* SiLU-and-multiply of one row of a tile pair: out[0, NR) = silu(g) * u, computed as the
 * unfused layers compute it from the GEMM's stored output: in bf16 (y_bf16), g and u rounded
 * to bf16 first and the SiLU rounded before the product; silu(g) = g / (1 + exp(-g)). */
static void silu_mul_row(const float *g, const float *u, void *out, int y_bf16) {
    float row[NR];
    for (int i = 0; i < NR; i += VW) {
        vf gv = load(g + i), uv = load(u + i);
        if (y_bf16) { gv = vround_bf16(gv); uv = vround_bf16(uv); }
        vf s = gv / (bcast(1.f) + vexp(vclamp(-gv, -87.3f, 88.f)));
        if (y_bf16) s = vround_bf16(s);
        store(row + i, s * uv);
    }
    if (y_bf16) round_bf16((bf16_t *)out, row, NR);
    else memcpy(out, row, sizeof row);
}

/* RMSNorm of rows [0, rows) of x (row stride lda) into out [rows][k], as the RMSNorm layer
 * computes it: inv = 1 / sqrt(mean(x^2) + eps), out = w * (x * inv); in a bf16 model (bf16_model)
 * x * inv is rounded to bf16 before w multiplies it and the product is rounded too. x is fp32
 * or bf16 (x_bf16), w is the layer's dtype, out is fp32 or bf16 (out_bf16: what the tiles
 * read). */
static inline float bf16_value_of(bf16_t b) { return from_bf16(b); }   /* exact */
static inline float bf16_value(float f) {              /* rounded to bf16, kept as fp32 */
    return from_bf16(to_bf16(f));
}
static void rms_rows(const void *x, int x_bf16, int64_t lda, int64_t rows, int64_t k,
                     const void *w, int bf16_model, float eps, void *out, int out_bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xf = x_bf16 ? NULL : (const float *)x + r * lda;
        const bf16_t *xb = x_bf16 ? (const bf16_t *)x + r * lda : NULL;
#define XV(i) (xf ? xf[i] : bf16_value_of(xb[i]))
        float acc[16] = {0}, sum = 0.f;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16)
            for (int j = 0; j < 16; ++j) acc[j] += XV(i + j) * XV(i + j);
        for (int j = 0; j < 16; ++j) sum += acc[j];
        for (; i < k; ++i) sum += XV(i) * XV(i);
        const float inv = 1.f / __builtin_sqrtf(sum / (float)k + eps);
        if (!bf16_model) {
            const float *wf = w;
            float *o = (float *)out + r * k;
            for (int64_t c = 0; c < k; ++c) o[c] = wf[c] * (XV(c) * inv);
            continue;
        }
        const bf16_t *wb = w;
        for (int64_t c = 0; c < k; ++c) {
            const float v = bf16_value(bf16_value_of(wb[c]) * bf16_value(XV(c) * inv));
            if (out_bf16) {
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                ((bf16_t *)out)[r * k + c] = (bf16_t)(u >> 16);    /* exact: v is a bf16 value */
            } else {
                ((float *)out)[r * k + c] = v;
            }
        }
#undef XV
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride lda) @ W^T + bias (n floats, or NULL), W
 * packed by corellm_gemm_pack_f32 (bf16 == 0) or corellm_gemm_pack_bf16 (bf16 == 1); x is
 * fp32, or bf16 where bf16 weights take dot products (BF16_DOT); y is fp32, or bf16 (y_bf16:
 * each tile is accumulated in fp32 and rounded once as it is stored).
 * silu_mul: W is [gate; up], two halves of n / 2 rows each (n / 2 a multiple of NR), and y
 * [m, n / 2] = silu(x @ gate^T) * (x @ up^T), the pair of tiles of panel p and panel p + n / 2NR
 * multiplied while they are in L1 (the layer's [m, n] output is never written).
 * norm_w (k values of the weights' dtype, or NULL): x is the input of an RMSNorm layer (weight
 * norm_w, epsilon eps) whose output is the GEMM's input; the threads normalize the rows into a
 * scratch first (rows split between them, once per call) and the tiles read it.
 * Returns -1, having written nothing, when a scratch cannot be allocated. */
typedef struct {
    const void *x, *packed, *norm_w, *xb;
    const float *bias;
    void *y, *normed;
    float *wide;
    int nwide;                          /* threads with a scratch in wide */
    int64_t lda, ldy, ldx, m, n, k, panels, half, panel, ways, mr, cols;
    int bf16, y_bf16, x_bf16, silu_mul;
    float eps;
} gemm_args;

/* Rows [r0, r1) of x normalized into the scratch the tiles read. */
static void norm_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    const gemm_args *a = ctx;
    (void)tid;
    for (int64_t r = r0; r < r1; ++r)
        rms_rows(a->x_bf16 ? (const void *)((const bf16_t *)a->x + r * a->lda)
                           : (const void *)((const float *)a->x + r * a->lda),
                 a->x_bf16, a->lda, 1, a->k, a->norm_w, a->bf16, a->eps,
                 a->x_bf16 ? (void *)((bf16_t *)a->normed + r * a->k)
                           : (void *)((float *)a->normed + r * a->k), a->x_bf16);
}

/* Items [i0, i1) of the call: item i is panel i % cols of the block of MC rows i / cols (every
 * (block, panel) tile is written once, so items need no order). */
static void gemm_items(void *ctx, int64_t i0, int64_t i1, int tid) {
    const gemm_args *a = ctx;
    const int64_t m = a->m, n = a->n, k = a->k, half = a->half, panel = a->panel;
    const int64_t mr = a->mr, ldx = a->ldx, ldy = a->ldy;
    const int bf16 = a->bf16, y_bf16 = a->y_bf16, silu_mul = a->silu_mul;
    const float *bias = a->bias;
    const void *xb = a->xb, *packed = a->packed;
    void *y = a->y;
    float edge[MR * NR], edge_bias[NR], up[MR * NR];
    float *mine = a->wide && tid < a->nwide ? a->wide + (int64_t)tid * a->ways * k * NR : NULL;
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t m0 = i / a->cols * MC, p = i % a->cols;
        const int64_t m1 = m - m0 < MC ? m : m0 + MC;
        const int64_t col = p * NR, width = n - col < NR ? n - col : NR;
        const float *b32 = bf16 ? NULL : (const float *)packed + p * panel;
        const bf16_t *b16 = bf16 ? (const bf16_t *)packed + p * panel : NULL;
        /* silu_mul: the up panel (always full: n / 2 is a multiple of NR) */
        const float *u32 = silu_mul && !bf16 ? b32 + half * panel : NULL;
        const bf16_t *u16 = silu_mul && bf16 ? b16 + half * panel : NULL;
        if (b16 && !BF16_DOT && m1 - m0 > mr && mine) {   /* several tiles: widen it once */
            widen(b16, k, mine);
            b32 = mine;
            b16 = NULL;
            if (u16) {
                widen(u16, k, mine + k * NR);
                u32 = mine + k * NR;
                u16 = NULL;
            }
        }
        const float *pb = bias ? bias + col : NULL;
        const float *ub = bias && silu_mul ? bias + col + half * NR : NULL;
        if (pb && width < NR) {
            memset(edge_bias, 0, sizeof edge_bias);
            memcpy(edge_bias, pb, (size_t)width * sizeof(float));
            pb = edge_bias;
        }
        for (int64_t r0 = m0; r0 < m1; r0 += mr) {
            const int64_t rows = m1 - r0 < mr ? m1 - r0 : mr;
            const int direct = width == NR && !y_bf16 && !silu_mul;   /* else via edge */
            const int64_t ar = r0 * ldx;                    /* row r0 of x in xb */
            float *c = direct ? (float *)y + r0 * ldy + col : edge;
            const int64_t ldc = direct ? ldy : NR;
#if BF16_DOT
            if (b16) {
                dot_tiles[rows](k, (const bf16_t *)xb + ar, ldx, b16, pb, c, ldc);
                if (u16) dot_tiles[rows](k, (const bf16_t *)xb + ar, ldx, u16, ub, up, NR);
            }
#else
            if (b16) {
                tiles_bf16[rows](k, (const float *)xb + ar, ldx, b16, pb, c, ldc);
                if (u16) tiles_bf16[rows](k, (const float *)xb + ar, ldx, u16, ub, up, NR);
            }
#endif
            else {
                tiles_f32[rows](k, (const float *)xb + ar, ldx, b32, pb, c, ldc);
                if (u32) tiles_f32[rows](k, (const float *)xb + ar, ldx, u32, ub, up, NR);
            }
            if (silu_mul)
                for (int64_t r = 0; r < rows; ++r)
                    silu_mul_row(edge + r * NR, up + r * NR,
                                 y_bf16 ? (void *)((bf16_t *)y + (r0 + r) * ldy + col)
                                        : (void *)((float *)y + (r0 + r) * ldy + col),
                                 y_bf16);
            else if (y_bf16)
                for (int64_t r = 0; r < rows; ++r)
                    round_bf16((bf16_t *)y + (r0 + r) * ldy + col, edge + r * NR, width);
            else if (width < NR)        /* the last, partial panel: through a tile */
                for (int64_t r = 0; r < rows; ++r)
                    memcpy((float *)y + (r0 + r) * ldy + col, edge + r * NR,
                           (size_t)width * sizeof(float));
        }
    }
}

static int gemm(const void *x, int64_t lda, const void *packed, int bf16, const float *bias,
                void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n, int64_t k,
                int silu_mul, const void *norm_w, float eps) {
    gemm_args a = {0};
    a.x = x; a.lda = lda; a.packed = packed; a.bf16 = bf16; a.bias = bias; a.y = y;
    a.y_bf16 = y_bf16; a.ldy = ldy; a.m = m; a.n = n; a.k = k; a.silu_mul = silu_mul;
    a.norm_w = norm_w; a.eps = eps;
    a.panels = (n + NR - 1) / NR;
    a.half = silu_mul ? a.panels / 2 : 0;                   /* the up panel of p is p + half */
    a.panel = bf16 && BF16_DOT ? (k + 1) / 2 * 2 * NR : k * NR;   /* elements */
    a.ways = silu_mul ? 2 : 1;                                /* panels widened at once */
    a.x_bf16 = bf16 && BF16_DOT;                              /* else x is fp32 */
    a.mr = m <= MR_SMALL_M ? MR : MR_LARGE_M;                 /* rows per tile */
    a.cols = silu_mul ? a.half : a.panels;
    if (m == 0) return 0;
    if (bf16 && !BF16_DOT && m > a.mr) {    /* per thread: the panel(s) widened to fp32 */
        a.nwide = corellm_pool_threads();
        a.wide = malloc((size_t)a.nwide * (size_t)(a.ways * k * NR) * sizeof(float));
        if (!a.wide) return -1;
    }
    if (norm_w && k > 0) {               /* (k == 0: no rows to read) */
        a.normed = malloc((size_t)m * (size_t)k * (a.x_bf16 ? sizeof(bf16_t) : sizeof(float)));
        if (!a.normed) { free(a.wide); return -1; }
        corellm_parallel_for(m, 1, norm_rows, &a);     /* all rows before any tile reads them */
    }
    /* what the tiles read: x, or its normalized copy */
    a.xb = a.normed ? a.normed : x;
    a.ldx = a.normed ? k : lda;
    corellm_parallel_for((m + MC - 1) / MC * a.cols, 1, gemm_items, &a);
    free(a.wide);
    free(a.normed);
    return 0;
}

/* The exported GEMMs: norm_w/eps as gemm() takes them (NULL: no RMSNorm). */
int corellm_gemm_f32(const float *x, int64_t lda, const float *packed, const float *bias,
                     float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                     const float *norm_w, float eps) {
    return gemm(x, lda, packed, 0, bias, y, 0, ldy, m, n, k, 0, norm_w, eps);
}

/* y is bf16 [m, n] (row stride ldy), rounded once from the fp32 sums. */
int corellm_gemm_bf16(const void *x, int64_t lda, const bf16_t *packed, const float *bias,
                      bf16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                      const bf16_t *norm_w, float eps) {
    return gemm(x, lda, packed, 1, bias, y, 1, ldy, m, n, k, 0, norm_w, eps);
}

/* y [m, n / 2] = silu(x @ gate^T + bias_gate) * (x @ up^T + bias_up) for W = [gate; up] [n, k]
 * packed as above; -2 (nothing written) unless n / 2 is a multiple of NR. */
int corellm_gemm_silu_mul_f32(const float *x, int64_t lda, const float *packed,
                              const float *bias, float *y, int64_t ldy, int64_t m, int64_t n,
                              int64_t k, const float *norm_w, float eps) {
    if (n % (2 * NR)) return -2;
    return gemm(x, lda, packed, 0, bias, y, 0, ldy, m, n, k, 1, norm_w, eps);
}

int corellm_gemm_silu_mul_bf16(const void *x, int64_t lda, const bf16_t *packed,
                               const float *bias, bf16_t *y, int64_t ldy, int64_t m, int64_t n,
                               int64_t k, const bf16_t *norm_w, float eps) {
    if (n % (2 * NR)) return -2;
    return gemm(x, lda, packed, 1, bias, y, 1, ldy, m, n, k, 1, norm_w, eps);
}
