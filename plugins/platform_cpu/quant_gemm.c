/* Quantized linear layers on the CPU: y = x @ W^T with W kept in its blocks.
 *
 * GGUF formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), llama.cpp's scheme: the activations are
 * quantized to int8 with one float scale per block of 32 values (per 256 for the k-quants, as
 * llama.cpp's q8_K), with the sums of each 16 values for the formats' offsets; each weight
 * block is unpacked in registers to 32 unsigned bytes (signed for Q8_0) with a float scale per
 * half, and the block's dot product is one integer multiply-add of bytes (AVX-512 VNNI /
 * AVX-VNNI `vpdpbusd` where the CPU has it, AVX2 `vpmaddubsw` + `vpmaddwd` otherwise, plain C
 * elsewhere), then scaled in float:
 *
 *   sum_i w_i a_i = sa * da * sum_{i<16} u_i q_i + sb * da * sum_{i>=16} u_i q_i
 *                   + ca * da * sum_{i<16} q_i  + cb * da * sum_{i>=16} q_i
 *
 * where w_i = s * u_i + c is the format's value (s, c the scale and offset of the half the value
 * lies in: Q4_1's d and m; Q4_0's d and -8d; a k-quant sub-block's d*scale and -dmin*min, or
 * Q6_K's d*scale and -32*d*scale per 16 values) and a_i = da * q_i the activation. Every row of
 * the output is the same computation whatever the batch around it: one weight row, one
 * activation row, blocks in order.
 *
 * Two kinds of kernels: every format with W's rows interleaved by 8 (corellm.quant's
 * interleaved layout; "rows interleaved by 8" below), 8 output columns per vector, and the row
 * kernels, one weight row at a time, for the rows after the last whole group of 8: the 32-value
 * formats in corellm.quant's grouped layout (each run of 8 blocks: their scales, Q4_1's
 * offsets, their values), the k-quants as the file lays them out.
 *
 * int8 (weight-only, per output channel): the int8 values widened to float in registers and
 * multiplied with the float activations (no activation rounding), the row's scale applied once.
 *
 * The row kernels run up to four activation rows against each unpacked weight row, the
 * interleaved ones up to eight (four without AVX-512's 32 vector registers): a prefill's GEMM
 * reuses each unpacked block that many times. The interleaved kernels also ask for the weight
 * bytes PF_BYTES ahead of each block (a decode step streams its weights from memory). Output
 * columns are split over the platform's thread pool.
 *
 * A layer's call may run the RMSNorm before it and the SiLU-and-multiply after it
 * (corellm_qlinear_fused, with the platform's own element-wise kernels), and ends by handing the
 * pool the weights of the layers that follow (corellm_pool_warm), which an idle worker fetches
 * while the host runs the code between two layers: a decode step reads every weight once, from
 * memory, and the host's time between layers would otherwise leave the memory bus idle.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "corellm_pool.h"

#if defined(__AVX2__) && defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };
static const int64_t BLOCK[6] = {32, 32, 32, 256, 256, 256};
static const int64_t TYPE_SIZE[6] = {34, 18, 20, 144, 176, 210};
#define MT 4                                 /* activation rows per unpacked weight row */

#if defined(__F16C__)
static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
static inline float round_f16(float f) {
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
#else
static inline float f16_bits(uint16_t h);
static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_bits(h);
}
/* Without F16C the activation scales are not rounded to fp16 (llama.cpp rounds them: its
 * results then differ from these in the last bits). */
static inline float round_f16(float f) { return f; }
#endif

static inline float f16_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {                                     /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A scale rounded to fp16 as llama.cpp stores it, where fp16 holds it: a value past fp16's range
 * (a block summing past 65504) or one that would round to zero stays float32. */
static inline float as_f16(float v) {
    const float r = round_f16(v);
    return isfinite(r) && (r != 0.f || v == 0.f) ? r : v;
}

/* ------------------------------------------------------------------ activations to int8 blocks */
typedef struct {
    const float *x;
    int64_t M, K, ldx, per;
    int8_t *qa;
    float *da, *fs, *fsum;
    int32_t *isum;
    int16_t *hs;
} act_args;

static void quantize_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const act_args *a = ctx;
    const int64_t nb = a->K / 32, per = a->per;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->ldx;
        for (int64_t c = 0; c < a->K; c += per) {
            float amax = 0.f;
            for (int64_t i = 0; i < per; i++) amax = fmaxf(amax, fabsf(x[c + i]));
            const float d = amax / 127.f, id = d > 0.f ? 127.f / amax : 0.f;
            for (int64_t b = c / 32; b < (c + per) / 32; b++) {
                const float *xb = x + b * 32;
                int8_t *q = a->qa + r * a->K + b * 32;
                int s0 = 0, s1 = 0;
                for (int i = 0; i < 32; i++) {
                    const int v = (int)nearbyintf(xb[i] * id);
                    q[i] = (int8_t)v;
                    if (i < 16) s0 += v; else s1 += v;
                }
                a->da[r * nb + b] = per == 32 ? as_f16(d) : d;
                a->fs[r * nb + b] = d * (float)s0;
                a->fs[(a->M + r) * nb + b] = d * (float)s1;
                a->fsum[r * nb + b] = as_f16(d * (float)(s0 + s1));
                a->isum[r * nb + b] = s0 + s1;
                a->hs[r * 2 * nb + 2 * b] = (int16_t)s0;
                a->hs[r * 2 * nb + 2 * b + 1] = (int16_t)s1;
            }
        }
    }
}

/* x [M, K] float32 (rows ldx apart), K a multiple of per -> qa int8 [M, K], quantized with one
 * scale per `per` values: 32 (llama.cpp's block_q8_0/q8_1, for the 32-value formats) or 256
 * (its block_q8_K, for the k-quants); da [M, K/32] (the scale of each block of 32 values: rounded
 * to fp16 as block_q8_0/q8_1 store it, or (per 256) in float32 as block_q8_K keeps it, the same
 * for a super-block's 8 blocks), fs [2, M, K/32] (each half's sum of values times the scale: the
 * first halves', then the second's), fsum [M, K/32] (the whole block's, rounded to fp16 as
 * block_q8_1's s), isum [M, K/32] (the block's sum of int8 values) and hs [M, K/16] (each half's,
 * as int16: block_q8_K's bsums). */
void corellm_q8_act(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t per, int8_t *qa,
                    float *da, float *fs, float *fsum, int32_t *isum, int16_t *hs) {
    act_args a = {x, M, K, ldx, per, qa, da, fs, fsum, isum, hs};
    corellm_parallel_for(M, K >= 4096 ? 1 : 4096 / K, quantize_rows, &a);
}

/* ------------------------------------------------------------------ k-quants: sub-blocks of 32 */
typedef struct { float sa, sb, ca, cb; } sub_t;

/* A k-quant super-block's integer scales: Q4_K, Q5_K: 8 scales and 8 minimums of 6 bits, one
 * per 32-value sub-block; Q6_K: 16 signed scales, one per 16 values (mn untouched). */
static inline void kq_ints(int fmt, const uint8_t *blk, int *sc, int *mn) {
    if (fmt == Q6_K) {
        for (int i = 0; i < 16; i++) sc[i] = (int8_t)blk[192 + i];
        return;
    }
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

/* A super-block's scales and offsets, per 32-value sub-block. */
static inline int decode_block(int fmt, const uint8_t *blk, sub_t *s) {
    int sc[16], mn[8];
    kq_ints(fmt, blk, sc, mn);
    if (fmt == Q6_K) {
        const float d = f16(blk + 208);
        for (int j = 0; j < 8; j++) {               /* half n = j/4, quarter k = j%4 */
            const int base = 8 * (j / 4) + 2 * (j % 4);
            const float a = d * (float)sc[base], b = d * (float)sc[base + 1];
            s[j] = (sub_t){a, b, -32.f * a, -32.f * b};
        }
        return 8;
    }
    const float d = f16(blk), dmin = f16(blk + 2);
    for (int j = 0; j < 8; j++) {
        const float a = d * (float)sc[j], c = -dmin * (float)mn[j];
        s[j] = (sub_t){a, a, c, c};
    }
    return 8;
}

/* The 32 values of sub-block j as unsigned bytes (0..63). */
static inline void unpack_scalar(int fmt, const uint8_t *blk, int j, int16_t *u) {
    switch (fmt) {
    case Q4_K: case Q5_K: {
        const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16) + 32 * (j / 2);
        for (int i = 0; i < 32; i++) u[i] = (j & 1) ? qs[i] >> 4 : qs[i] & 0xF;
        if (fmt == Q5_K)
            for (int i = 0; i < 32; i++) u[i] += ((blk[16 + i] >> j) & 1) << 4;
        break;
    }
    default: {                                                         /* Q6_K */
        const int n = j / 4, k = j % 4;
        const uint8_t *ql = blk + 64 * n + 32 * (k & 1), *qh = blk + 128 + 32 * n;
        for (int i = 0; i < 32; i++) {
            const int lo = k < 2 ? ql[i] & 0xF : ql[i] >> 4, hi = (qh[i] >> (2 * k)) & 3;
            u[i] = (int16_t)(lo | hi << 4);
        }
    }
    }
}

#ifdef QG_AVX2
static inline __m256i nib_lo_hi(const uint8_t *qs16) {        /* 16 bytes -> 32 nibbles */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs16);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

static inline __m256i unpack_avx2(int fmt, const uint8_t *blk, int j) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    switch (fmt) {
    case Q4_K: case Q5_K: {
        const __m256i q = _mm256_loadu_si256(
            (const __m256i *)(blk + (fmt == Q5_K ? 48 : 16) + 32 * (j / 2)));
        __m256i u = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(q, 4) : q, m4);
        if (fmt == Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                                 _mm256_set1_epi8(1));
            u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
        }
        return u;
    }
    default: {                                                         /* Q6_K */
        const int n = j / 4, k = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (k & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        const __m256i lo = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)),
                                            _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    }
}

/* 8 int32 lanes, lane i the sum of products of bytes 4i..4i+3: unsigned u (< 128) times signed
 * q, or for signed u (Q8_0) |u| times q carrying u's sign. */
static inline __m256i dot_bytes(__m256i u, __m256i q, int is_signed) {
    if (is_signed) {
        q = _mm256_sign_epi8(q, u);
        u = _mm256_sign_epi8(u, u);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ------------------------------------------------------------------ the GEMM */
typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t K, M, ldy, rb;
    const int8_t *qa;
    const float *da, *fs, *fs1, *fsum, *bias;
    float *y;
    const int32_t *isum;     /* the activation blocks' integer sums */
    const int16_t *hs;       /* their halves' (k-quants: one scale per 256 values) */
    int64_t N, groups;       /* the interleaved layout: W's rows, its whole groups of XR */
} q_args;

#ifndef QG_AVX2
/* The k-quants in plain C: output rows [n0, n1) for activation rows [m0, m0 + mt), mt <= MT,
 * a sub-block at a time. */
static inline void q_rows(const q_args *a, int fmt, int mt, int64_t m0, int64_t n0, int64_t n1) {
    const int64_t nblk = a->K / BLOCK[fmt], ts = TYPE_SIZE[fmt], nb32 = a->K / 32;
    sub_t sub[8];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->w + n * a->rb;
        float corr[MT] = {0}, acc[MT] = {0};
        for (int64_t bi = 0; bi < nblk; bi++) {
            const uint8_t *blk = row + bi * ts;
            const int nsub = decode_block(fmt, blk, sub);
            for (int j = 0; j < nsub; j++) {
                const int64_t b = bi * nsub + j;
                int16_t u[32];
                unpack_scalar(fmt, blk, j, u);
                for (int t = 0; t < mt; t++) {
                    const int64_t r = (m0 + t) * nb32 + b;
                    const int8_t *q = a->qa + (m0 + t) * a->K + b * 32;
                    int32_t s0 = 0, s1 = 0;
                    for (int i = 0; i < 16; i++) s0 += u[i] * q[i];
                    for (int i = 16; i < 32; i++) s1 += u[i] * q[i];
                    acc[t] += a->da[r] * (sub[j].sa * (float)s0 + sub[j].sb * (float)s1);
                    corr[t] += sub[j].ca * a->fs[r] + sub[j].cb * a->fs1[r];
                }
            }
        }
        const float bias = a->bias ? a->bias[n] : 0.f;
        for (int t = 0; t < mt; t++) a->y[(m0 + t) * a->ldy + n] = acc[t] + corr[t] + bias;
    }
}
#endif

/* The 32-value formats, in the grouped layout (corellm.quant: each run of 8 blocks holds their 8
 * fp16 scales, Q4_1's 8 offsets, then their values), as llama.cpp's dot products compute them:
 * Q4_0's values made signed (q - 8) and multiplied like Q8_0's, Q4_1's offset times the
 * activation block's fp16 sum, summed block by block. A run's 8 scales are converted (F16C)
 * and multiplied by its 8 activation blocks' scales in one vector. */
static inline __attribute__((always_inline)) void q32_rows(const q_args *a, int fmt, int mt,
                                                            int64_t m0, int64_t n0, int64_t n1) {
    const int64_t nb = a->K / 32, ts = TYPE_SIZE[fmt];
    const int head = fmt == Q4_1 ? 4 : 2, vs = (int)ts - head;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->w + n * a->rb;
        float corr[MT] = {0}, sc[MT][8];
#ifdef QG_AVX2
        __m256 acc[MT];
        for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
#else
        float acc[MT] = {0};
#endif
        for (int64_t g0 = 0; g0 < nb; g0 += 8) {
            const int cnt = nb - g0 < 8 ? (int)(nb - g0) : 8;
            const uint8_t *run = row + g0 * ts, *vals = run + head * cnt;
#if defined(QG_AVX2) && defined(__F16C__)
            if (cnt == 8) {
                const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)run));
                for (int t = 0; t < mt; t++) {
                    const int64_t r0 = (m0 + t) * nb + g0;
                    _mm256_storeu_ps(sc[t], _mm256_mul_ps(dv, _mm256_loadu_ps(a->da + r0)));
                }
                if (fmt == Q4_1) {     /* the offsets' terms, block by block (llama.cpp's order) */
                    float m8[8];
                    _mm256_storeu_ps(m8, _mm256_cvtph_ps(
                        _mm_loadu_si128((const __m128i *)(run + 16))));
                    for (int t = 0; t < mt; t++) {
                        const float *fsum = a->fsum + (m0 + t) * nb + g0;
                        for (int j = 0; j < 8; j++) corr[t] = fmaf(m8[j], fsum[j], corr[t]);
                    }
                }
            } else
#endif
            {
                for (int j = 0; j < cnt; j++) {
                    const float d = f16(run + 2 * j);
                    const float m = fmt == Q4_1 ? f16(run + 2 * cnt + 2 * j) : 0.f;
                    for (int t = 0; t < mt; t++) {
                        const int64_t r = (m0 + t) * nb + g0 + j;
                        sc[t][j] = d * a->da[r];
                        if (fmt == Q4_1) corr[t] = fmaf(m, a->fsum[r], corr[t]);
                    }
                }
            }
            for (int j = 0; j < cnt; j++) {
                const uint8_t *qs = vals + j * vs;
                const int8_t *q0 = a->qa + m0 * a->K + (g0 + j) * 32;
#ifdef QG_AVX2
                __m256i u = fmt == Q8_0 ? _mm256_loadu_si256((const __m256i *)qs) : nib_lo_hi(qs);
                if (fmt == Q4_0) u = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
                for (int t = 0; t < mt; t++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(q0 + t * a->K));
                    const __m256 p = _mm256_cvtepi32_ps(dot_bytes(u, q, fmt != Q4_1));
                    acc[t] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&sc[t][j]), acc[t]);
                }
#else
                int u[32];
                for (int i = 0; i < 32; i++)
                    u[i] = fmt == Q8_0 ? (int8_t)qs[i]
                         : (i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4) - (fmt == Q4_0 ? 8 : 0);
                for (int t = 0; t < mt; t++) {
                    const int8_t *q = q0 + t * a->K;
                    int32_t sum = 0;
                    for (int i = 0; i < 32; i++) sum += u[i] * q[i];
                    acc[t] += sc[t][j] * (float)sum;
                }
#endif
            }
        }
        const float bias = a->bias ? a->bias[n] : 0.f;
        for (int t = 0; t < mt; t++) {
#ifdef QG_AVX2
            const float s = hsum(acc[t]);
#else
            const float s = acc[t];
#endif
            a->y[(m0 + t) * a->ldy + n] = s + corr[t] + bias;
        }
    }
}
#ifdef QG_AVX2
/* A k-quant super-block's sub-block scales as vectors (lane j: sub-block j): av (and, for Q6_K,
 * bv: the second 16 values') the value scale, cvec (Q4_K, Q5_K) the offset -dmin * min. The
 * 6-bit scales and minimums are unpacked with llama.cpp's word masks. */
static inline void kq_scales(int fmt, const uint8_t *blk, __m256 *av, __m256 *bv, __m256 *cvec) {
    if (fmt == Q6_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m128i eo = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14,
                                                              1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(f16(blk + 208));
        *av = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eo)));
        *bv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(eo, 8))));
        return;
    }
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    const uint32_t sc_lo = u[0] & k1, sc_hi = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    const uint32_t mn_lo = u[1] & k1, mn_hi = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const __m128i b = _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi);
    *av = *bv = _mm256_mul_ps(_mm256_set1_ps(f16(blk)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    *cvec = _mm256_mul_ps(_mm256_set1_ps(-f16(blk + 2)),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}

/* The k-quants, a super-block at a time: its 8 sub-blocks' scales (and Q4_K/Q5_K's minimums)
 * decoded once, multiplied by the 8 activation blocks' scales in one vector, and the offsets'
 * terms (-dmin * min, or Q6_K's -32 * scale per 16 values) against the activation sums summed in
 * another; then each sub-block is one byte dot product, converted and scaled. */
static inline __attribute__((always_inline)) void qk_rows(const q_args *a, int fmt, int mt,
                                                           int64_t m0, int64_t n0, int64_t n1) {
    const int64_t nsb = a->K / 256, nb = a->K / 32, ts = TYPE_SIZE[fmt];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->w + n * a->rb;
        __m256 acc[MT], cv[MT];
        for (int t = 0; t < mt; t++) acc[t] = cv[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = row + sb * ts;
            __m256 SA[MT], SB[MT], av, bv, cvec = _mm256_setzero_ps();
            kq_scales(fmt, blk, &av, &bv, &cvec);
            for (int t = 0; t < mt; t++) {
                const int64_t r0 = (m0 + t) * nb + sb * 8;
                const __m256 dav = _mm256_loadu_ps(a->da + r0);
                const __m256 f0 = _mm256_loadu_ps(a->fs + r0), f1 = _mm256_loadu_ps(a->fs1 + r0);
                SA[t] = _mm256_mul_ps(av, dav);
                if (fmt == Q6_K) {
                    SB[t] = _mm256_mul_ps(bv, dav);
                    const __m256 m32 = _mm256_set1_ps(-32.f);
                    cv[t] = _mm256_fmadd_ps(_mm256_mul_ps(av, m32), f0, cv[t]);
                    cv[t] = _mm256_fmadd_ps(_mm256_mul_ps(bv, m32), f1, cv[t]);
                } else {
                    cv[t] = _mm256_fmadd_ps(cvec, _mm256_add_ps(f0, f1), cv[t]);
                }
            }
            for (int j = 0; j < 8; j++) {
                const __m256i u = unpack_avx2(fmt, blk, j);
                const int8_t *q0 = a->qa + m0 * a->K + sb * 256 + j * 32;
                for (int t = 0; t < mt; t++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(q0 + t * a->K));
                    const __m256 p = _mm256_cvtepi32_ps(dot_bytes(u, q, 0));
                    const __m256i lane = _mm256_set1_epi32(j);
                    const __m256 ws = fmt == Q6_K
                        ? _mm256_blend_ps(_mm256_permutevar8x32_ps(SA[t], lane),
                                          _mm256_permutevar8x32_ps(SB[t], lane), 0xF0)
                        : _mm256_permutevar8x32_ps(SA[t], lane);
                    acc[t] = _mm256_fmadd_ps(p, ws, acc[t]);
                }
            }
        }
        const float bias = a->bias ? a->bias[n] : 0.f;
        for (int t = 0; t < mt; t++)
            a->y[(m0 + t) * a->ldy + n] = hsum(acc[t]) + hsum(cv[t]) + bias;
    }
}
#define ROWS(F, mt, m0, n0, n1)                                                              \
    ((F) <= Q4_1 ? q32_rows(a, F, mt, m0, n0, n1) : qk_rows(a, F, mt, m0, n0, n1))
#else
#define ROWS(F, mt, m0, n0, n1)                                                              \
    ((F) <= Q4_1 ? q32_rows(a, F, mt, m0, n0, n1) : q_rows(a, F, mt, m0, n0, n1))
#endif

#define Q_FMT(F)                                                                             \
static void q_body_##F(void *ctx, int64_t n0, int64_t n1, int tid) {                        \
    (void)tid;                                                                               \
    const q_args *a = ctx;                                                                   \
    int64_t m0 = 0;                                                                          \
    for (; m0 + MT <= a->M; m0 += MT) ROWS(F, MT, m0, n0, n1);                               \
    switch (a->M - m0) {                                                                     \
    case 3: ROWS(F, 3, m0, n0, n1); break;                                                   \
    case 2: ROWS(F, 2, m0, n0, n1); break;                                                   \
    case 1: ROWS(F, 1, m0, n0, n1); break;                                                   \
    default: break;                                                                          \
    }                                                                                        \
}
Q_FMT(Q8_0)
Q_FMT(Q4_0)
Q_FMT(Q4_1)
Q_FMT(Q4_K)
Q_FMT(Q5_K)
Q_FMT(Q6_K)

static corellm_body_fn const Q_BODY[6] = {q_body_Q8_0, q_body_Q4_0, q_body_Q4_1,
                                          q_body_Q4_K, q_body_Q5_K, q_body_Q6_K};

/* ------------------------------------------------------------------ rows interleaved by 8 */
/* The interleaved layout (corellm.quant's ``interleaved``, flag X8 on the format): W's rows in
 * groups of XR = 8, each block of the group stored as its 8 rows' scales side by side (8 fp16:
 * one vector), Q4_1's 8 offsets, then the values four at a time, the 8 rows' first four values,
 * the 8 rows' next four, and so on (Q4_0/Q4_1: byte j of a row holds values j and j + 16, so
 * one 32-byte vector's low nibbles are values 4g..4g+3 of the 8 rows, its high nibbles values
 * 16+4g..16+4g+3). The k-quants' super-blocks the same way (kq_ql below: the 8 rows' d, Q4_K's
 * and Q5_K's dmin, each scale byte for the 8 rows, then the value bytes in 4-byte runs).
 *
 * One byte multiply-add of a 32-byte vector of weights with one activation row's four values
 * broadcast gives 8 output columns at once, each in its own lane, summed across a block in
 * integers (exactly) and converted once per block: no horizontal sums. Each output element is
 * still the same sequence of operations whatever the batch or the tile it falls in (lane n of
 * row m: the blocks' integer products, each block's one fused multiply-add), so rows do not
 * depend on the batch. Q4_0's values are used as unsigned nibbles and Q8_0's as bytes + 128
 * (VNNI) and the activations' integer sum times 8 (128) subtracted, the same integers as the
 * signed products. */
#define X8 16                                /* flag on the format: the interleaved layout */
#define XR 8                                 /* rows of W per interleaved group */
#if defined(__AVX512VL__)
#define XMT 8          /* activation rows per tile: 32 vector registers hold 8 rows' sums */
#else
#define XMT 4
#endif

/* Where a k-quant's parts lie in an interleaved super-block of 8 rows (XR * type_size bytes):
 * the 8 rows' fp16 d, then (Q4_K, Q5_K) their dmin, their scale bytes one byte of the 8 rows
 * at a time (12; Q6_K 16), then the values: Q5_K's high bits (32 bytes a row), the 4-bit values
 * (Q6_K: the low 4 bits) in 32-byte chunks, and Q6_K's high 2 bits in 32-byte chunks, each
 * chunk as 8 runs of 4 bytes of the 8 rows. */
enum { KQ_SC = 2 * XR };                    /* Q6_K's scales (Q4_K, Q5_K: 4 * XR) */
static inline int kq_qh(int fmt) {          /* Q5_K's high bits, Q6_K's */
    return fmt == Q5_K ? 16 * XR : 18 * XR + 128 * XR;
}
static inline int kq_ql(int fmt) {          /* the 4-bit values (Q6_K: the low 4 bits) */
    return fmt == Q4_K ? 16 * XR : fmt == Q5_K ? 48 * XR : 18 * XR;
}

#if defined(QG_AVX2) && defined(__F16C__)
/* acc + in each int32 lane the 4 products of unsigned bytes u and signed bytes q; u < 128
 * without VNNI (vpmaddubsw's 16-bit sums saturate past that). */
static inline __m256i dp_acc(__m256i acc, __m256i u, __m256i q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, q);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, q);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q),
                                                   _mm256_set1_epi16(1)));
#endif
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define QG_VNNI 1
#endif

/* A decode step streams every weight from memory once, and the hardware's prefetcher alone
 * leaves the bus idle part of the time: each block asks for the bytes PF_BYTES after it
 * (prefetches never fault, so past a weight's end they fetch nothing useful, harmlessly). */
#ifndef PF_BYTES
#define PF_BYTES 9216
#endif

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Output columns [8 * g, 8 * g + 8) for activation rows [m0, m0 + mt), a 32-value format. */
static inline __attribute__((always_inline)) void x8_q32(const q_args *a, int fmt, int mt,
                                                          int64_t m0, int64_t g) {
    const int64_t nb = a->K / 32, ts = TYPE_SIZE[fmt], K = a->K;
    const int head = fmt == Q4_1 ? 4 : 2;
    const uint8_t *grp = a->w + g * XR * a->rb;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[XMT];
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * XR * ts, *vals = blk + XR * head;
        for (int64_t o = 0; o < XR * ts; o += 64)      /* the weights ahead: see PF_BYTES */
            _mm_prefetch((const char *)(blk + PF_BYTES + o), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const int8_t *q0 = a->qa + m0 * K + b * 32;
        __m256i ia[XMT];
        for (int t = 0; t < mt; t++) ia[t] = _mm256_setzero_si256();
        if (fmt == Q8_0) {
            for (int k = 0; k < 8; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(vals + 32 * k));
#ifdef QG_VNNI
                const __m256i u = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
                for (int t = 0; t < mt; t++)
                    ia[t] = dp_acc(ia[t], u, bcast4(q0 + t * K + 4 * k));
#else
                const __m256i u = _mm256_sign_epi8(v, v);
                for (int t = 0; t < mt; t++)
                    ia[t] = dp_acc(ia[t], u, _mm256_sign_epi8(bcast4(q0 + t * K + 4 * k), v));
#endif
            }
        } else {
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(vals + 32 * k));
                const __m256i lo = _mm256_and_si256(v, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for (int t = 0; t < mt; t++) {
                    ia[t] = dp_acc(ia[t], lo, bcast4(q0 + t * K + 4 * k));
                    ia[t] = dp_acc(ia[t], hi, bcast4(q0 + t * K + 16 + 4 * k));
                }
            }
        }
        const __m256 mw = fmt == Q4_1
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : dw;
        for (int t = 0; t < mt; t++) {
            const int64_t r = (m0 + t) * nb + b;
            __m256i i = ia[t];
            if (fmt == Q4_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * a->isum[r]));
#ifdef QG_VNNI
            if (fmt == Q8_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(128 * a->isum[r]));
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(a->da[r])), acc[t]);
            if (fmt == Q4_1) acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->fsum[r]), acc[t]);
        }
    }
    const __m256 bias = a->bias ? _mm256_loadu_ps(a->bias + g * XR) : _mm256_setzero_ps();
    for (int t = 0; t < mt; t++)
        _mm256_storeu_ps(a->y + (m0 + t) * a->ldy + g * XR, _mm256_add_ps(acc[t], bias));
}

/* acc + in each int32 lane the 2 products of signed 16-bit halves of a and b. */
static inline __m256i dpw_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 8 bytes (one per row of the group) -> 8 int32 lanes, unsigned or signed. */
static inline __m256i u8x8i(uint64_t v) {
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v));
}
static inline __m256i s8x8i(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* Lanes of two 16-bit halves: lo's low 16 bits, hi's. */
static inline __m256i pair16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(hi, 16));
}

/* Output columns [8 * g, 8 * g + 8) for activation rows [m0, m0 + mt), a k-quant, against
 * activations with one scale per super-block (llama.cpp's q8_K): per super-block the 8 rows'
 * value scales as floats (Q4_K, Q5_K: d * the 6-bit scale, unpacked 8 rows at a time, one
 * 64-bit word per scale byte, llama.cpp's masks; Q6_K: d * a signed byte per 16 values), each
 * 32-value sub-block's byte products (Q6_K: each 16 values') times its scale summed in float,
 * then once the activation scale; and the offsets (-dmin * min per sub-block, Q6_K's -32 d *
 * scale per 16 values) summed in integers against the activation halves' sums (vpdpwssd), times
 * -dmin (or -32 d) and the activation scale once. */
static inline __attribute__((always_inline)) void x8_kq(const q_args *a, int fmt, int mt,
                                                         int64_t m0, int64_t g) {
    const int64_t nsb = a->K / 256, nb = a->K / 32, K = a->K, bs = XR * TYPE_SIZE[fmt];
    const uint8_t *grp = a->w + g * XR * a->rb;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256 acc[XMT];
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = grp + sb * bs, *ql = blk + kq_ql(fmt), *qh = blk + kq_qh(fmt);
        for (int64_t o = 0; o < bs; o += 64)           /* the weights ahead: see PF_BYTES */
            _mm_prefetch((const char *)(blk + PF_BYTES + o), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        /* per sub-block: the value scales (Q6_K: of each half), the offsets' integer factors
         * as 16-bit pairs against the activation halves' sums (Q4_K, Q5_K: min, min; Q6_K: the
         * halves' scales); off: the offsets' float factor */
        float sv[8][2][8];
        __m256i op[8];
        __m256 off;
        if (fmt == Q6_K) {
            for (int j = 0; j < 8; j++) {
                const int base = 8 * (j / 4) + 2 * (j % 4);
                const __m256i s0 = s8x8i(blk + KQ_SC + XR * base);
                const __m256i s1 = s8x8i(blk + KQ_SC + XR * (base + 1));
                _mm256_storeu_ps(sv[j][0], _mm256_mul_ps(d, _mm256_cvtepi32_ps(s0)));
                _mm256_storeu_ps(sv[j][1], _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1)));
                op[j] = pair16(s0, s1);
            }
            off = _mm256_mul_ps(d, _mm256_set1_ps(-32.f));
        } else {
            off = _mm256_sub_ps(_mm256_setzero_ps(),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * XR))));
            uint64_t B[12];
            memcpy(B, blk + 4 * XR, 12 * XR);
            const uint64_t k1 = 0x3f3f3f3f3f3f3f3full, k2 = 0x0f0f0f0f0f0f0f0full,
                           k3 = 0x0303030303030303ull;
            for (int j = 0; j < 8; j++) {
                uint64_t sc, mn;
                if (j < 4) {
                    sc = B[j] & k1;
                    mn = B[j + 4] & k1;
                } else {
                    sc = (B[j + 4] & k2) | (((B[j - 4] >> 6) & k3) << 4);
                    mn = ((B[j + 4] >> 4) & k2) | (((B[j] >> 6) & k3) << 4);
                }
                _mm256_storeu_ps(sv[j][0], _mm256_mul_ps(d, _mm256_cvtepi32_ps(u8x8i(sc))));
                const __m256i m = u8x8i(mn);
                op[j] = pair16(m, m);
            }
        }
        __m256 fa[XMT];
        for (int t = 0; t < mt; t++) fa[t] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            /* sub-block j's 4-bit values: chunk j / 2's low or high nibbles (Q6_K: chunk
             * 2 (j / 4) + j % 2, high nibbles from j % 4 = 2; its high bits: chunk j / 4, bits
             * 2 (j % 4)) */
            const int six = fmt == Q6_K, c = six ? 2 * (j / 4) + j % 2 : j / 2;
            const int high = six ? (j % 4) >= 2 : j & 1;
            const uint8_t *v0 = ql + 32 * XR * c, *h0 = qh + (six ? 32 * XR * (j / 4) : 0);
            const __m128i hshift = _mm_cvtsi32_si128(six ? 2 * (j % 4) : j);
            const int8_t *q0 = a->qa + m0 * K + sb * 256 + 32 * j;
            __m256i ia[XMT];
            for (int t = 0; t < mt; t++) ia[t] = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(v0 + 32 * k));
                __m256i u = _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, m4);
                if (fmt != Q4_K) {
                    const __m256i h = _mm256_srl_epi16(
                        _mm256_loadu_si256((const __m256i *)(h0 + 32 * k)), hshift);
                    const __m256i hb = _mm256_and_si256(h, six ? m3 : one);
                    u = _mm256_or_si256(u, _mm256_slli_epi16(hb, 4));
                }
                for (int t = 0; t < mt; t++) ia[t] = dp_acc(ia[t], u, bcast4(q0 + t * K + 4 * k));
                if (six && k == 3) {                   /* Q6_K: the first half's own scale */
                    const __m256 s0 = _mm256_loadu_ps(sv[j][0]);
                    for (int t = 0; t < mt; t++) {
                        fa[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), s0, fa[t]);
                        ia[t] = _mm256_setzero_si256();
                    }
                }
            }
            const __m256 s = _mm256_loadu_ps(sv[j][six]);
            for (int t = 0; t < mt; t++)
                fa[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), s, fa[t]);
        }
        for (int t = 0; t < mt; t++) {
            const int64_t r = m0 + t;
            const int8_t *h = (const int8_t *)(a->hs + r * 2 * nb + sb * 16);
            __m256i o = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) o = dpw_acc(o, op[j], bcast4(h + 4 * j));
            const __m256 da = _mm256_set1_ps(a->da[r * nb + sb * 8]);
            acc[t] = _mm256_fmadd_ps(fa[t], da, acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_mul_ps(off, da), acc[t]);
        }
    }
    const __m256 bias = a->bias ? _mm256_loadu_ps(a->bias + g * XR) : _mm256_setzero_ps();
    for (int t = 0; t < mt; t++)
        _mm256_storeu_ps(a->y + (m0 + t) * a->ldy + g * XR, _mm256_add_ps(acc[t], bias));
}
#define X8_TILE(F, mt, m0, g) ((F) >= Q4_K ? x8_kq(a, F, mt, m0, g) : x8_q32(a, F, mt, m0, g))
#else
/* Plain C: the same integers and the same float operations per output element, one column at
 * a time (the value of row n's byte i of block b read through the interleaved order). */
static inline int x8_value(int fmt, const uint8_t *vals, int n, int i) {
    if (fmt == Q8_0) return (int8_t)vals[32 * (i / 4) + 4 * n + i % 4];
    const int j = i % 16, byte = vals[32 * (j / 4) + 4 * n + j % 4];
    return i < 16 ? byte & 0xF : byte >> 4;
}

/* Row n's super-block in the file's layout, from an interleaved super-block of 8 rows. */
static void x8_kq_row(int fmt, const uint8_t *blk, int n, uint8_t *out) {
    const int nsc = fmt == Q6_K ? 16 : 12, dpos = fmt == Q6_K ? 208 : 0;
    const int sc_in = fmt == Q6_K ? 2 * XR : 4 * XR, sc_out = fmt == Q6_K ? 192 : 4;
    memcpy(out + dpos, blk + 2 * n, 2);
    if (fmt != Q6_K) memcpy(out + 2, blk + 2 * XR + 2 * n, 2);
    for (int i = 0; i < nsc; i++) out[sc_out + i] = blk[sc_in + XR * i + n];
    /* the values' chunks of 32 bytes, each 8 runs of 4 bytes of the 8 rows: (interleaved
     * offset, file offset, chunks), the 4-bit values then the high bits */
    const int runs[2][3] = {
        {kq_ql(fmt), fmt == Q4_K ? 16 : fmt == Q5_K ? 48 : 0, 4},
        {kq_qh(fmt), fmt == Q5_K ? 16 : 128, fmt == Q4_K ? 0 : fmt == Q5_K ? 1 : 2}};
    for (int part = 0; part < 2; part++)
        for (int c = 0; c < runs[part][2]; c++)
            for (int k = 0; k < 8; k++)
                memcpy(out + runs[part][1] + 32 * c + 4 * k,
                       blk + runs[part][0] + 32 * XR * c + 32 * k + 4 * n, 4);
}

static inline void x8_tile(const q_args *a, int fmt, int mt, int64_t m0, int64_t g) {
    const int64_t K = a->K, nb = K / 32;
    const uint8_t *grp = a->w + g * XR * a->rb;
    for (int n = 0; n < XR; n++) {
        float acc[XMT] = {0};
        if (fmt >= Q4_K) {
            const int64_t ts = TYPE_SIZE[fmt];
            const int six = fmt == Q6_K;
            for (int64_t sb = 0; sb < K / 256; sb++) {
                uint8_t file[210];                       /* row n's super-block, the file's */
                x8_kq_row(fmt, grp + sb * XR * ts, n, file);
                int sc[16], mn[8];
                kq_ints(fmt, file, sc, mn);
                const float d = f16(file + (six ? 208 : 0));
                const float off = six ? d * -32.f : -f16(file + 2);
                float fa[XMT] = {0};
                int32_t o[XMT] = {0};
                for (int j = 0; j < 8; j++) {
                    int16_t u[32];
                    unpack_scalar(fmt, file, j, u);
                    const int base = six ? 8 * (j / 4) + 2 * (j % 4) : j;
                    const float s0 = d * (float)sc[base];
                    const float s1 = six ? d * (float)sc[base + 1] : s0;
                    for (int t = 0; t < mt; t++) {
                        const int8_t *q = a->qa + (m0 + t) * K + sb * 256 + 32 * j;
                        const int16_t *h = a->hs + (m0 + t) * 2 * nb + sb * 16 + 2 * j;
                        int32_t p0 = 0, p1 = 0;
                        for (int i = 0; i < 16; i++) p0 += u[i] * q[i];
                        for (int i = 16; i < 32; i++) p1 += u[i] * q[i];
                        if (six) {
                            fa[t] = fmaf((float)p0, s0, fa[t]);
                            fa[t] = fmaf((float)p1, s1, fa[t]);
                            o[t] += sc[base] * h[0] + sc[base + 1] * h[1];
                        } else {
                            fa[t] = fmaf((float)(p0 + p1), s0, fa[t]);
                            o[t] += mn[j] * h[0] + mn[j] * h[1];
                        }
                    }
                }
                for (int t = 0; t < mt; t++) {
                    const float da = a->da[(m0 + t) * nb + sb * 8];
                    acc[t] = fmaf(fa[t], da, acc[t]);
                    acc[t] = fmaf((float)o[t], off * da, acc[t]);
                }
            }
        } else {
            const int64_t ts = TYPE_SIZE[fmt];
            const int head = fmt == Q4_1 ? 4 : 2;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = grp + b * XR * ts, *vals = blk + XR * head;
                const float d = f16(blk + 2 * n), m = fmt == Q4_1 ? f16(blk + 16 + 2 * n) : 0.f;
                for (int t = 0; t < mt; t++) {
                    const int64_t r = (m0 + t) * nb + b;
                    const int8_t *q = a->qa + (m0 + t) * K + b * 32;
                    int32_t s = 0;
                    for (int i = 0; i < 32; i++) s += x8_value(fmt, vals, n, i) * q[i];
                    if (fmt == Q4_0) s -= 8 * a->isum[r];
                    acc[t] = fmaf((float)s, d * a->da[r], acc[t]);
                    if (fmt == Q4_1) acc[t] = fmaf(m, a->fsum[r], acc[t]);
                }
            }
        }
        const float bias = a->bias ? a->bias[g * XR + n] : 0.f;
        for (int t = 0; t < mt; t++) a->y[(m0 + t) * a->ldy + g * XR + n] = acc[t] + bias;
    }
}
#define X8_TILE(F, mt, m0, g) x8_tile(a, F, mt, m0, g)
#endif

/* Items: the groups of 8 output columns, then (one more item) the columns after the last whole
 * group, whose rows W stores in the format's own layout (after the groups) and the row kernels
 * above read. */
/* The activation rows after the last whole tile of XMT. */
#if XMT == 8
#define X8_REST(F, m0, g)                                                                    \
    switch (a->M - m0) {                                                                     \
    case 7: X8_TILE(F, 7, m0, g); break;                                                     \
    case 6: X8_TILE(F, 6, m0, g); break;                                                     \
    case 5: X8_TILE(F, 5, m0, g); break;                                                     \
    case 4: X8_TILE(F, 4, m0, g); break;                                                     \
    case 3: X8_TILE(F, 3, m0, g); break;                                                     \
    case 2: X8_TILE(F, 2, m0, g); break;                                                     \
    case 1: X8_TILE(F, 1, m0, g); break;                                                     \
    default: break;                                                                          \
    }
#else
#define X8_REST(F, m0, g)                                                                    \
    switch (a->M - m0) {                                                                     \
    case 3: X8_TILE(F, 3, m0, g); break;                                                     \
    case 2: X8_TILE(F, 2, m0, g); break;                                                     \
    case 1: X8_TILE(F, 1, m0, g); break;                                                     \
    default: break;                                                                          \
    }
#endif

/* Items: the groups of 8 output columns, then (one more item) the columns after the last whole
 * group, whose rows W stores in the format's own layout (after the groups) and the row kernels
 * above read. */
#define X8_FMT(F)                                                                            \
static void x8_body_##F(void *ctx, int64_t g0, int64_t g1, int tid) {                       \
    const q_args *a = ctx;                                                                   \
    for (int64_t g = g0; g < g1; g++) {                                                      \
        if (g == a->groups) {                                                                \
            Q_BODY[F](ctx, g * XR, a->N, tid);                                               \
            continue;                                                                        \
        }                                                                                    \
        int64_t m0 = 0;                                                                      \
        for (; m0 + XMT <= a->M; m0 += XMT) X8_TILE(F, XMT, m0, g);                          \
        X8_REST(F, m0, g)                                                                    \
    }                                                                                        \
}
X8_FMT(Q8_0)
X8_FMT(Q4_0)
X8_FMT(Q4_1)
X8_FMT(Q4_K)
X8_FMT(Q5_K)
X8_FMT(Q6_K)

static corellm_body_fn const X8_BODY[6] = {x8_body_Q8_0, x8_body_Q4_0, x8_body_Q4_1,
                                           x8_body_Q4_K, x8_body_Q5_K, x8_body_Q6_K};

/* Rows of output per chunk a thread claims: about 16 KiB of weight blocks per activation row. */
static inline int64_t grain(int64_t row_bytes, int64_t M) {
    const int64_t work = row_bytes * (M < MT ? M : MT);
    return work >= 16384 ? 1 : 16384 / (work > 0 ? work : 1);
}

/* y[m, n] = sum_k W[n, k] x[m, k] (+ bias[n]) for m < M, n < N; W: N rows of format fmt's
 * blocks, each row K / block * type_size bytes; x as corellm_q8_act made it. Returns -1 for an
 * unknown format or a K that is not whole blocks. */
int corellm_qgemm(int fmt, const uint8_t *w, int64_t N, int64_t K, const int8_t *qa,
                  const float *da, const float *fs, const float *fsum, const int32_t *isum,
                  const int16_t *hs, int64_t M, float *y, int64_t ldy, const float *bias) {
    const int x8 = fmt & X8;
    fmt &= ~X8;
    if (fmt < 0 || fmt > Q6_K || K % BLOCK[fmt]) return -1;
    q_args a = {fmt, w, K, M, ldy, K / BLOCK[fmt] * TYPE_SIZE[fmt], qa, da, fs, fs + M * (K / 32),
                fsum, bias, y, isum, hs, N, N / XR};
    if (x8) {
        corellm_parallel_for(a.groups + (N % XR != 0), grain(XR * a.rb, M), X8_BODY[fmt], &a);
        return 0;
    }
    corellm_parallel_for(N, grain(a.rb, M), Q_BODY[fmt], &a);
    return 0;
}

/* corellm_q8_act then corellm_qgemm, the quantized activations in this thread's scratch (grown
 * as needed, kept for the next call): one call per layer. Returns -1 for an unknown format, a K
 * that is not whole blocks, or no memory. */
int corellm_qlinear(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                    const int64_t *warm, int warm_n) {
    static __thread void *scratch = NULL;
    static __thread size_t capacity = 0;
    const int base = fmt & ~X8;
    if (base < 0 || base > Q6_K || K % BLOCK[base] || K % 32) return -1;
    const size_t nb = (size_t)(K / 32), rows = (size_t)M;
    const size_t need = rows * (size_t)K + rows * nb * (6 * sizeof(float) + 4) + 64;
    if (need > capacity) {
        free(scratch);
        scratch = malloc(need);
        capacity = scratch ? need : 0;
        if (!scratch) return -1;
    }
    float *da = scratch, *fs = da + rows * nb, *fsum = fs + rows * nb * 2;
    int32_t *isum = (int32_t *)(fsum + rows * nb);
    int16_t *hs = (int16_t *)(isum + rows * nb);
    int8_t *qa = (int8_t *)(hs + 2 * rows * nb);
    corellm_q8_act(x, M, K, ldx, base >= Q4_K ? 256 : 32, qa, da, fs, fsum, isum, hs);
    const int rc = corellm_qgemm(fmt, w, N, K, qa, da, fs, fsum, isum, hs, M, y, ldy, bias);
    corellm_pool_warm(warm, warm_n);
    return rc;
}

/* ------------------------------------------------------------------ a layer with its neighbours */
/* The CPU platform's element-wise kernels (cpu_ops.c: corellm_rms_norm_f32,
 * corellm_silu_and_mul_f32), given by the platform once both libraries are loaded: a fused call
 * runs the very kernels the layers around it would, so its results equal theirs bit for bit. */
typedef void (*rms_norm_fn)(const float *x, int64_t outer_stride, int64_t inner_stride,
                            int64_t inner, const float *w, float *out, int64_t rows, int64_t n,
                            float eps);
typedef void (*silu_and_mul_fn)(const float *x, float *out, int64_t rows, int64_t d);
static rms_norm_fn RMS_NORM;
static silu_and_mul_fn SILU_AND_MUL;

void corellm_qlinear_neighbours(rms_norm_fn rms_norm, silu_and_mul_fn silu_and_mul) {
    RMS_NORM = rms_norm;
    SILU_AND_MUL = silu_and_mul;
}

/* corellm_qlinear with an RMSNorm before it (norm_w: its K weights, eps) and/or SiLU-and-multiply
 * after it (silu_mul: W's rows are [gate; up], y [M, N / 2] = silu(gate) * up), y contiguous;
 * the normalized rows and the [M, N] product in this thread's scratch. One call in place of two
 * or three layers. Returns -1 as corellm_qlinear does, -2 where a kernel it needs was not given. */
int corellm_qlinear_fused(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                          int64_t ldx, int64_t M, float *y, const float *bias,
                          const float *norm_w, float eps, int silu_mul, const int64_t *warm,
                          int warm_n) {
    static __thread float *scratch = NULL;
    static __thread size_t capacity = 0;
    if ((norm_w && !RMS_NORM) || (silu_mul && (!SILU_AND_MUL || N % 2))) return -2;
    const size_t normed = norm_w ? (size_t)M * (size_t)K : 0;
    const size_t need = normed + (silu_mul ? (size_t)M * (size_t)N : 0);
    if (need > capacity) {
        free(scratch);
        scratch = malloc(need * sizeof(float));
        capacity = scratch ? need : 0;
        if (!scratch) return -1;
    }
    if (norm_w) {
        RMS_NORM(x, ldx, 0, 1, norm_w, scratch, M, K, eps);
        x = scratch;
        ldx = K;
    }
    float *out = silu_mul ? scratch + normed : y;
    const int rc = corellm_qlinear(fmt, w, N, K, x, ldx, M, out, N, bias, NULL, 0);
    if (rc == 0 && silu_mul) SILU_AND_MUL(out, y, M, N / 2);
    corellm_pool_warm(warm, warm_n);
    return rc;
}

/* ------------------------------------------------------------------ int8 per channel */
typedef struct {
    const int8_t *w;
    const float *scale, *x, *bias;
    int64_t K, ldx, M, ldy;
    float *y;
} i8_args;

static inline __attribute__((always_inline)) void i8_rows(const i8_args *a, int mt, int64_t m0,
                                                           int64_t n0, int64_t n1) {
    const int64_t K = a->K;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * K;
        float s[MT];
        int64_t k = 0;
#ifdef QG_AVX2
        __m256 acc0[MT], acc1[MT];
        for (int t = 0; t < mt; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m256 w0 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
            const __m256 w1 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k + 8))));
            for (int t = 0; t < mt; t++) {
                const float *x = a->x + (m0 + t) * a->ldx + k;
                acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[t]);
                acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc1[t]);
            }
        }
        for (int t = 0; t < mt; t++) s[t] = hsum(_mm256_add_ps(acc0[t], acc1[t]));
#else
        for (int t = 0; t < mt; t++) s[t] = 0.f;
#endif
        for (; k < K; k++)
            for (int t = 0; t < mt; t++) s[t] += (float)w[k] * a->x[(m0 + t) * a->ldx + k];
        const float bias = a->bias ? a->bias[n] : 0.f;
        for (int t = 0; t < mt; t++) a->y[(m0 + t) * a->ldy + n] = s[t] * a->scale[n] + bias;
    }
}

static void i8_body(void *ctx, int64_t n0, int64_t n1, int tid) {
    (void)tid;
    const i8_args *a = ctx;
    int64_t m0 = 0;
    for (; m0 + MT <= a->M; m0 += MT) i8_rows(a, MT, m0, n0, n1);
    switch (a->M - m0) {
    case 3: i8_rows(a, 3, m0, n0, n1); break;
    case 2: i8_rows(a, 2, m0, n0, n1); break;
    case 1: i8_rows(a, 1, m0, n0, n1); break;
    default: break;
    }
}

/* y[m, n] = scale[n] * sum_k w[n, k] x[m, k] (+ bias[n]); w int8 [N, K], x float32 rows ldx
 * apart. */
void corellm_i8gemm(const int8_t *w, const float *scale, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                    const int64_t *warm, int warm_n) {
    i8_args a = {w, scale, x, bias, K, ldx, M, ldy, y};
    corellm_parallel_for(N, grain(K, M), i8_body, &a);
    corellm_pool_warm(warm, warm_n);
}
