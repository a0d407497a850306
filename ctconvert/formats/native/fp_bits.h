/* Bit helpers the C kernels share (quant.c, observe.c, dequant.c): fp32 bit views and the exact E4M3FN
 * conversions. Header-only, static inline: each kernel compiles its own copy, as if written in place.
 * ctconvert/cbuild.py keys a build on the bytes of the local headers a source includes too. */
#ifndef CT_FP_BITS_H
#define CT_FP_BITS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* fp32 -> E4M3FN byte, round to nearest even; |x| <= 448 and finite (callers clamp).
 * Branch-free so that loops vectorize: the normal path rounds the fp32 mantissa to
 * 3 bits in place (carry into the exponent included) and rebiases 127 -> 7; the
 * subnormal path counts multiples of 2^-9 (m == 8 is the smallest normal, 0x08). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u = f2u(x);
    uint32_t sign = (u >> 24) & 0x80u;
    float a = fabsf(x);
    uint32_t ua = f2u(a);
    uint32_t norm = ((ua + 0x7FFFFu + ((ua >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t sub = (uint32_t)(int32_t)rintf(a * 512.0f);
    return (uint8_t)(sign | (a < 0.015625f ? sub : norm));
}

/* E4M3 byte -> fp32, exactly: a normal byte is 2^(e-7) * (1 + m/8), whose fp32 pattern is exponent e + 120 and
 * the 3 mantissa bits on top; a subnormal one m * 2^-9 (a product by a power of two: exact). No libm call. */
static inline float e4m3_to_f32(uint8_t b) {
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    float v = e == 0 ? (float)m * 0x1p-9f : u2f(((e + 120u) << 23) | (m << 20));
    return (b & 0x80) ? -v : v;
}

#endif
