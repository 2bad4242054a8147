/* Paged decode attention and KV writes for CPUs, reading the cache in place.
 *
 * Built on first use by the CPU platform (Platform.native_library: cc -O3 -march=native
 * -ffast-math) and called through ctypes with raw pointers: no torch headers, so the build
 * stays short. Its loops run on the platform's thread pool (corellm_pool.h).
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
 * every thread busy (with as many sequences as threads, whole rows read in order are faster). The step's new K/V of a
 * sequence are written to its slot by the work item that reads it, first (its part of the
 * row), so a decode step needs no separate write call; prefill rows are written by
 * corellm_write_kv before the prefill kernel reads them.
 *
 * Tried and measured slower (docs/attention.md): scores for 8 keys at a time with explicit
 * vector code (faster while the cache is hot, slower once it is not: the per-token loops
 * below read the rows in order), and software prefetch of the next block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "corellm_pool.h"     /* the CPU platform's thread pool */
#include "corellm_tile.h"     /* the CPU platform's GEMM micro-kernel and bf16 conversions
                               * (its csrc/, on the include path of Platform.native_library) */

static inline float ld_f32(const float *p, int64_t i) { return p[i]; }
static inline float ld_bf16(const bf16_t *p, int64_t i) { return from_bf16(p[i]); }
static inline void st_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline void st_bf16(bf16_t *p, int64_t i, float x) { p[i] = to_bf16(x); }

/* bf16 rows are prefetched this many tokens ahead within a block: a bf16 row is half an fp32
 * one for the same work, so the loop alone keeps half as many bytes in flight; prefetching
 * restores that for long contexts, while fp32 rows gain nothing from it (docs/attention.md). */
#define DECODE_PF_BF16 4

/* Scores buffer: G * span floats per work item, grown as needed, one per thread of the pool
 * (which lives as long as the process, so it is allocated once, not per call); 64-byte aligned, so that the vectors of the queries and outputs after the scores (each at a multiple
 * of 16 floats) never straddle two cache lines: a vector load across two lines costs two,
 * and malloc only promises 16-byte alignment. */
static float *scratch(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = (float *)aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}
#define ALIGN16(n) (((n) + 15) / 16 * 16)      /* floats to the next multiple of 64 bytes */
static __thread struct { float *buf; int64_t cap; } decode_scratch;

/* Whether any of n slots lies past the cache's num_slots (a KV manager's bug): both writers
 * check this before they write anything. */
static int slot_outside(const int64_t *slots, int64_t n, int64_t num_slots) {
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] >= num_slots) return 1;
    return 0;
}

/* One sequence's decode attention for KV heads [g0, g1) and the query heads that share them:
 * each cached token's row (all KV heads, contiguous) is read once, in order within a block.
 * HD is the head size when known at compile time (the common 64 and 128 get unrolled loops),
 * else 0 and D is used. */
#define DECODE_SEQ(SUFFIX, T, LD, ST, HD)                                                     \
static int decode_seq_##SUFFIX##_##HD(                                                       \
        const T *qrow, T *k_cache, T *v_cache, const int64_t *table,                          \
        int64_t len, T *o, int64_t num_heads, int64_t num_kv_heads, int64_t D_,               \
        int64_t block_size, float scale, int64_t window, int64_t g0, int64_t g1,              \
        const T *knew, const T *vnew, int64_t slot, float **buf, int64_t *cap) {              \
    const int64_t D = HD ? HD : D_;                                                           \
    const int64_t G = num_heads / num_kv_heads, H = (g1 - g0) * G, row = num_kv_heads * D;   \
    const int64_t start = (window > 0 && len > window) ? len - window : 0;                    \
    const int64_t span = len - start;                                                         \
    const int64_t row_bytes = (g1 - g0) * D * (int64_t)sizeof(T);  /* what is read per token */ \
    const int64_t pf = sizeof(T) == 2 ? DECODE_PF_BF16 : 0;                                   \
    qrow += g0 * G * D;                                                                       \
    o += g0 * G * D;                                                                          \
    k_cache += g0 * D;                                                                        \
    v_cache += g0 * D;                                                                        \
    if (knew && slot >= 0) {          /* this token's K/V first: its own key is read last */  \
        memcpy(k_cache + slot * row, knew + g0 * D, (size_t)row_bytes);                       \
        memcpy(v_cache + slot * row, vnew + g0 * D, (size_t)row_bytes);                       \
    }                                                                                         \
    float *s = scratch(buf, cap, ALIGN16(H * span) + 2 * ALIGN16(H * D));                     \
    if (!s) return -1;                                                                        \
    float *qf = s + ALIGN16(H * span), *acc = qf + ALIGN16(H * D);                            \
    for (int64_t x = 0; x < H * D; ++x) { qf[x] = LD(qrow, x) * scale; acc[x] = 0.f; }       \
    for (int64_t b = start / block_size; b * block_size < len; ++b) {                        \
        const int64_t t0 = b * block_size > start ? b * block_size : start;                   \
        const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;           \
        const T *k = k_cache + (table[b] * block_size + (t0 - b * block_size)) * row;         \
        for (int64_t t = t0; t < t1; ++t, k += row) {                                         \
            if (pf && t + pf < t1)                                                            \
                for (int64_t l = 0; l < row_bytes; l += 64)                                   \
                    __builtin_prefetch((const char *)(k + pf * row) + l, 0, 3);               \
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
            if (pf && t + pf < t1)                                                            \
                for (int64_t l = 0; l < row_bytes; l += 64)                                   \
                    __builtin_prefetch((const char *)(v + pf * row) + l, 0, 3);               \
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
typedef struct {                                                                              \
    const T *q; int64_t q_stride; T *k_cache, *v_cache; const int64_t *block_table;           \
    int64_t table_stride; const int64_t *seq_lens; T *out;                                    \
    int64_t num_heads, num_kv_heads, head_size, block_size; float scale; int64_t window;       \
    const T *k_new; int64_t k_new_stride; const T *v_new; int64_t v_new_stride;               \
    const int64_t *slots; int64_t per, parts; int failed;                                     \
} decode_args_##SUFFIX;                                                                       \
/* work items [w0, w1): item w is sequence w / parts, KV heads [g0, g0 + per) */              \
static void decode_items_##SUFFIX(void *ctx, int64_t w0, int64_t w1, int tid) {               \
    decode_args_##SUFFIX *a = ctx;                                                            \
    (void)tid;                                                                                \
    for (int64_t w = w0; w < w1; ++w) {                                                       \
        const int64_t i = w / a->parts, g0 = (w % a->parts) * a->per, g1 = g0 + a->per;       \
        const T *qi = a->q + i * a->q_stride;                                                 \
        const int64_t *ti = a->block_table + i * a->table_stride;                             \
        T *oi = a->out + i * a->num_heads * a->head_size;                                     \
        const T *kn = a->k_new ? a->k_new + i * a->k_new_stride : NULL;                       \
        const T *vn = a->k_new ? a->v_new + i * a->v_new_stride : NULL;                       \
        const int64_t slot = a->k_new ? a->slots[i] : -1;                                     \
        int rc;                                                                               \
        if (a->head_size == 64)                                                               \
            rc = decode_seq_##SUFFIX##_64(qi, a->k_cache, a->v_cache, ti, a->seq_lens[i], oi, \
                    a->num_heads, a->num_kv_heads, 64, a->block_size, a->scale, a->window,    \
                    g0, g1, kn, vn, slot, &decode_scratch.buf, &decode_scratch.cap);          \
        else if (a->head_size == 128)                                                         \
            rc = decode_seq_##SUFFIX##_128(qi, a->k_cache, a->v_cache, ti, a->seq_lens[i],    \
                    oi, a->num_heads, a->num_kv_heads, 128, a->block_size, a->scale,          \
                    a->window, g0, g1, kn, vn, slot, &decode_scratch.buf,                     \
                    &decode_scratch.cap);                                                     \
        else                                                                                  \
            rc = decode_seq_##SUFFIX##_0(qi, a->k_cache, a->v_cache, ti, a->seq_lens[i], oi,  \
                    a->num_heads, a->num_kv_heads, a->head_size, a->block_size, a->scale,     \
                    a->window, g0, g1, kn, vn, slot, &decode_scratch.buf,                     \
                    &decode_scratch.cap);                                                     \
        if (rc) __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);                            \
    }                                                                                         \
}                                                                                             \
int corellm_paged_decode_##SUFFIX(                                                            \
        const T *q, int64_t q_stride, /* [n, H, D]: token stride, heads contiguous */         \
        T *k_cache, T *v_cache, const int64_t *block_table,                                   \
        int64_t table_stride, const int64_t *seq_lens, T *out, /* [n, H, D] contiguous */     \
        int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,                \
        int64_t block_size, float scale, int64_t window,                                      \
        /* the n new tokens' K and V ([n, Hkv, D], token strides), each written to its slot  \
         * (slots[i], of num_slots; negative: none) by its work item before it reads the      \
         * cache; NULL: the caller wrote them. Work items run at once, so no sequence's slot  \
         * may lie in a block another sequence of the call reads (the KV managers never      \
         * share a block that is still being written). */                                     \
        const T *k_new, int64_t k_new_stride, const T *v_new, int64_t v_new_stride,           \
        const int64_t *slots, int64_t num_slots) {                                            \
    if (k_new && slot_outside(slots, n, num_slots))                                           \
        return -2;                                /* nothing done: a slot outside the cache */ \
    /* whole sequences while there is one per thread, else one KV head each */                \
    const int64_t per = n >= (int64_t)corellm_pool_threads() ? num_kv_heads : 1;              \
    decode_args_##SUFFIX a = {q, q_stride, k_cache, v_cache, block_table, table_stride,       \
                              seq_lens, out, num_heads, num_kv_heads, head_size, block_size,  \
                              scale, window, k_new, k_new_stride, v_new, v_new_stride, slots, \
                              per, num_kv_heads / per, 0};                                     \
    corellm_parallel_for(n * a.parts, 1, decode_items_##SUFFIX, &a);                          \
    return a.failed ? -1 : 0;                                                                 \
}

DEFINE_DECODE(f32, float, ld_f32, st_f32)
DEFINE_DECODE(bf16, bf16_t, ld_bf16, st_bf16)

/* KV write: token j's K and V rows (num_kv_heads * head_size contiguous elements at
 * key + j * key_stride) go to cache slot slots[j] (of num_slots); negative slots are skipped.
 * For the rows the decode kernel does not write itself (prefills; decodes when the caller
 * writes them first). -2, nothing written: a slot outside the cache. */
typedef struct {
    const char *key; int64_t key_stride; const char *value; int64_t value_stride;
    char *k_cache, *v_cache; const int64_t *slots; int64_t row_bytes, elem_bytes;
} write_kv_args;

static void write_kv_rows(void *ctx, int64_t j0, int64_t j1, int tid) {
    const write_kv_args *a = ctx;
    (void)tid;
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t slot = a->slots[j];
        if (slot < 0) continue;
        memcpy(a->k_cache + slot * a->row_bytes, a->key + j * a->key_stride * a->elem_bytes,
               (size_t)a->row_bytes);
        memcpy(a->v_cache + slot * a->row_bytes, a->value + j * a->value_stride * a->elem_bytes,
               (size_t)a->row_bytes);
    }
}

int corellm_write_kv(const char *key, int64_t key_stride, const char *value,
                     int64_t value_stride, char *k_cache, char *v_cache, const int64_t *slots,
                     int64_t num_slots, int64_t n, int64_t row_bytes, int64_t elem_bytes) {
    if (slot_outside(slots, n, num_slots))
        return -2;
    write_kv_args a = {key, key_stride, value, value_stride, k_cache, v_cache, slots, row_bytes,
                       elem_bytes};
    corellm_parallel_for(n, 64, write_kv_rows, &a);
    return 0;
}

/* Prefill attention: causal (and windowed) attention of each prefill's new tokens over its
 * whole context, read from the paged cache (the step's K/V are written first), all of a step's
 * prefills in one call.
 *
 * A work item is one prefill's KV head and a chunk of at most PREFILL_ROWS of its new tokens
 * (fewer when that leaves threads without an item), with the query heads that share the KV
 * head. Its keys (those the chunk's rows can see) are packed once into panels of NR keys,
 * [keys / NR][D][NR], and its values into [D / NR][keys][NR] (both widened to fp32), so that
 * both products are the core's register-blocked GEMM tiles
 * (corellm_tile.h): scores = Q K^T, MR rows by NR keys over D; out = P V, MR rows by NR of D
 * over the keys. A tile of rows computes only the key panels its rows can see (causal and
 * window bounds), then a row-wise softmax in fp32 (masked keys get probability 0), then P V.
 * Arithmetic in fp32 for bf16 too (queries widened per tile, output rounded once).
 * It is chosen over torch's flash attention (one call per prefill) because it reads the blocks
 * in place and batches every prefill of a step; figures in docs/attention.md. */
#define PREFILL_ROWS 192    /* a multiple of MR; 60 and 96 re-packed K/V too often (slower) */

/* Each thread's scratch (packed K/V, scores) lives as long as the thread (the pool's threads
 * are long-lived) and only grows: allocating it per call gave every layer's call fresh
 * pages to fault in once it passed malloc's mmap threshold (long contexts). */
typedef struct { float *buf; int64_t cap; } pscratch_t;
static __thread pscratch_t prefill_scratch;

static float *pgrow(pscratch_t *s, int64_t n) {
    if (n > s->cap) {
        free(s->buf);
        s->buf = (float *)malloc((size_t)n * sizeof(float));
        s->cap = s->buf ? n : 0;
    }
    return s->buf;
}

#define DEFINE_PREFILL(SUFFIX, T, LD, ST, IS_F32)                                              \
static int prefill_item_##SUFFIX(                                                             \
        const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                     \
        const int64_t *table, int64_t first, int64_t ctx, int64_t seq, int64_t r0, int64_t r1, \
        int64_t g, T *out, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,        \
        int64_t window, pscratch_t *scr) {                                                     \
    const int64_t G = H / Hkv, row = Hkv * D;                                                 \
    const int64_t k_lo = window > 0 && ctx + r0 - window + 1 > 0 ? ctx + r0 - window + 1 : 0; \
    const int64_t nk = ctx + r1 - k_lo, np = (nk + NR - 1) / NR, nkp = np * NR;               \
    const int64_t dp = (D + NR - 1) / NR;                                                     \
    (void)seq;                                                                                \
    float *kt = pgrow(scr, np * D * NR + dp * nkp * NR + MR * nkp + MR * D + MR * NR);        \
    if (!kt) return -1;                                                                       \
    float *vp = kt + np * D * NR, *sc = vp + dp * nkp * NR, *qb = sc + MR * nkp;              \
    float *edge = qb + MR * D;                                                                \
    for (int64_t j = 0; j < nkp; ++j) {          /* pack K^T and V of keys [k_lo, k_lo+nk) */ \
        float *kd = kt + (j / NR) * D * NR + j % NR, *vd = vp + j * NR;                       \
        const int64_t pos = k_lo + j;                                                         \
        const int64_t slot = j < nk ? table[pos / bs] * bs + pos % bs : 0;                    \
        const T *kr = k_cache + slot * row + g * D, *vr = v_cache + slot * row + g * D;       \
        if (j < nk)                                                                           \
            for (int64_t d = 0; d < D; ++d) kd[d * NR] = LD(kr, d);                           \
        else                                                                                  \
            for (int64_t d = 0; d < D; ++d) kd[d * NR] = 0.f;                                 \
        for (int64_t v = 0; v < dp; ++v, vd += nkp * NR) {   /* NR contiguous values */        \
            const int64_t w = j < nk ? (D - v * NR < NR ? D - v * NR : NR) : 0;               \
            for (int64_t d = 0; d < w; ++d) vd[d] = LD(vr + v * NR, d);                       \
            for (int64_t d = w; d < NR; ++d) vd[d] = 0.f;                                     \
        }                                                                                     \
    }                                                                                         \
    for (int64_t hq = g * G; hq < (g + 1) * G; ++hq) {                                        \
        for (int64_t t0 = r0; t0 < r1; t0 += MR) {                                            \
            const int64_t rows = r1 - t0 < MR ? r1 - t0 : MR;                                 \
            const T *qa = q + (first + t0) * q_stride + hq * D;                               \
            const float *a;                                                                   \
            int64_t lda;                                                                      \
            if (IS_F32) { a = (const float *)qa; lda = q_stride; }                            \
            else {                                                                            \
                for (int64_t r = 0; r < rows; ++r)                                            \
                    for (int64_t d = 0; d < D; ++d) qb[r * D + d] = LD(qa + r * q_stride, d);  \
                a = qb; lda = D;                                                              \
            }                                                                                 \
            /* keys the tile's rows see, relative to k_lo: [j_lo, j_hi) */                    \
            const int64_t p_first = ctx + t0, p_last = ctx + t0 + rows - 1;                   \
            const int64_t lo_abs = window > 0 && p_first - window + 1 > k_lo                   \
                                   ? p_first - window + 1 : k_lo;                             \
            const int64_t pl0 = (lo_abs - k_lo) / NR, pl1 = (p_last + 1 - k_lo + NR - 1) / NR; \
            const int64_t ls = (pl1 - pl0) * NR;          /* the tile's score row stride */    \
            for (int64_t pl = pl0; pl < pl1; ++pl)                                            \
                tiles_f32[rows](D, a, lda, kt + pl * D * NR, NULL, sc + (pl - pl0) * NR, ls); \
            for (int64_t r = 0; r < rows; ++r) {                                              \
                const int64_t pos = p_first + r;                                              \
                const int64_t lo = (window > 0 && pos - window + 1 > k_lo ? pos - window + 1  \
                                    : k_lo) - k_lo - pl0 * NR;                                \
                const int64_t hi = pos + 1 - k_lo - pl0 * NR;                                 \
                float *sr = sc + r * ls, m = -INFINITY, sum = 0.f;                            \
                for (int64_t j = lo; j < hi; ++j) { sr[j] *= scale; m = sr[j] > m ? sr[j] : m; } \
                for (int64_t j = 0; j < lo; ++j) sr[j] = 0.f;                                 \
                for (int64_t j = hi; j < ls; ++j) sr[j] = 0.f;                                \
                _Pragma("omp simd reduction(+:sum)")                                          \
                for (int64_t j = lo; j < hi; ++j) { sr[j] = expf(sr[j] - m); sum += sr[j]; }  \
                const float inv = 1.f / sum;                                                  \
                for (int64_t j = lo; j < hi; ++j) sr[j] *= inv;                               \
            }                                                                                 \
            for (int64_t v = 0; v < dp; ++v) {                                                \
                const int64_t width = D - v * NR < NR ? D - v * NR : NR;                      \
                T *o = out + (first + t0) * H * D + hq * D + v * NR;                          \
                const int direct = IS_F32 && width == NR;                                     \
                float *c = direct ? (float *)o : edge;                                        \
                tiles_f32[rows](ls, sc, ls, vp + v * nkp * NR + pl0 * NR * NR, NULL, c,       \
                                direct ? H * D : NR);                                         \
                if (!direct)                                                                  \
                    for (int64_t r = 0; r < rows; ++r)                                        \
                        for (int64_t d = 0; d < width; ++d)                                   \
                            ST(o + r * H * D, d, edge[r * NR + d]);                           \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    return 0;                                                                                 \
}                                                                                             \
typedef struct {                                                                              \
    const T *q; int64_t q_stride; const T *k_cache, *v_cache; const int64_t *block_table;     \
    int64_t table_stride; const int64_t *meta; int64_t n; T *out;                             \
    int64_t num_heads, num_kv_heads, head_size, block_size; float scale; int64_t window;       \
    int64_t rows_per; int failed;                                                             \
} prefill_args_##SUFFIX;                                                                      \
/* Items [w0, w1): item w is the prefill and chunk it falls in (later chunks first: they see  \
 * more keys, so the longest items start first), then the KV head. */                        \
static void prefill_items_##SUFFIX(void *ctx, int64_t w0, int64_t w1, int tid) {              \
    prefill_args_##SUFFIX *a = ctx;                                                           \
    const int64_t *meta = a->meta, Hkv = a->num_kv_heads, rows_per = a->rows_per;            \
    (void)tid;                                                                                \
    for (int64_t w = w0; w < w1; ++w) {                                                       \
        int64_t left = w / Hkv, i = 0, chunks = 0;                                            \
        for (; i < a->n; ++i, left -= chunks) {                                               \
            chunks = (meta[3 * i + 2] - meta[3 * i + 1] + rows_per - 1) / rows_per;           \
            if (left < chunks) break;                                                         \
        }                                                                                     \
        const int64_t ctx_len = meta[3 * i + 1], seq = meta[3 * i + 2];                       \
        const int64_t r0 = (chunks - 1 - left) * rows_per;                                    \
        const int64_t r1 = r0 + rows_per < seq - ctx_len ? r0 + rows_per : seq - ctx_len;     \
        if (prefill_item_##SUFFIX(a->q, a->q_stride, a->k_cache, a->v_cache,                  \
                                  a->block_table + i * a->table_stride, meta[3 * i], ctx_len, \
                                  seq, r0, r1, w % Hkv, a->out, a->num_heads, Hkv,            \
                                  a->head_size, a->block_size, a->scale, a->window,           \
                                  &prefill_scratch))                                          \
            __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);                                \
    }                                                                                         \
}                                                                                             \
/* meta [n][3]: a prefill's first row in q/out, its context length (tokens already cached     \
 * before this step's), its sequence length; table: its block-table row (row stride           \
 * table_stride). q [T, H, D] (token stride q_stride, heads contiguous); out [T, H, D]         \
 * contiguous. Returns -1 when a scratch buffer could not be allocated. */                    \
int corellm_paged_prefill_##SUFFIX(                                                           \
        const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                     \
        const int64_t *block_table, int64_t table_stride, const int64_t *meta, int64_t n,     \
        T *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,                   \
        int64_t block_size, float scale, int64_t window) {                                    \
    const int threads = corellm_pool_threads();                                               \
    /* rows per chunk: PREFILL_ROWS, or fewer (halved, in whole tiles) until every thread     \
     * has an item, as long as chunks hold more than one tile */                              \
    int64_t rows_per = PREFILL_ROWS, items = 0;                                               \
    for (;;) {                                                                                \
        items = 0;                                                                            \
        for (int64_t i = 0; i < n; ++i)                                                       \
            items += (meta[3 * i + 2] - meta[3 * i + 1] + rows_per - 1) / rows_per;           \
        items *= num_kv_heads;                                                                \
        if (items >= threads || rows_per <= MR) break;                                        \
        rows_per = (rows_per / 2 + MR - 1) / MR * MR;                                         \
    }                                                                                         \
    prefill_args_##SUFFIX a = {q, q_stride, k_cache, v_cache, block_table, table_stride, meta,  \
                               n, out, num_heads, num_kv_heads, head_size, block_size, scale, \
                               window, rows_per, 0};                                          \
    corellm_parallel_for(items, 1, prefill_items_##SUFFIX, &a);                               \
    return a.failed ? -1 : 0;                                                                 \
}

TILES(f32, load_f32)
DEFINE_PREFILL(f32, float, ld_f32, st_f32, 1)
DEFINE_PREFILL(bf16, bf16_t, ld_bf16, st_bf16, 0)
