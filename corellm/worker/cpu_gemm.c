/* corellm's own GEMM for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), the matmul of a
 * linear layer, in fp32 on a copy of W packed once at load time (fp32, or bf16 weights widened
 * to fp32 as they are read).
 *
 * Built on first use by corellm.native (cc -O3 -march=native -fopenmp -ffp-contract=fast) and
 * called through ctypes. It is one of the GEMM paths that corellm.worker.cpu measures per
 * weight shape and row bucket at start-up ("native"): it is used only where it measured faster
 * than the libraries' paths on the machine at hand.
 *
 * Layout: W is packed in panels of NR = 2 vector widths of columns, [ceil(N / NR)][K][NR]
 * (zero-padded), so the NR weights of one k are one contiguous pair of vectors and a panel is
 * one contiguous stream.
 * Micro-kernel: the MR x NR tiles of corellm/csrc/corellm_tile.h (shared with other native
 * libraries), each accumulated over the whole of K in registers and stored once.
 * Threads split the panels (each streams its own share of W once per block of MC rows), and a
 * block of MC rows of x stays in cache while all the panels pass over it.
 * bf16 weights: half the bytes to stream, each widened to fp32 in registers (a shift), exactly.
 * For a block of more than MR rows a panel is widened once into a per-thread scratch and the
 * fp32 tiles run on it, so the widening is not repeated per tile.
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

#include "corellm_tile.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

int omp_get_thread_num(void);      /* libgomp's, without needing omp.h at build time */

#define MC 192          /* rows of x per block: 192 x K floats stay in L2 while panels pass */

int corellm_gemm_nr(void) { return NR; }

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
#define PACK(W)                                                                               \
void corellm_gemm_pack_##W(const W##_t *w, int64_t ldw, int64_t n, int64_t k, W##_t *out,    \
                           int num_threads) {                                                 \
    const int64_t panels = (n + NR - 1) / NR;                                                 \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                     \
    for (int64_t p = 0; p < panels; ++p) {                                                    \
        W##_t *o = out + p * k * NR;                                                          \
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
}
PACK(f32)
#if !BF16_DOT
PACK(bf16)
#else
/* W [n, k] bf16 -> out [ceil(n / NR)][ceil(k / 2)][NR][2]: each column's pair (k even, k odd)
 * is one 32-bit lane; zero-padded in n and, for odd k, in the last pair. */
void corellm_gemm_pack_bf16(const bf16_t *w, int64_t ldw, int64_t n, int64_t k, bf16_t *out,
                            int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, k2 = (k + 1) / 2 * 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        bf16_t *o = out + p * k2 * NR;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            const bf16_t *src = col < n ? w + col * ldw : NULL;
            for (int64_t kk = 0; kk < k2; ++kk)
                o[(kk / 2 * NR + j) * 2 + (kk & 1)] = src && kk < k ? src[kk] : 0;
        }
    }
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
typedef void (*dot_tile_fn)(int64_t, const bf16_t *, int64_t, const bf16_t *, const float *,
                            float *, int64_t);
static const dot_tile_fn dot_tiles[MR + 1] = {0, dot_tile_1, dot_tile_2, dot_tile_3,
                                              dot_tile_4, dot_tile_5, dot_tile_6};
#endif

/* A bf16 panel of k rows as fp32, for a block of rows that would otherwise convert it once
 * per tile. */
static void widen(const bf16_t *b, int64_t k, float *out) {
    for (int64_t i = 0; i < k * NR; i += VW) store(out + i, load_bf16(b + i));
}

/* n fp32 values rounded to bf16 as torch rounds them: to nearest even, NaN -> 0x7fc0. */
static void round_bf16(bf16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u
                                                 : (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride lda) @ W^T + bias (n floats, or NULL), W
 * packed by corellm_gemm_pack_f32 (bf16 == 0) or corellm_gemm_pack_bf16 (bf16 == 1); x is
 * fp32, or bf16 where bf16 weights take dot products (BF16_DOT); y is fp32, or bf16 (y_bf16:
 * each tile is accumulated in fp32 and rounded once as it is stored). Returns -1, having
 * written nothing, when the scratch of widened bf16 panels cannot be allocated. */
static int gemm(const void *x, int64_t lda, const void *packed, int bf16, const float *bias,
                void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n, int64_t k,
                int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t panel = bf16 && BF16_DOT ? (k + 1) / 2 * 2 * NR : k * NR;   /* elements */
    float *wide = NULL;                 /* per thread: one panel widened to fp32 */
    if (bf16 && !BF16_DOT && m > MR) {
        wide = malloc((size_t)num_threads * (size_t)(k * NR) * sizeof(float));
        if (!wide) return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        float edge[MR * NR], edge_bias[NR];
        float *mine = wide ? wide + (int64_t)omp_get_thread_num() * k * NR : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += MC) {
            const int64_t m1 = m - m0 < MC ? m : m0 + MC;
            /* no barrier between row blocks: every (block, panel) tile is written once */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; ++p) {
                const int64_t col = p * NR, width = n - col < NR ? n - col : NR;
                const float *b32 = bf16 ? NULL : (const float *)packed + p * panel;
                const bf16_t *b16 = bf16 ? (const bf16_t *)packed + p * panel : NULL;
                if (b16 && !BF16_DOT && m1 - m0 > MR) {   /* several tiles: widen it once */
                    widen(b16, k, mine);
                    b32 = mine;
                    b16 = NULL;
                }
                const float *pb = bias ? bias + col : NULL;
                if (pb && width < NR) {
                    memset(edge_bias, 0, sizeof edge_bias);
                    memcpy(edge_bias, pb, (size_t)width * sizeof(float));
                    pb = edge_bias;
                }
                for (int64_t r0 = m0; r0 < m1; r0 += MR) {
                    const int64_t rows = m1 - r0 < MR ? m1 - r0 : MR;
                    const int direct = width == NR && !y_bf16;   /* else through edge */
                    float *c = direct ? (float *)y + r0 * ldy + col : edge;
                    const int64_t ldc = direct ? ldy : NR;
#if BF16_DOT
                    if (b16) dot_tiles[rows](k, (const bf16_t *)x + r0 * lda, lda, b16, pb, c,
                                             ldc);
#else
                    if (b16) tiles_bf16[rows](k, (const float *)x + r0 * lda, lda, b16, pb, c,
                                              ldc);
#endif
                    else tiles_f32[rows](k, (const float *)x + r0 * lda, lda, b32, pb, c, ldc);
                    if (y_bf16)
                        for (int64_t r = 0; r < rows; ++r)
                            round_bf16((bf16_t *)y + (r0 + r) * ldy + col, edge + r * NR, width);
                    else if (width < NR)        /* the last, partial panel: through a tile */
                        for (int64_t r = 0; r < rows; ++r)
                            memcpy((float *)y + (r0 + r) * ldy + col, edge + r * NR,
                                   (size_t)width * sizeof(float));
                }
            }
        }
    }
    free(wide);
    return 0;
}

int corellm_gemm_f32(const float *x, int64_t lda, const float *packed, const float *bias,
                     float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    return gemm(x, lda, packed, 0, bias, y, 0, ldy, m, n, k, num_threads);
}

/* y is bf16 [m, n] (row stride ldy), rounded once from the fp32 sums. */
int corellm_gemm_bf16(const void *x, int64_t lda, const bf16_t *packed, const float *bias,
                      bf16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    return gemm(x, lda, packed, 1, bias, y, 1, ldy, m, n, k, num_threads);
}
