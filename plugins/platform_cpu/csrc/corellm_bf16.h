/* bfloat16 <-> float32, the one conversion every CPU kernel of corellm uses (the platform's
 * GEMM and element-wise kernels, the torch_sdpa plugin's paged attention): the CPU platform puts
 * this folder on the include path of every library it builds (Platform.native_library).
 *
 * Rounding is torch's, so a kernel's bf16 output is bit-equal to the torch code it replaces:
 * to nearest even, and every NaN to the canonical quiet NaN 0x7fc0 (rounding a NaN's bits as a
 * number could carry into the exponent and turn it into an infinity).
 */
#ifndef CORELLM_BF16_H
#define CORELLM_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

/* bf16 -> fp32: the bf16 bits are the top half of the float's, exactly. */
static inline float from_bf16(bf16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16 as torch rounds: to nearest even, NaN -> 0x7fc0. */
static inline bf16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u ? (bf16_t)0x7fc0u
                                           : (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
