/* corellm's register-blocked fp32 micro-kernel for the CPU, shared by the native libraries
 * that multiply small matrices (the CPU platform's GEMM, cpu_gemm.c; the torch_sdpa plugin's
 * prefill attention, paged_cpu.c). A library includes it (the CPU platform's native.py puts
 * this folder on the include path and keys its cache on these headers too) and instantiates the
 * tiles it needs: TILES(f32, load_f32), and TILES(bf16, load_bf16) for panels of bf16 values
 * widened to fp32 as they are read.
 *
 * A tile is up to MR x NR of the output (NR = 2 vector widths; MR = 6 rows with AVX2: 12 vector
 * accumulators, 2 panel vectors and a broadcast input fit its 16 registers; MR = 8 with AVX-512's
 * 32: a panel streamed from memory then feeds 16 multiply-adds per k instead of 12, and 64 rows
 * are 8 whole tiles. That pays while the weights come from memory (few rows of x); once the
 * panels are in cache the taller tile gains nothing and costs a little, so the GEMM takes 8-row
 * tiles only for calls of up to 64 rows), accumulated over the whole of k in registers, one fused
 * multiply-add per input element and panel vector (in order of k:
 * each output is one fp32 sum, whatever the other rows), and stored once. The panel b holds
 * NR values per k, contiguous: [k][NR].
 *
 * Written with GCC/Clang vector extensions, not intrinsics: the vector width is the target's
 * (8 floats with AVX2, 16 with AVX-512), and another architecture gets the same code in its
 * own registers.
 */
#ifndef CORELLM_TILE_H
#define CORELLM_TILE_H

#include <stdint.h>

#include "corellm_bf16.h"

typedef float f32_t;

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NR (2 * VW)
#if VW == 16
#define MR 8
#else
#define MR 6
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));   /* unaligned access */

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }
#if VW == 16
static inline vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));  /* lanes of a comparison's mask */

/* Per lane: a where the mask (a comparison of vf, all ones or zeros) is set, else b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* The vector forms of corellm_bf16.h's conversions, lane by lane the same bits. */
static inline vf load_f32(const float *p) { return load(p); }
static inline vf load_bf16(const uint16_t *p) {     /* bf16 -> fp32: the top half of the bits */
    return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16);
}
/* Each lane rounded to bf16 and back as torch rounds (to nearest even; NaN -> 0x7fc0). */
static inline vf vround_bf16(vf x) {
    const vu u = (vu)x, nan = (vu)(x != x);
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (vf)((r & ~nan) | (0x7fc00000u & nan));
}

/* One tile: rows [0, R) of x (row stride lda) times one panel b, plus bias (NR floats or
 * NULL), into c (row stride ldc, NR columns written). */
#define KERNEL(R, W, LOAD)                                                                   \
static void tile_##W##_##R(int64_t k, const float *a, int64_t lda, const W##_t *b,          \
                           const float *bias, float *c, int64_t ldc) {                       \
    vf c0[R], c1[R];                                                                         \
    const vf z0 = bias ? load(bias) : bcast(0.f), z1 = bias ? load(bias + VW) : bcast(0.f);  \
    for (int r = 0; r < R; ++r) { c0[r] = z0; c1[r] = z1; }                                  \
    _Pragma("GCC unroll 4")                                                                   \
    for (int64_t kk = 0; kk < k; ++kk) {                                                     \
        const vf b0 = LOAD(b + kk * NR), b1 = LOAD(b + kk * NR + VW);                        \
        for (int r = 0; r < R; ++r) {                                                        \
            const vf x = bcast(a[r * lda + kk]);                                             \
            c0[r] += x * b0;                                                                 \
            c1[r] += x * b1;                                                                 \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < R; ++r) { store(c + r * ldc, c0[r]); store(c + r * ldc + VW, c1[r]); } \
}
#if MR == 8
#define TILES_7_8(W, LOAD) KERNEL(7, W, LOAD) KERNEL(8, W, LOAD)
#define TILE_PTRS_7_8(W) , tile_##W##_7, tile_##W##_8
#else
#define TILES_7_8(W, LOAD)
#define TILE_PTRS_7_8(W)
#endif
#define TILES(W, LOAD) \
KERNEL(1, W, LOAD) KERNEL(2, W, LOAD) KERNEL(3, W, LOAD) KERNEL(4, W, LOAD) KERNEL(5, W, LOAD) \
KERNEL(6, W, LOAD) TILES_7_8(W, LOAD)                                                         \
typedef void (*tile_##W##_fn)(int64_t, const float *, int64_t, const W##_t *, const float *,  \
                              float *, int64_t);                                              \
static const tile_##W##_fn tiles_##W[MR + 1] = {0, tile_##W##_1, tile_##W##_2, tile_##W##_3, \
                                                 tile_##W##_4, tile_##W##_5, tile_##W##_6     \
                                                 TILE_PTRS_7_8(W)};

#endif
