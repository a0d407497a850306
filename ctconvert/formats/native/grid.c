/*
 * ctconvert CPU kernel: are stored codes the format's nearest values to a reference over their own scale? (verify)
 *
 * For each element (r, c) of rows [r0, r1):
 *     q = want[r, c] / sf[r, c]            (fp32; the reference over the element's factor)
 *     x = q + zp[r, c]                     (zp may be NULL)
 *     judged when sf != 0 and x is finite
 *     accepted when lower[code] - t <= x <= upper[code] + t,  t = tie * max(|q|, |x|)
 * where code is the stored code (one per byte, or two per byte as nibbles, element 2j low) and lower/upper are the
 * code's rounding interval (midpoints to its grid neighbours; -inf/+inf at the grid's ends; an empty interval for a
 * code that is not a finite value), built by the caller (../../checkpoint/grid.py) in fp32. sf/zp are placed as in
 * dequant.c: element (r / rdiv) * stride + c / g.
 *
 * Returns the number of judged values off the grid; adds the judged count to *judged and, when the range holds an
 * off-grid value, writes the first one's flat index r * k + c to *first (else leaves it). Rows of `want` are k apart.
 *
 * Build: cc -O3 -shared -fPIC (no -ffast-math: the comparisons are IEEE's). Called through ctypes, which releases the
 * GIL, so Python threads run disjoint row ranges in parallel.
 */
#include <math.h>
#include <stdint.h>

int64_t ct_grid_check(const uint8_t *src, int nib, int64_t r0, int64_t r1, int64_t k, int64_t src_stride, const float *want, const float *lower,
                      const float *upper, const float *sf, const float *zp, int64_t stride, int64_t rdiv, int64_t g, float tie, int64_t *judged,
                      int64_t *first) {
    int64_t off = 0, seen = 0, at = -1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = src + r * src_stride;
        const float *w = want + r * k;
        const float *srow = sf + (r / rdiv) * stride;
        const float *zrow = zp ? zp + (r / rdiv) * stride : 0;
        for (int64_t c0 = 0; c0 < k;) {
            const int64_t gi = c0 / g;
            int64_t c1 = (gi + 1) * g;
            if (c1 > k) c1 = k;
            const float s = srow[gi], z = zrow ? zrow[gi] : 0.0f;
            if (s != 0.0f) {
                int64_t bad = 0, n = 0, where = -1;
                for (int64_t c = c0; c < c1; c++) {
                    const uint8_t code = nib ? ((c & 1) ? (row[c >> 1] >> 4) : (row[c >> 1] & 15)) : row[c];
                    const float q = w[c] / s, x = q + z;
                    const int ok = isfinite(x);
                    const float aq = fabsf(q), ax = fabsf(x);
                    const float t = tie * (aq > ax ? aq : ax);
                    const int out = ok && (x < lower[code] - t || x > upper[code] + t);
                    n += ok;
                    if (out && where < 0) where = c;
                    bad += out;
                }
                seen += n;
                if (bad && at < 0) at = r * k + where;
                off += bad;
            }
            c0 = c1;
        }
    }
    *judged += seen;
    if (at >= 0) *first = at;
    return off;
}
