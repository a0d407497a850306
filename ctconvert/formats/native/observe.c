/*
 * ctconvert CPU kernel of the MSE weight observers (../observers.py): llm-compressor 0.14.0.1's eager
 * shrink-factor search, one group at a time, every candidate in registers.
 *
 * Each step is the torch reference's (and so upstream's) operation on the same values: an fp32 operation
 * rounded to D (bf16 or fp16) with round-to-nearest-even. Two results of torch's CPU kernels are not
 * reproduced operation for operation: |d| ** norm (torch: SLEEF's powf, within 1 ulp; here bounds from a
 * table of every D value, ct_pow_table) and the fp32 sum of a group's errors (torch: its own summation order). Both are rounded to D afterwards, so this kernel
 * computes them here (libm powf; a double sum) and flags the group as *uncertain* wherever a result lies
 * so close to a rounding boundary of D that another powf within 1 ulp, or another fp32 summation order,
 * could round it differently. Every other group's steps are then exactly torch's; the caller searches the
 * uncertain groups again with the torch reference. fp32 weights (no rounding to hide behind) are not taken.
 *
 * Build: cc -O3 -shared -fPIC, no -ffast-math (IEEE division and rounding are part of the result).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_BF16 = 0, DT_F16 = 1 };
enum { KIND_INT = 0, KIND_FP8 = 1, KIND_FP4 = 2 };

#include "fp_bits.h"

/* fp16 <-> fp32 through F16C where the build has it (GCC's _Float16 casts are library calls without
 * AVX512-FP16); both round to nearest even. */
#if defined(__F16C__)
#include <immintrin.h>
static inline uint16_t f32_to_h(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline float h_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline uint16_t f32_to_h(float x) { _Float16 h = (_Float16)x; uint16_t u; memcpy(&u, &h, 2); return u; }
static inline float h_to_f32(uint16_t u) { _Float16 h; memcpy(&h, &u, 2); return (float)h; }
#endif

static inline float rd(float x, int dt) {
    if (dt == DT_BF16) {
        uint32_t u = f2u(x);
        return u2f(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
    }
    return h_to_f32(f32_to_h(x));
}

static inline float load(const void *p, int dt, int64_t i) {
    if (dt == DT_BF16) return u2f((uint32_t)((const uint16_t *)p)[i] << 16);
    return h_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_d(void *p, int dt, int64_t i, float x) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = (uint16_t)(f2u(rd(x, dt)) >> 16);
    else ((uint16_t *)p)[i] = f32_to_h(x);
}

/* E2M1 magnitude of a >= 0, compressed-tensors' cast_to_fp4 thresholds (anything above 5 is 6). */
static inline float e2m1_level(float a) {
    /* the sum of the steps between levels: 0, .5, 1, 1.5, 2, 3, 4, 6 */
    return 0.5f * (float)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f)) + 1.0f * (float)((a > 2.5f) + (a >= 3.5f)) + 2.0f * (float)(a > 5.0f);
}

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* rd(|d| ** norm) bounds: *lo and *hi are what a powf within 1 ulp of libm's (SLEEF's, torch's) rounds to D. */
static inline void pow_d(float a, float norm, int dt, float *lo, float *hi) {
    if (a == 0.0f) { *lo = *hi = 0.0f; return; }
    float v = powf(a, norm);
    uint32_t u = f2u(v); /* v > 0: the neighbours by bit pattern, 4 ulps each side (2 would do) */
    *lo = rd(u2f(u > 4u ? u - 4u : 0u), dt);
    *hi = rd(u2f(u + 4u), dt);
}

/* The pow_d bounds of every non-negative value of D (|d| is one: 2^15 bit patterns), as floats: lo[i], hi[i]
 * for the D value of bit pattern i. The search looks them up instead of calling powf. */
void ct_pow_table(int dt, float norm, float *lo, float *hi) {
    for (uint32_t i = 0; i < 0x8000u; i++) {
        float a = dt == DT_BF16 ? u2f(i << 16) : h_to_f32((uint16_t)i);
        if (a != a || a == INFINITY) { lo[i] = hi[i] = INFINITY; continue; }
        pow_d(a, norm, dt, &lo[i], &hi[i]);
    }
}

static inline uint32_t d_bits(float x, int dt) { return dt == DT_BF16 ? f2u(x) >> 16 : f32_to_h(x); }

/* The E8M0 candidate scale of compressed-tensors 0.19.0's calculate_qparams for an MX scheme, from the group's
 * absmax a (a D value): round_to_power_2 on D's bits (add half of the E2M1 mantissa step, clear the mantissa),
 * e = clamp(127 + floor(log2 p2) - off, 0, 255) rounded (exact in D), 2^(e - 127) in fp32 rounded to D, 0 -> 1. */
static inline float mx_candidate(float a, int dt, int off) {
    uint32_t b = d_bits(a, dt), mant = dt == DT_BF16 ? 7u : 10u, exp = dt == DT_BF16 ? 8u : 5u;
    uint32_t r = (b + (1u << (mant - 2u))) & ((((1u << (exp + 1u)) - 1u) << mant) & 0xFFFFu);
    float p2 = dt == DT_BF16 ? u2f(r << 16) : h_to_f32((uint16_t)r);
    float e = p2 == 0.0f ? 0.0f : (p2 == INFINITY ? 255.0f : clampf(127.0f + floorf(log2f(p2)) - (float)off, 0.0f, 255.0f));
    float s = rd(ldexpf(1.0f, (int)e - 127), dt);
    return s == 0.0f ? 1.0f : s;
}

/* The candidate scale (returned) and zero point (*zp) of compressed-tensors 0.19.0's calculate_qparams for the
 * candidate range [mn, mx] (D values), every operation rounded to D as torch's on D tensors. */
static inline __attribute__((always_inline)) float candidate_qparams(int mx_off, int sym, float qmin, float qmax, float half, float range, float mn, float mx, int dt,
                                                                     float eps, float *zp) {
    float cmn = mn < 0.0f ? mn : 0.0f, cmx = mx > 0.0f ? mx : 0.0f;
    float scale;
    *zp = 0.0f;
    if (sym) {
        float a = fabsf(cmn) > fabsf(cmx) ? fabsf(cmn) : fabsf(cmx);
        scale = mx_off ? mx_candidate(a, dt, mx_off) : rd(a / half, dt);
    } else {
        scale = rd(rd(cmx - cmn, dt) / range, dt);
        float z = rd(qmin - rd(cmn / scale, dt), dt);
        if (z != z) z = 0.0f; /* 0/0 of an all-zero group: torch's int8 cast gives 0 */
        z = clampf(z, qmin, qmax);
        *zp = nearbyintf(clampf(z, -128.0f, 127.0f));
    }
    return scale == 0.0f ? eps : scale;
}

/* The fake quantization of one element v (int or FP8, D) at scale and zp: divide, add the zero point, clamp,
 * round (RNE, or through E4M3), subtract the zero point, multiply, each rounded to D (FakeQuant.dequantized). */
static inline __attribute__((always_inline)) float fake_q(float v, int kind, int sym, float qmin, float qmax, float scale, float zp, int dt) {
    float t = rd(v / scale, dt);
    if (!sym) t = rd(t + zp, dt);
    t = clampf(t, qmin, qmax);
    float r = kind == KIND_INT ? nearbyintf(t) : e4m3_to_f32(f32_to_e4m3(t));
    if (!sym) r = rd(r - zp, dt);
    return rd(r * scale, dt);
}

/* The FP4 fake quantization of a = |x| (D) at scale: its E2M1 level of a / scale, times scale, in D. */
static inline float fp4_q(float a, float scale, int dt) { return rd(e2m1_level(rd(a / scale, dt)) * scale, dt); }

/* One group's error at one candidate range, as bounds [*lo, *hi] of what torch computes (equal when the
 * kernel is sure): its powf and its fp32 summation order are the only freedoms, see the file comment. */
static inline __attribute__((always_inline)) void group_error(const float *restrict x, int64_t g, int kind, int mx_off, int sym, float qmin, float qmax, float half, float range, float mn, float mx,
                               const float *plo, const float *phi, int dt, float eps, float *lo, float *hi) {
    float zp, scale = candidate_qparams(mx_off, sym, qmin, qmax, half, range, mn, mx, dt, eps, &zp);
    /* two passes: the rounded |q - x| of every element (branch-free, so that it vectorizes), then the table sums */
    uint32_t bits[g > 0 ? g : 1];
    if (kind == KIND_FP4) {
        for (int64_t j = 0; j < g; j++) {
            float a = fabsf(x[j]);
            bits[j] = d_bits(fabsf(rd(fp4_q(a, scale, dt) - a, dt)), dt) & 0x7FFFu;
        }
    } else {
        for (int64_t j = 0; j < g; j++) {
            float v = x[j];
            bits[j] = d_bits(fabsf(rd(fake_q(v, kind, sym, qmin, qmax, scale, zp, dt) - v, dt)), dt) & 0x7FFFu;
        }
    }
    double slo = 0.0, shi = 0.0;
    for (int64_t j = 0; j < g; j++) {
        slo += (double)plo[bits[j]];
        shi += (double)phi[bits[j]];
    }
    /* any fp32 summation order is within (g - 1) * 2^-24 * sum of the exact sum */
    double m = (double)g * 0x1p-23;
    *lo = rd((float)(slo * (1.0 - m)), dt);
    *hi = shi > 1e30 ? INFINITY : rd((float)(shi * (1.0 + m)), dt);
}

/* One group of g elements at w[base..] (D) into x as floats, and its unshrunk range: amin, amax times expand, in D. */
static inline void load_group(const void *w, int dt, int64_t base, int64_t g, float expand, float *restrict x, float *mn0, float *mx0) {
    float amin = INFINITY, amax = -INFINITY;
    for (int64_t j = 0; j < g; j++) {
        x[j] = load(w, dt, base + j);
        amin = x[j] < amin ? x[j] : amin;
        amax = x[j] > amax ? x[j] : amax;
    }
    *mn0 = rd(amin * expand, dt);
    *mx0 = rd(amax * expand, dt);
}

/* A searched group's outputs at index o: its step bs, whether it is uncertain; if sure, its improvements (ORed into
 * improved, as bits into hits) and range. Returns sure. */
static inline int store_group(int64_t o, int16_t bs, int sure, const uint8_t *hit, int64_t steps, const float *p, float mn0, float mx0, int dt, int16_t *best, void *mn_out,
                              void *mx_out, uint8_t *improved, uint8_t *uncertain, int64_t *hits) {
    best[o] = bs;
    uncertain[o] = (uint8_t)!sure;
    if (!sure) return 0;
    int64_t bits = 0;
    for (int64_t i = 0; i < steps; i++) {
        improved[i] |= hit[i];
        if (i < 63 && hit[i]) bits |= (int64_t)1 << i;
    }
    if (hits) hits[o] = bits;
    store_d(mn_out, dt, o, bs < 0 ? mn0 : rd(mn0 * p[bs], dt));
    store_d(mx_out, dt, o, bs < 0 ? mx0 : rd(mx0 * p[bs], dt));
    return 1;
}

/*
 * Rows [0, n) of w (D = dt, [n, k] row-major), groups of g columns. p: the steps' shrink factors (fp32,
 * as torch takes a Python float), steps of them, all run (no early stop); plo/phi: ct_pow_table's; mx_off: 0,
 * or the element offset of an MX scheme's E8M0 candidate scale (2 for FP4, 8 for FP8). Writes per group the best step
 * (int16, -1 = none improved) and the range (D) into best/mn_out/mx_out ([n, k/g]), the steps (< 63) at which
 * it improved as bits into hits (when not NULL), ORs into improved[steps]
 * the steps at which some certain group improved, and sets uncertain[group] = 1 where the kernel cannot
 * vouch for the result (those groups' outputs and improvements are to be recomputed by the caller).
 * Returns the number of uncertain groups.
 */
int64_t ct_mse_search(const void *w, int dt, int64_t n, int64_t k, int64_t g, int kind, int mx_off, int sym, float qmin, float qmax, float half, float range,
                      float expand, const float *p, int64_t steps, const float *plo, const float *phi, float dmax, float eps, int16_t *best, void *mn_out, void *mx_out,
                      uint8_t *improved, uint8_t *uncertain, int64_t *hits) {
    int64_t groups = k / g, bad = 0;
    float x[g > 0 ? g : 1];
    uint8_t hit[steps > 0 ? steps : 1];
    for (int64_t r = 0; r < n; r++) {
        for (int64_t c = 0; c < groups; c++) {
            int64_t base = r * k + c * g, o = r * groups + c;
            float mn0, mx0;
            load_group(w, dt, base, g, expand, x, &mn0, &mx0);
            /* the best error so far as bounds; a step is decided when its bounds and the best's do not overlap */
            float best_lo = dmax, best_hi = dmax;
            int16_t bs = -1;
            int sure = 1;
            for (int64_t i = 0; i < steps; i++) {
                float lo, hi;
                /* constant dtypes and kinds, so that each element loop is compiled (and vectorized) for one case */
                float cmn = rd(mn0 * p[i], dt), cmx = rd(mx0 * p[i], dt);
                if (dt == DT_BF16 && kind == KIND_FP4) group_error(x, g, KIND_FP4, mx_off, 1, qmin, qmax, half, range, cmn, cmx, plo, phi, DT_BF16, eps, &lo, &hi);
                else if (dt == DT_F16 && kind == KIND_FP4) group_error(x, g, KIND_FP4, mx_off, 1, qmin, qmax, half, range, cmn, cmx, plo, phi, DT_F16, eps, &lo, &hi);
                else if (dt == DT_BF16) group_error(x, g, kind, mx_off, sym, qmin, qmax, half, range, cmn, cmx, plo, phi, DT_BF16, eps, &lo, &hi);
                else group_error(x, g, kind, mx_off, sym, qmin, qmax, half, range, cmn, cmx, plo, phi, DT_F16, eps, &lo, &hi);
                if (hi < best_lo) {
                    hit[i] = 1;
                    best_lo = lo;
                    best_hi = hi;
                    bs = (int16_t)i;
                } else {
                    hit[i] = 0;
                    if (lo < best_hi) sure = 0;
                }
                if (!sure) break;
            }
            bad += !store_group(o, bs, sure, hit, steps, p, mn0, mx0, dt, best, mn_out, mx_out, improved, uncertain, hits);
        }
    }
    return bad;
}

/* ---- the imatrix observers (../observers/imatrix.py): the error weighted per input channel, in fp32 ----
 *
 * llm-compressor 0.14.0.1 _grid_search: e = float(q) - float(ref), |e| ** norm, times imp, summed per group in fp32,
 * compared with the best in fp32 (initially finfo(float32).max). Nothing is rounded to D after q, so each fp32
 * operation here is torch's on the same operands (q - ref, |.|, * imp: IEEE, elementwise) except two: |e| ** norm
 * where torch calls SLEEF's powf (within 1 ulp; norm 2 and 3 are exact: torch multiplies, (e * e) * e, and so does
 * this kernel) and the fp32 sum (torch's own order). The kernel keeps bounds of both, [lo, hi] of the sum torch can
 * give, and decides a step only where the bounds do not overlap the best's; a candidate whose |e| are the best's,
 * bit for bit, has torch's error exactly (same terms, same order) and does not improve. Anything else is uncertain:
 * the caller searches the group again with the torch reference. A sum that may reach FLT_MAX (inf, NaN) too. */

/* |e| of every element of one group at one candidate range, fp32 bits into e (FakeQuant.dequantized; FP4 on |x|). */
static inline __attribute__((always_inline)) void imatrix_diffs(const float *restrict x, int64_t g, int kind, int mx_off, int sym, float qmin, float qmax, float half, float range,
                                                                float mn, float mx, int dt, float eps, float *restrict e) {
    float zp, scale = candidate_qparams(mx_off, sym, qmin, qmax, half, range, mn, mx, dt, eps, &zp);
    if (kind == KIND_FP4) {
        for (int64_t j = 0; j < g; j++) {
            float a = fabsf(x[j]);
            e[j] = fabsf(fp4_q(a, scale, dt) - a);
        }
    } else {
        for (int64_t j = 0; j < g; j++) e[j] = fabsf(fake_q(x[j], kind, sym, qmin, qmax, scale, zp, dt) - x[j]);
    }
}

/* Bounds [*lo, *hi] of torch's fp32 sum(|e| ** norm * imp) (imp NULL: unweighted); pmode 2 or 3: norm is that integer
 * (exact products), 0: powf bounds. Returns 1 where a bound is not below FLT_MAX / 2 (the caller cannot vouch). */
static inline __attribute__((always_inline)) int imatrix_bounds(const float *restrict e, int64_t g, const float *restrict imp, int pmode, float norm, double *lo, double *hi) {
    double slo = 0.0, shi = 0.0;
    if (pmode) {
        for (int64_t j = 0; j < g; j++) {
            float t = pmode == 3 ? e[j] * e[j] * e[j] : e[j] * e[j];
            if (imp) t = t * imp[j];
            slo += (double)t;
        }
        shi = slo;
    } else {
        for (int64_t j = 0; j < g; j++) {
            float tlo = 0.0f, thi = 0.0f;
            if (e[j] != 0.0f) { /* SLEEF's powf within 1 ulp of libm's: 4 ulps each side */
                uint32_t u = f2u(powf(e[j], norm));
                tlo = u2f(u > 4u ? u - 4u : 0u);
                thi = u2f(u + 4u);
            }
            if (imp) { tlo = tlo * imp[j]; thi = thi * imp[j]; }
            slo += (double)tlo;
            shi += (double)thi;
        }
    }
    if (!(shi < 0x1p126)) return 1;
    double m = (double)g * 0x1p-23; /* any fp32 summation order is within (g - 1) * 2^-24 * sum of the exact sum */
    *lo = slo * (1.0 - m);
    *hi = shi * (1.0 + m);
    return 0;
}

/* One group's search (ct_imatrix_search). Returns 1 (sure) with *best_step and hit[] set, or 0 (uncertain). */
static int imatrix_group(const float *restrict x, int64_t g, int kind, int mx_off, int sym, float qmin, float qmax, float half, float range, float mn0, float mx0,
                         const float *p, int64_t steps, const float *imp, int pmode, float norm, int dt, float eps, int16_t *best_step, uint8_t *hit) {
    float cur[g > 0 ? g : 1], best[g > 0 ? g : 1];
    double best_lo = 0x1.fffffep127, best_hi = best_lo; /* finfo(float32).max */
    int have = 0;
    *best_step = -1;
    for (int64_t i = 0; i < steps; i++) {
        double lo, hi;
        float cmn = rd(mn0 * p[i], dt), cmx = rd(mx0 * p[i], dt);
        if (dt == DT_BF16 && kind == KIND_FP4) imatrix_diffs(x, g, KIND_FP4, mx_off, 1, qmin, qmax, half, range, cmn, cmx, DT_BF16, eps, cur);
        else if (dt == DT_F16 && kind == KIND_FP4) imatrix_diffs(x, g, KIND_FP4, mx_off, 1, qmin, qmax, half, range, cmn, cmx, DT_F16, eps, cur);
        else if (dt == DT_BF16) imatrix_diffs(x, g, kind, mx_off, sym, qmin, qmax, half, range, cmn, cmx, DT_BF16, eps, cur);
        else imatrix_diffs(x, g, kind, mx_off, sym, qmin, qmax, half, range, cmn, cmx, DT_F16, eps, cur);
        hit[i] = 0;
        if (have && memcmp(cur, best, (size_t)g * sizeof(float)) == 0) continue; /* the best's terms: equal, not better */
        if (pmode == 3 ? imatrix_bounds(cur, g, imp, 3, norm, &lo, &hi) : pmode == 2 ? imatrix_bounds(cur, g, imp, 2, norm, &lo, &hi) : imatrix_bounds(cur, g, imp, 0, norm, &lo, &hi))
            return 0;
        if (hi < best_lo) {
            hit[i] = 1;
            best_lo = lo;
            best_hi = hi;
            *best_step = (int16_t)i;
            memcpy(best, cur, (size_t)g * sizeof(float));
            have = 1;
        } else if (lo < best_hi) {
            return 0;
        }
    }
    return 1;
}

/*
 * The imatrix search of rows [0, n) of w (D = dt, [n, k] row-major), groups of g columns: ct_mse_search's arguments
 * and outputs (best step, range, improved, uncertain, hits), but imp: the importance (fp32 [k], NULL: unweighted),
 * pmode: 3 or 2 where the norm is that integer, else 0 (norm: the exponent as fp32, torch's pow of an fp32 tensor).
 * Returns the number of uncertain groups.
 */
int64_t ct_imatrix_search(const void *w, int dt, int64_t n, int64_t k, int64_t g, int kind, int mx_off, int sym, float qmin, float qmax, float half, float range,
                          float expand, const float *p, int64_t steps, const float *imp, int pmode, float norm, float eps, int16_t *best, void *mn_out, void *mx_out,
                          uint8_t *improved, uint8_t *uncertain, int64_t *hits) {
    int64_t groups = k / g, uncertain_groups = 0;
    float x[g > 0 ? g : 1], mn0, mx0;
    uint8_t hit[steps > 0 ? steps : 1];
    for (int64_t o = 0; o < n * groups; o++) { /* group o: row o / groups, columns from (o % groups) * g */
        int64_t col = (o % groups) * g;
        int16_t bs;
        load_group(w, dt, (o / groups) * k + col, g, expand, x, &mn0, &mx0);
        int sure = imatrix_group(x, g, kind, mx_off, sym, qmin, qmax, half, range, mn0, mx0, p, steps, imp ? imp + col : NULL, pmode, norm, dt, eps, &bs, hit);
        uncertain_groups += !store_group(o, bs, sure, hit, steps, p, mn0, mx0, dt, best, mn_out, mx_out, improved, uncertain, hits);
    }
    return uncertain_groups;
}
