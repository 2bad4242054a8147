/* Element-wise layers of a decoder in one pass each, for float32 on the CPU: RMSNorm,
 * SiLU-and-multiply and rotary embeddings (rotate-half form).
 *
 * Built on first use by corellm.native and called through ctypes (corellm/worker/cpu.py).
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
 */
#include <math.h>
#include <stdint.h>

/* out[r, :] = w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)). Row r of x is at
 * (r / inner) * outer_stride + (r % inner) * inner_stride; out is contiguous [rows, n]. */
void corellm_rms_norm_f32(const float *x, int64_t outer_stride, int64_t inner_stride,
                          int64_t inner, const float *w, float *out, int64_t rows, int64_t n,
                          float eps, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(rows * n >= 65536)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + (r / inner) * outer_stride + (r % inner) * inner_stride;
        float *o = out + r * n;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; ++j) acc[j] += xr[i + j] * xr[i + j];
        float sum = 0.f;
        for (int j = 0; j < 16; ++j) sum += acc[j];
        for (; i < n; ++i) sum += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(sum / (float)n + eps);
        for (int64_t k = 0; k < n; ++k) o[k] = w[k] * (xr[k] * inv);
    }
}

/* out[t, :] = silu(x[t, :d]) * x[t, d:] for x [rows, 2d] contiguous, out [rows, d]. */
void corellm_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d,
                              int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(rows * d >= 65536)")
    for (int64_t t = 0; t < rows; ++t) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        _Pragma("omp simd")
        for (int64_t i = 0; i < d; ++i) o[i] = g[i] / (1.f + expf(fminf(-g[i], 88.f))) * u[i];
    }
}

/* Rotate, in place, the first rot dims of each of the heads of token t of x (head h of token
 * t at x + t * token_stride + h * head_stride) by the cos/sin row of positions[t] (tables
 * [P, rot / 2]): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves. */
static void rope_one(float *x, int64_t token_stride, int64_t head_stride, int64_t heads,
                     int64_t t, const float *c, const float *s, int64_t half) {
    for (int64_t h = 0; h < heads; ++h) {
        float *x1 = x + t * token_stride + h * head_stride, *x2 = x1 + half;
        _Pragma("omp simd")
        for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

void corellm_rope_f32(float *q, int64_t q_token_stride, int64_t q_head_stride, int64_t q_heads,
                      float *k, int64_t k_token_stride, int64_t k_head_stride, int64_t k_heads,
                      const int64_t *positions, int64_t tokens, const float *cos_table,
                      const float *sin_table, int64_t rot, int num_threads) {
    const int64_t half = rot / 2, work = tokens * (q_heads + k_heads) * rot;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(work >= 65536)")
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        rope_one(q, q_token_stride, q_head_stride, q_heads, t, c, s, half);
        rope_one(k, k_token_stride, k_head_stride, k_heads, t, c, s, half);
    }
}
