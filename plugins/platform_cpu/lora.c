/* Multi-LoRA on the CPU: each token's adapter products, with that token's adapter only.
 *
 * For every token t whose slot s = slots[t] is not -1, and every part p of the layer (q, k, v of
 * a QKV projection; gate, up; one for an unfused layer):
 *
 *   h = A[p, s] x_t            (the shrink: R dot products of length K)
 *   y_t[off_p : off_p + n_p] += h^T B_p[s]      (the expand: R scaled rows of B added)
 *
 * with A [S, P, R, K] and B_p [S, R, n_p] (B transposed), float32. The tokens are taken in
 * ``order`` (the step's tokens grouped by slot), up to TILE of the same slot at a time, so each
 * row of A and of B read from the cache serves several tokens. Output rows are split over the
 * platform's thread pool by token; a token's result does not depend on the others (the same
 * operations in the same order whatever the batch). Unlike stacking every slot's A and B into
 * one GEMM, no product of another adapter's weights is computed and thrown away.
 */
#include <stdint.h>

#include "corellm_pool.h"

#define TILE 4

typedef struct {
    const float *x;
    int64_t ldx, K;
    const int64_t *order, *slots;
    const float *a;
    int64_t P, S, R;
    const float *const *b;
    const int64_t *off, *n;
    float *y;
    int64_t ldy;
} lora_args;

static void lora_tokens(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const lora_args *g = ctx;
    const int64_t K = g->K, R = g->R;
    float h[TILE][R > 0 ? R : 1];
    int64_t i = i0;
    while (i < i1) {
        const int64_t s = g->slots[g->order[i]];
        int m = 1;
        while (m < TILE && i + m < i1 && g->slots[g->order[i + m]] == s) m++;
        const float *xt[TILE];
        float *yt[TILE];
        for (int u = 0; u < m; u++) {
            xt[u] = g->x + g->order[i + u] * g->ldx;
            yt[u] = g->y + g->order[i + u] * g->ldy;
        }
        for (int64_t p = 0; p < g->P; p++) {
            const float *ap = g->a + (s * g->P + p) * R * K;
            for (int64_t r = 0; r < R; r++) {
                const float *row = ap + r * K;
                for (int u = 0; u < m; u++) {
                    const float *xu = xt[u];
                    float acc = 0.f;
#pragma omp simd reduction(+:acc)
                    for (int64_t k = 0; k < K; k++) acc += row[k] * xu[k];
                    h[u][r] = acc;
                }
            }
            const int64_t n = g->n[p];
            const float *bp = g->b[p] + s * R * n;
            for (int64_t r = 0; r < R; r++) {
                const float *row = bp + r * n;
                for (int u = 0; u < m; u++) {
                    const float hr = h[u][r];
                    float *yp = yt[u] + g->off[p];
#pragma omp simd
                    for (int64_t j = 0; j < n; j++) yp[j] += hr * row[j];
                }
            }
        }
        i += m;
    }
}

/* The tokens order[0 .. count) (each with a slot: slots[t] >= 0), as above. */
void corellm_lora_f32(const float *x, int64_t ldx, int64_t K, const int64_t *order, int64_t count,
                      const int64_t *slots, const float *a, int64_t P, int64_t S, int64_t R,
                      const float *const *b, const int64_t *off, const int64_t *n, float *y,
                      int64_t ldy) {
    lora_args g = {x, ldx, K, order, slots, a, P, S, R, b, off, n, y, ldy};
    int64_t work = P * R * K;                  /* per token: about the shrink's multiply-adds */
    for (int64_t p = 0; p < P; p++) work += R * n[p];
    const int64_t grain = work >= 65536 ? TILE : TILE * (65536 / (work > 0 ? work : 1));
    corellm_parallel_for(count, grain, lora_tokens, &g);
}
