/* Paged decode attention and KV writes for CPUs, reading the cache in place.
 *
 * Built on first use by corellm.native (cc -O3 -march=native -ffast-math -fopenmp) and called
 * through ctypes with raw pointers: no torch headers, so the build takes about a second.
 *
 * Cache layout (the torch_sdpa backend's KVCacheSpec): K and V each [num_blocks, block_size,
 * num_kv_heads, head_size], contiguous. Element types: float32, or bfloat16 stored as uint16
 * (arithmetic in float32 either way).
 *
 * Decode: one query token per sequence; a work item is one sequence, all heads: scores over
 * the sequence's keys, read block by block through its block-table row (each token's row of
 * all KV heads is contiguous, and is read once for all the query heads that share it), then
 * the softmax, then the weighted sum of values. Each cached K/V row is read once per step,
 * where the gather path copies it out and reads it again. With fewer sequences than threads,
 * a work item is one (sequence, KV head) instead, so that a lone long sequence still keeps
 * every thread busy (one sequence of 416-2048 tokens: 1.3-1.5x on 2 threads; with as many
 * sequences as threads, whole rows read in order are faster).
 *
 * Tried and measured slower (docs/attention.md): scores for 8 keys at a time with explicit
 * vector code (faster while the cache is hot, 10-20% slower once it is not: the per-token
 * loops below read the rows in order), and software prefetch of the next block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) {     /* round to nearest even (finite values) */
    union { uint32_t u; float f; } v;
    v.f = f;
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (bf16_t)(v.u >> 16);
}

static inline float ld_f32(const float *p, int64_t i) { return p[i]; }
static inline float ld_bf16(const bf16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void st_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline void st_bf16(bf16_t *p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

/* Scores buffer: G * span floats per work item, grown as needed, one per thread. */
static float *scratch(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = (float *)malloc((size_t)n * sizeof(float));
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* One sequence's decode attention for KV heads [g0, g1) and the query heads that share them:
 * each cached token's row (all KV heads, contiguous) is read once, in order within a block.
 * HD is the head size when known at compile time (the common 64 and 128 get unrolled loops),
 * else 0 and D is used. */
#define DECODE_SEQ(SUFFIX, T, LD, ST, HD)                                                     \
static int decode_seq_##SUFFIX##_##HD(                                                       \
        const T *qrow, const T *k_cache, const T *v_cache, const int64_t *table,              \
        int64_t len, T *o, int64_t num_heads, int64_t num_kv_heads, int64_t D_,               \
        int64_t block_size, float scale, int64_t window, int64_t g0, int64_t g1,              \
        float **buf, int64_t *cap) {                                                          \
    const int64_t D = HD ? HD : D_;                                                           \
    const int64_t G = num_heads / num_kv_heads, H = (g1 - g0) * G, row = num_kv_heads * D;   \
    const int64_t start = (window > 0 && len > window) ? len - window : 0;                    \
    const int64_t span = len - start;                                                         \
    float *s = scratch(buf, cap, H * span + 2 * H * D);                                       \
    if (!s) return -1;                                                                        \
    float *qf = s + H * span, *acc = qf + H * D;                                              \
    qrow += g0 * G * D;                                                                       \
    o += g0 * G * D;                                                                          \
    k_cache += g0 * D;                                                                        \
    v_cache += g0 * D;                                                                        \
    for (int64_t x = 0; x < H * D; ++x) { qf[x] = LD(qrow, x) * scale; acc[x] = 0.f; }       \
    for (int64_t b = start / block_size; b * block_size < len; ++b) {                        \
        const int64_t t0 = b * block_size > start ? b * block_size : start;                   \
        const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;           \
        const T *k = k_cache + (table[b] * block_size + (t0 - b * block_size)) * row;         \
        for (int64_t t = t0; t < t1; ++t, k += row) {                                         \
            for (int64_t hq = 0; hq < H; ++hq) {                                              \
                const float *qh = qf + hq * D;                                                \
                const T *kh = k + (hq / G) * D;                                               \
                float dot = 0.f;                                                              \
                _Pragma("omp simd reduction(+:dot)")                                          \
                for (int64_t d = 0; d < D; ++d) dot += qh[d] * LD(kh, d);                     \
                s[hq * span + (t - start)] = dot;                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t hq = 0; hq < H; ++hq) {                                                      \
        float *sg = s + hq * span, m = sg[0], sum = 0.f;                                      \
        for (int64_t t = 1; t < span; ++t) m = sg[t] > m ? sg[t] : m;                         \
        _Pragma("omp simd reduction(+:sum)")                                                  \
        for (int64_t t = 0; t < span; ++t) { sg[t] = expf(sg[t] - m); sum += sg[t]; }         \
        const float inv = 1.f / sum;                                                          \
        for (int64_t t = 0; t < span; ++t) sg[t] *= inv;                                      \
    }                                                                                         \
    for (int64_t b = start / block_size; b * block_size < len; ++b) {                        \
        const int64_t t0 = b * block_size > start ? b * block_size : start;                   \
        const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;           \
        const T *v = v_cache + (table[b] * block_size + (t0 - b * block_size)) * row;         \
        for (int64_t t = t0; t < t1; ++t, v += row) {                                         \
            for (int64_t hq = 0; hq < H; ++hq) {                                              \
                const float p = s[hq * span + (t - start)];                                   \
                const T *vh = v + (hq / G) * D;                                               \
                float *a = acc + hq * D;                                                      \
                _Pragma("omp simd")                                                           \
                for (int64_t d = 0; d < D; ++d) a[d] += p * LD(vh, d);                        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t x = 0; x < H * D; ++x) ST(o, x, acc[x]);                                     \
    return 0;                                                                                 \
}

#define DEFINE_DECODE(SUFFIX, T, LD, ST)                                                      \
DECODE_SEQ(SUFFIX, T, LD, ST, 0)                                                              \
DECODE_SEQ(SUFFIX, T, LD, ST, 64)                                                             \
DECODE_SEQ(SUFFIX, T, LD, ST, 128)                                                            \
int corellm_paged_decode_##SUFFIX(                                                            \
        const T *q, int64_t q_stride, /* [n, H, D]: token stride, heads contiguous */         \
        const T *k_cache, const T *v_cache, const int64_t *block_table,                      \
        int64_t table_stride, const int64_t *seq_lens, T *out, /* [n, H, D] contiguous */     \
        int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,                \
        int64_t block_size, float scale, int64_t window, int num_threads) {                  \
    int failed = 0;                                                                           \
    /* whole sequences while there is one per thread, else one KV head each */                \
    const int64_t per = n >= (int64_t)num_threads ? num_kv_heads : 1;                         \
    const int64_t parts = num_kv_heads / per;                                                 \
    _Pragma("omp parallel num_threads(num_threads)")                                          \
    {                                                                                         \
        float *buf = NULL; int64_t cap = 0;                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t w = 0; w < n * parts; ++w) {                                             \
            const int64_t i = w / parts, g0 = (w % parts) * per, g1 = g0 + per;               \
            const T *qi = q + i * q_stride;                                                   \
            const int64_t *ti = block_table + i * table_stride;                               \
            T *oi = out + i * num_heads * head_size;                                          \
            int rc;                                                                           \
            if (head_size == 64)                                                              \
                rc = decode_seq_##SUFFIX##_64(qi, k_cache, v_cache, ti, seq_lens[i], oi,      \
                        num_heads, num_kv_heads, 64, block_size, scale, window, g0, g1,       \
                        &buf, &cap);                                                          \
            else if (head_size == 128)                                                        \
                rc = decode_seq_##SUFFIX##_128(qi, k_cache, v_cache, ti, seq_lens[i], oi,     \
                        num_heads, num_kv_heads, 128, block_size, scale, window, g0, g1,      \
                        &buf, &cap);                                                          \
            else                                                                              \
                rc = decode_seq_##SUFFIX##_0(qi, k_cache, v_cache, ti, seq_lens[i], oi,       \
                        num_heads, num_kv_heads, head_size, block_size, scale, window, g0,    \
                        g1, &buf, &cap);                                                      \
            if (rc) {                                                                         \
                _Pragma("omp atomic write")                                                   \
                failed = 1;                                                                   \
            }                                                                                 \
        }                                                                                     \
        free(buf);                                                                            \
    }                                                                                         \
    return failed ? -1 : 0;                                                                   \
}

DEFINE_DECODE(f32, float, ld_f32, st_f32)
DEFINE_DECODE(bf16, bf16_t, ld_bf16, st_bf16)

/* KV write: token j's K and V rows (num_kv_heads * head_size contiguous elements at
 * key + j * key_stride) go to cache slot slots[j]; negative slots are skipped. */
int corellm_write_kv(const char *key, int64_t key_stride, const char *value,
                     int64_t value_stride, char *k_cache, char *v_cache, const int64_t *slots,
                     int64_t n, int64_t row_bytes, int64_t elem_bytes, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(n >= 64)")
    for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slots[j];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + j * key_stride * elem_bytes, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + j * value_stride * elem_bytes,
               (size_t)row_bytes);
    }
    return 0;
}
