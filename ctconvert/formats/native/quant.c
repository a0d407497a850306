/*
 * ctconvert CPU kernels: fused, single-pass-per-row quantizers.
 *
 * Each function reads a row-major block of rows once (bf16, fp16 or fp32),
 * and writes the packed values and the scales once. The arithmetic is the
 * same, operation for operation, as the torch reference in ../fp8.py,
 * ../integer.py, ../fp4.py and ../mx.py (and so as compressed-tensors' CPU path,
 * docs/compressed-tensors-format.md section 6): every step "in D" is an fp32
 * operation rounded to D with round-to-nearest-even.
 *
 * Build: cc -O3 -shared -fPIC (no -ffast-math: IEEE division and rounding
 * are part of the format). Called through ctypes, which releases the GIL, so
 * Python threads can run disjoint row ranges in parallel.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };

#include "fp_bits.h"

/* RNE to bf16, branch-free (a default NaN, e.g. from 0/0, stays a NaN). */
static inline uint16_t f32_to_bf16_bits(float x) {
    uint32_t u = f2u(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* |x| as ordered bits: for non-NaN floats, max over these integers is the max |x|
 * (integer max vectorizes; NaN/inf are rejected before quantization). */
static inline uint32_t absbits(float x) { return f2u(x) & 0x7FFFFFFFu; }

/* Round an fp32 value to D and back (the result of one arithmetic step in D). */
static inline float rd(float x, int dt) {
    if (dt == DT_BF16) return u2f((uint32_t)f32_to_bf16_bits(x) << 16);
    if (dt == DT_F16) return (float)(_Float16)x;
    return x;
}

static inline float load(const void *p, int dt, int64_t i) {
    if (dt == DT_BF16) return u2f((uint32_t)((const uint16_t *)p)[i] << 16);
    if (dt == DT_F16) return (float)((const _Float16 *)p)[i];
    return ((const float *)p)[i];
}

/* Store x (already a value of D) as D. */
static inline void store_d(void *p, int dt, int64_t i, float x) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16_bits(x);
    else if (dt == DT_F16) ((_Float16 *)p)[i] = (_Float16)x;
    else ((float *)p)[i] = x;
}

static inline float eps_of(int dt) {
    return dt == DT_BF16 ? 0.0078125f : dt == DT_F16 ? 0.0009765625f : 1.1920928955078125e-07f;
}

/* E2M1 magnitude index with ties to even (thresholds of docs/compressed-tensors-format.md 6.4). */
static inline int32_t e2m1_code(float x) {
    float a = fabsf(x);
    int32_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return c | ((x < 0.0f) << 3);
}

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* ---- FP8 per channel: q [n, k] E4M3 bytes, scale [n] in D ---- */
static inline __attribute__((always_inline)) void ct_fp8_channel_impl(const void *w, int dt, int64_t n, int64_t k, uint8_t *q, void *scale) {
    for (int64_t r = 0; r < n; r++) {
        const int64_t base = r * k;
        uint32_t amax_b = 0;
        for (int64_t j = 0; j < k; j++) { uint32_t a = absbits(load(w, dt, base + j)); amax_b = a > amax_b ? a : amax_b; }
        float amax = u2f(amax_b);
        float s = rd(amax / 448.0f, dt);
        if (s == 0.0f) s = eps_of(dt);
        store_d(scale, dt, r, s);
        for (int64_t j = 0; j < k; j++) {
            float v = rd(load(w, dt, base + j) / s, dt);
            q[base + j] = f32_to_e4m3(clampf(v, -448.0f, 448.0f));
        }
    }
}

/* ---- FP8 per block: rows [0, n) of one band group; n need not divide bh on the last call.
 * scale is [ceil(n/bh), ceil(k/bw)] in D for these rows. ---- */
static inline __attribute__((always_inline)) void ct_fp8_block_impl(const void *w, int dt, int64_t n, int64_t k, int64_t bh, int64_t bw, uint8_t *q, void *scale) {
    const int64_t kb = (k + bw - 1) / bw;
    for (int64_t r0 = 0, br = 0; r0 < n; r0 += bh, br++) {
        const int64_t r1 = r0 + bh < n ? r0 + bh : n;
        for (int64_t bc = 0; bc < kb; bc++) {
            const int64_t c0 = bc * bw, c1 = c0 + bw < k ? c0 + bw : k;
            uint32_t amax_b = 0;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t j = c0; j < c1; j++) { uint32_t a = absbits(load(w, dt, r * k + j)); amax_b = a > amax_b ? a : amax_b; }
            float amax = u2f(amax_b);
            float s = rd(amax / 448.0f, dt);
            if (s == 0.0f) s = eps_of(dt);
            store_d(scale, dt, br * kb + bc, s);
            for (int64_t r = r0; r < r1; r++)
                for (int64_t j = c0; j < c1; j++) {
                    float v = rd(load(w, dt, r * k + j) / s, dt);
                    q[r * k + j] = f32_to_e4m3(clampf(v, -448.0f, 448.0f));
                }
        }
    }
}

/* ---- min(x, 0) and max(x, 0) of g elements from i0 (NaN left out), as the running min/max
 * `m = x < m ? x : m` from m = +0 computes them: in 16 lanes of GCC/clang vector types (a running min does
 * not vectorize on its own), then over the lanes. Each lane starts at +0 and only moves to a strictly smaller
 * (larger) value and never to NaN, so the lanes' min (max) is the running one, bit for bit. ---- */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load16(const void *p, int dt, int64_t i) {
    if (dt == DT_BF16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return (v16f)(__builtin_convertvector(h, v16u) << 16);
    }
    v16f x;
    if (dt == DT_F32) memcpy(&x, (const float *)p + i, sizeof x);
    else for (int l = 0; l < 16; l++) x[l] = (float)((const _Float16 *)p)[i + l];
    return x;
}

static inline void group_minmax(const void *w, int dt, int64_t i0, int64_t g, float *mn_out, float *mx_out) {
    v16f vmn = {0}, vmx = {0};
    int64_t j = 0;
    for (; j + 16 <= g; j += 16) {
        v16f x = load16(w, dt, i0 + j);
        v16i lt = x < vmn, gt = x > vmx;
        vmn = (v16f)(((v16i)x & lt) | ((v16i)vmn & ~lt));
        vmx = (v16f)(((v16i)x & gt) | ((v16i)vmx & ~gt));
    }
    float mn = 0.0f, mx = 0.0f;
    for (int l = 0; l < 16; l++) {
        mn = vmn[l] < mn ? vmn[l] : mn;
        mx = vmx[l] > mx ? vmx[l] : mx;
    }
    for (; j < g; j++) {
        float x = load(w, dt, i0 + j);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
    }
    *mn_out = mn;
    *mx_out = mx;
}

/* ---- Integer, per group (g == k for per channel), symmetric or asymmetric.
 * pack == 0: out is int8 [n, k]; pack == 1: out is int32 [n, ceil(k*bits/32)] (LSB first, u = q + 2^(B-1)).
 * scale [n, k/g] in D; zp [n, k/g] int8 (asymmetric only, else NULL). ---- */
static inline __attribute__((always_inline)) void ct_int_impl(const void *w, int dt, int64_t n, int64_t k, int64_t g, int bits, int sym, int pack,
            void *out, void *scale, int8_t *zp, int8_t *tmp /* [k] scratch per call */) {
    const float qmin = -(float)(1 << (bits - 1)), qmax = (float)((1 << (bits - 1)) - 1);
    const int64_t groups = k / g;
    const int64_t words = (k * bits + 31) / 32;
    const float full = (float)((1 << bits) - 1);
    const float half = full / 2.0f;
    for (int64_t r = 0; r < n; r++) {
        const int64_t base = r * k;
        int8_t *qrow = pack ? tmp : (int8_t *)out + base;
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t c0 = gi * g;
            float s, z = 0.0f;
            if (sym) {
                uint32_t amax_b = 0;
                for (int64_t j = 0; j < g; j++) { uint32_t a = absbits(load(w, dt, base + c0 + j)); amax_b = a > amax_b ? a : amax_b; }
                float amax = u2f(amax_b);
                s = rd(amax / half, dt);
            } else {
                float mn, mx;
                group_minmax(w, dt, base + c0, g, &mn, &mx);
                s = rd(rd(mx - mn, dt) / full, dt);
                float zf = rd(qmin - rd(mn / s, dt), dt);
                if (isnan(zf)) zf = 0.0f;
                z = rintf(clampf(zf, qmin, qmax));
                zp[r * groups + gi] = (int8_t)z;
            }
            if (s == 0.0f) s = eps_of(dt);
            store_d(scale, dt, r * groups + gi, s);
            for (int64_t j = 0; j < g; j++) {
                float v = rd(load(w, dt, base + c0 + j) / s, dt);
                if (!sym) v = rd(v + z, dt);
                qrow[c0 + j] = (int8_t)rintf(clampf(v, qmin, qmax));
            }
        }
        if (pack) {
            int32_t *o = (int32_t *)out + r * words;
            const uint32_t off = 1u << (bits - 1);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            /* little-endian: the int32 words are the bytes in order, each byte two nibbles (4 bits: value 2i in
             * the low nibble) or one value (8 bits); a byte loop vectorizes, the per-word loop below does not */
            if (bits == 4 || bits == 8) {
                uint8_t *ob = (uint8_t *)o;
                int64_t nb;
                if (bits == 8) {
                    for (int64_t j = 0; j < k; j++) ob[j] = (uint8_t)((int32_t)qrow[j] + 128);
                    nb = k;
                } else {
                    const int64_t pairs = k / 2;
                    for (int64_t i = 0; i < pairs; i++)
                        ob[i] = (uint8_t)((((int32_t)qrow[2 * i] + 8) & 15) | ((((int32_t)qrow[2 * i + 1] + 8) & 15) << 4));
                    nb = pairs;
                    if (k & 1) ob[nb++] = (uint8_t)(((int32_t)qrow[k - 1] + 8) & 15);
                }
                memset(ob + nb, 0, (size_t)(words * 4 - nb));
            } else
#endif
            if (bits == 4 || bits == 8) {
                const int per = 32 / bits;
                for (int64_t wi = 0; wi < words; wi++) {
                    uint32_t acc = 0;
                    for (int e = 0; e < per; e++) {
                        int64_t j = wi * per + e;
                        uint32_t u = j < k ? (uint32_t)((int32_t)qrow[j] + (int32_t)off) : 0u;
                        acc |= u << (e * bits);
                    }
                    o[wi] = (int32_t)acc;
                }
            } else {
                memset(o, 0, (size_t)words * 4);
                for (int64_t j = 0; j < k; j++) {
                    uint64_t u = (uint64_t)((int32_t)qrow[j] + (int32_t)off);
                    int64_t bit = j * bits, wi = bit >> 5;
                    int sh = (int)(bit & 31);
                    ((uint32_t *)o)[wi] |= (uint32_t)(u << sh);
                    if (sh + bits > 32) ((uint32_t *)o)[wi + 1] |= (uint32_t)(u >> (32 - sh));
                }
            }
        }
    }
}

/* ---- NVFP4: packed [n, k/2] (even column in the low nibble), scale [n, k/16] E4M3 bytes.
 * Per tile of NV_TILE groups of a row, three loops that each vectorize: the group absmax (on the bit patterns),
 * the scales (elementwise over the groups: the same scalar steps per group as before), the elements
 * (IEEE division by the group's effective scale, even/odd columns coded side by side into one byte). ---- */
#define NV_TILE 256
static inline __attribute__((always_inline)) void ct_nvfp4_impl(const void *w, int dt, int64_t n, int64_t k, float gs, uint8_t *packed, uint8_t *scale) {
    const int64_t groups = k / 16;
    uint32_t amax_b[NV_TILE];
    float eff[NV_TILE];
    uint8_t codes[NV_TILE * 16];
    for (int64_t r = 0; r < n; r++) {
        const int64_t base = r * k;
        for (int64_t g0 = 0; g0 < groups; g0 += NV_TILE) {
            const int64_t ng = groups - g0 < NV_TILE ? groups - g0 : NV_TILE;
            for (int64_t gi = 0; gi < ng; gi++) {
                const int64_t c0 = base + (g0 + gi) * 16;
                uint32_t m = 0;
                for (int j = 0; j < 16; j++) { uint32_t a = absbits(load(w, dt, c0 + j)); m = a > m ? a : m; }
                amax_b[gi] = m;
            }
            uint8_t *srow = scale + r * groups + g0;
            for (int64_t gi = 0; gi < ng; gi++) {
                float t = rd(u2f(amax_b[gi]) / 6.0f, dt);
                uint8_t sb = f32_to_e4m3(clampf(gs * t, -448.0f, 448.0f));
                float s = e4m3_to_f32(sb);
                sb = s == 0.0f ? (uint8_t)0x20 : sb;
                s = s == 0.0f ? 0.125f : s;
                srow[gi] = sb;
                eff[gi] = s / gs;
            }
            for (int64_t gi = 0; gi < ng; gi++) {
                const int64_t c0 = base + (g0 + gi) * 16;
                const float e = eff[gi];
                for (int j = 0; j < 16; j++) codes[gi * 16 + j] = (uint8_t)e2m1_code(clampf(load(w, dt, c0 + j) / e, -6.0f, 6.0f));
            }
            uint8_t *o = packed + ((base + g0 * 16) >> 1);
            for (int64_t i = 0; i < ng * 8; i++) o[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
        }
    }
}

/* ---- MX group scale (docs/compressed-tensors-format.md 6.5, ../mx.py): the power of two of a group
 * absmax on D's bit pattern (E2M1 mantissa rounding), byte = clamp(127 + E - off, 0, 255), scale =
 * D(2^(byte - 127)) with 0 -> 1. Returns 0, or 1 when the power of two overflows D.
 * 2^(e - 127) is built from its bits (e = 0: the fp32 subnormal 2^-127; e <= 252 here, since E <= 127 and
 * off >= 2), and the stored byte is the fp32 exponent field of the scale (127 + ilogb(s); 0 for 2^-127). ---- */
static inline int mx_scale(float amax, int dt, int off, float *s_out, uint8_t *byte_out) {
    int E; /* exponent of the power of two, or INT32_MIN for zero */
    if (dt == DT_BF16) {
        uint32_t b = ((f2u(amax) >> 16) + (1u << 5)) & 0xFF80u;
        if ((b & 0x7F80u) == 0x7F80u) return 1;
        E = (b >> 7) == 0 ? INT32_MIN : (int)(b >> 7) - 127;
    } else if (dt == DT_F16) {
        _Float16 h = (_Float16)amax; uint16_t hb; memcpy(&hb, &h, 2);
        uint32_t b = ((uint32_t)hb + (1u << 8)) & 0xFC00u;
        if ((b & 0x7C00u) == 0x7C00u) return 1;
        E = (b >> 10) == 0 ? INT32_MIN : (int)(b >> 10) - 15;
    } else {
        uint64_t b = ((uint64_t)f2u(amax) + (1u << 21)) & 0xFF800000u;
        if ((b & 0x7F800000u) == 0x7F800000u) return 1;
        E = (b >> 23) == 0 ? INT32_MIN : (int)(b >> 23) - 127;
    }
    int e = E == INT32_MIN ? 0 : E + 127 - off;
    e = e < 0 ? 0 : (e > 255 ? 255 : e);
    float s = rd(e == 0 ? u2f(0x00400000u) : u2f((uint32_t)e << 23), dt);
    if (s == 0.0f) s = 1.0f;
    *s_out = s;
    *byte_out = (uint8_t)(f2u(s) >> 23);
    return 0;
}

/* ---- MXFP4 (fp8 = 0): out = packed [n, k/2] E2M1 codes; MXFP8 (fp8 = 1): out = q [n, k] E4M3 bytes, elements as
 * the FP8 formats round them. scale [n, k/32] E8M0 bytes. Returns 0, or 1 when a group's power-of-two scale
 * overflows D (the caller raises). Called with constant dt and fp8, so each entry point compiles to its own loop.
 * x / s is computed as x * (1 / s): s is a power of two in [2^-127, 2^125], so 1 / s is exact and both are the
 * correctly rounded value of the same real number (the same bits, subnormal results included). ---- */
static inline __attribute__((always_inline)) int ct_mx_impl(const void *w, int dt, int64_t n, int64_t k, uint8_t *out, uint8_t *scale, int fp8) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < n; r++) {
        const int64_t base = r * k;
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t c0 = base + gi * 32;
            uint32_t amax_b = 0;
            for (int j = 0; j < 32; j++) { uint32_t a = absbits(load(w, dt, c0 + j)); amax_b = a > amax_b ? a : amax_b; }
            float s;
            if (mx_scale(u2f(amax_b), dt, fp8 ? 8 : 2, &s, &scale[r * groups + gi])) return 1;
            const float inv = 1.0f / s;
            if (fp8) {
                for (int j = 0; j < 32; j++) {
                    float v = rd(load(w, dt, c0 + j) * inv, dt);
                    out[c0 + j] = f32_to_e4m3(clampf(v, -448.0f, 448.0f));
                }
            } else {
                uint8_t c[32], *o = out + (c0 >> 1);
                for (int j = 0; j < 32; j++) c[j] = (uint8_t)e2m1_code(clampf(rd(load(w, dt, c0 + j) * inv, dt), -6.0f, 6.0f));
                for (int j = 0; j < 16; j++) o[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
            }
        }
    }
    return 0;
}

/* ---- max |x| over count elements, and the number of non-finite ones. ----
 * On the bit patterns: for IEEE floats, |x| is the pattern without its sign bit, and patterns of
 * non-negative non-NaN values are ordered as the values are, so the max |x| is an integer max
 * (signed: the sign bit is clear), and inf/NaN are the patterns >= the one of inf. Integer compares
 * vectorize with plain SSE2, where a float max with NaN rules does not. As before, NaN is left out
 * of the max (inf is not) and both are counted. */
#define ABSMAX_BLOCK 32768 /* elements per int32 count of non-finite ones */
/* absmax16 (bf16/fp16 patterns) and absmax32 (fp32): one loop, written once and instantiated per width so each
 * keeps its own vector loop; inf is D's pattern of infinity. */
#define DEFINE_ABSMAX(NAME, UT, ST, MAG)                                          \
    static inline int64_t NAME(const UT *p, int64_t count, ST inf, ST *max_out) { \
        ST m = 0;                                                                 \
        int64_t bad = 0;                                                          \
        for (int64_t b0 = 0; b0 < count; b0 += ABSMAX_BLOCK) {                    \
            int64_t b1 = b0 + ABSMAX_BLOCK < count ? b0 + ABSMAX_BLOCK : count;   \
            int32_t nb = 0;                                                       \
            for (int64_t i = b0; i < b1; i++) {                                   \
                ST u = (ST)(p[i] & MAG);                                          \
                nb += u >= inf;                                                   \
                u = u > inf ? 0 : u;                                              \
                m = u > m ? u : m;                                                \
            }                                                                     \
            bad += nb;                                                            \
        }                                                                         \
        *max_out = m;                                                             \
        return bad;                                                               \
    }
DEFINE_ABSMAX(absmax16, uint16_t, int16_t, 0x7FFF)
DEFINE_ABSMAX(absmax32, uint32_t, int32_t, 0x7FFFFFFFu)

/* ---- exported entry points: dispatch on the dtype so each body is compiled (and vectorized) per D ---- */
void ct_fp8_channel(const void *w, int dt, int64_t n, int64_t k, uint8_t *q, void *scale) {
    if (dt == DT_BF16) ct_fp8_channel_impl(w, DT_BF16, n, k, q, scale);
    else if (dt == DT_F16) ct_fp8_channel_impl(w, DT_F16, n, k, q, scale);
    else ct_fp8_channel_impl(w, DT_F32, n, k, q, scale);
}

void ct_fp8_block(const void *w, int dt, int64_t n, int64_t k, int64_t bh, int64_t bw, uint8_t *q, void *scale) {
    if (dt == DT_BF16) ct_fp8_block_impl(w, DT_BF16, n, k, bh, bw, q, scale);
    else if (dt == DT_F16) ct_fp8_block_impl(w, DT_F16, n, k, bh, bw, q, scale);
    else ct_fp8_block_impl(w, DT_F32, n, k, bh, bw, q, scale);
}

void ct_nvfp4(const void *w, int dt, int64_t n, int64_t k, float gs, uint8_t *packed, uint8_t *scale) {
    if (dt == DT_BF16) ct_nvfp4_impl(w, DT_BF16, n, k, gs, packed, scale);
    else if (dt == DT_F16) ct_nvfp4_impl(w, DT_F16, n, k, gs, packed, scale);
    else ct_nvfp4_impl(w, DT_F32, n, k, gs, packed, scale);
}

int ct_mxfp4(const void *w, int dt, int64_t n, int64_t k, uint8_t *packed, uint8_t *scale) {
    if (dt == DT_BF16) return ct_mx_impl(w, DT_BF16, n, k, packed, scale, 0);
    else if (dt == DT_F16) return ct_mx_impl(w, DT_F16, n, k, packed, scale, 0);
    else return ct_mx_impl(w, DT_F32, n, k, packed, scale, 0);
}

int ct_mxfp8(const void *w, int dt, int64_t n, int64_t k, uint8_t *q, uint8_t *scale) {
    if (dt == DT_BF16) return ct_mx_impl(w, DT_BF16, n, k, q, scale, 1);
    else if (dt == DT_F16) return ct_mx_impl(w, DT_F16, n, k, q, scale, 1);
    else return ct_mx_impl(w, DT_F32, n, k, q, scale, 1);
}

int64_t ct_absmax(const void *w, int dt, int64_t count, float *amax_out) {
    if (dt == DT_F32) {
        int32_t m;
        int64_t bad = absmax32((const uint32_t *)w, count, 0x7F800000, &m);
        *amax_out = u2f((uint32_t)m);
        return bad;
    }
    int16_t m;
    int64_t bad = absmax16((const uint16_t *)w, count, dt == DT_BF16 ? 0x7F80 : 0x7C00, &m);
    uint16_t bits = (uint16_t)m;
    *amax_out = load(&bits, dt, 0);
    return bad;
}

void ct_int(const void *w, int dt, int64_t n, int64_t k, int64_t g, int bits, int sym, int pack, void *out, void *scale, int8_t *zp, int8_t *tmp) {
    if (dt == DT_BF16) ct_int_impl(w, DT_BF16, n, k, g, bits, sym, pack, out, scale, zp, tmp);
    else if (dt == DT_F16) ct_int_impl(w, DT_F16, n, k, g, bits, sym, pack, out, scale, zp, tmp);
    else ct_int_impl(w, DT_F32, n, k, g, bits, sym, pack, out, scale, zp, tmp);
}
