/* corellm's own fp32 GEMM for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), the matmul of a
 * linear layer, on a copy of W packed once at load time.
 *
 * Built on first use by corellm.native (cc -O3 -march=native -fopenmp) and called through
 * ctypes. It is one of the GEMM paths that corellm.worker.cpu measures per weight shape and row
 * bucket at start-up ("native"): it is used only where it measured faster than the libraries'
 * paths on the machine at hand.
 *
 * Layout: W is packed in panels of NR = 2 vector widths of columns, [ceil(N / NR)][K][NR]
 * (zero-padded), so the NR weights of one k are one contiguous pair of vectors and a panel is
 * one contiguous stream.
 * Micro-kernel: an MR x NR tile of y (MR <= 6 rows: 12 vector accumulators, 2 weight vectors
 * and a broadcast input fit AVX2's 16 registers) is accumulated over the whole of K in
 * registers, one fused multiply-add per input element and weight vector, and stored once.
 * Threads split the panels (each streams its own share of W once per block of MC rows), and a
 * block of MC rows of x stays in cache while all the panels pass over it.
 *
 * Written with GCC/Clang vector extensions, not intrinsics: the vector width is the target's
 * (8 floats with AVX2, 16 with AVX-512), and another architecture gets the same code in its own
 * registers. Summation order: each output is the sum over k in order, in fp32, as a naive dot
 * product (numerically comparable to the libraries' blocked sums; tests compare with float64).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NR (2 * VW)
#define MR 6
#define MC 192          /* rows of x per block: 192 x K floats stay in L2 while panels pass */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));   /* unaligned access */

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }
#if VW == 16
static inline vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

int corellm_gemm_nr(void) { return NR; }

/* The packed size of an [n, k] weight, in floats. */
int64_t corellm_gemm_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

/* W [n, k], row stride ldw -> out [ceil(n / NR)][k][NR], zero-padded. */
void corellm_gemm_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *out,
                       int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float *o = out + p * k * NR;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            if (col < n) {
                const float *src = w + col * ldw;
                for (int64_t kk = 0; kk < k; ++kk) o[kk * NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; ++kk) o[kk * NR + j] = 0.f;
            }
        }
    }
}

/* One tile: rows [0, R) of x (row stride lda) times one panel b, plus bias (NR floats or
 * NULL), into c (row stride ldc, NR columns written). */
#define KERNEL(R)                                                                            \
static void tile_##R(int64_t k, const float *a, int64_t lda, const float *b,                \
                     const float *bias, float *c, int64_t ldc) {                             \
    vf c0[R], c1[R];                                                                         \
    const vf z0 = bias ? load(bias) : bcast(0.f), z1 = bias ? load(bias + VW) : bcast(0.f);  \
    for (int r = 0; r < R; ++r) { c0[r] = z0; c1[r] = z1; }                                  \
    _Pragma("GCC unroll 4")                                                                   \
    for (int64_t kk = 0; kk < k; ++kk) {                                                     \
        const vf b0 = load(b + kk * NR), b1 = load(b + kk * NR + VW);                        \
        for (int r = 0; r < R; ++r) {                                                        \
            const vf x = bcast(a[r * lda + kk]);                                             \
            c0[r] += x * b0;                                                                 \
            c1[r] += x * b1;                                                                 \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < R; ++r) { store(c + r * ldc, c0[r]); store(c + r * ldc + VW, c1[r]); } \
}
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, const float *, float *,
                        int64_t);
static const tile_fn tiles[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* y [m, n] (row stride ldy) = x [m, k] (row stride lda) @ W^T + bias (n floats, or NULL),
 * W packed by corellm_gemm_pack. */
void corellm_gemm(const float *x, int64_t lda, const float *packed, const float *bias,
                  float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel num_threads(num_threads)
    {
        float edge[MR * NR], edge_bias[NR];
        for (int64_t m0 = 0; m0 < m; m0 += MC) {
            const int64_t m1 = m - m0 < MC ? m : m0 + MC;
            /* no barrier between row blocks: every (block, panel) tile is written once */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; ++p) {
                const int64_t col = p * NR, width = n - col < NR ? n - col : NR;
                const float *b = packed + p * k * NR;
                const float *pb = bias ? bias + col : NULL;
                if (pb && width < NR) {
                    memset(edge_bias, 0, sizeof edge_bias);
                    memcpy(edge_bias, pb, (size_t)width * sizeof(float));
                    pb = edge_bias;
                }
                for (int64_t r0 = m0; r0 < m1; r0 += MR) {
                    const int64_t rows = m1 - r0 < MR ? m1 - r0 : MR;
                    if (width == NR) {
                        tiles[rows](k, x + r0 * lda, lda, b, pb, y + r0 * ldy + col, ldy);
                    } else {            /* the last, partial panel: through a full tile */
                        tiles[rows](k, x + r0 * lda, lda, b, pb, edge, NR);
                        for (int64_t r = 0; r < rows; ++r)
                            memcpy(y + (r0 + r) * ldy + col, edge + r * NR,
                                   (size_t)width * sizeof(float));
                    }
                }
            }
        }
    }
}
