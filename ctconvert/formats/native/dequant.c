/*
 * ctconvert CPU kernel: dequantization of stored codes back to a dense weight, row by row.
 *
 * out[r, c] = OD(D((value(code[r, c]) - zp[r, c]) * sf[r, c]))
 *
 * value():  a 256-entry fp32 table indexed by the code's byte (one code per byte: int8, E4M3,
 *           8-bit values of an int32 word), or a 16-entry table indexed by a nibble (two codes
 *           per byte, element 2j in the low nibble: 4-bit values of an int32 word, E2M1). The
 *           tables are built by the caller with torch's own conversions, so value() is torch's.
 * sf, zp:   fp32 factors; column c of row r uses element (r / rdiv) * stride + c / g (a per-tensor
 *           factor has stride 0; per channel g >= k; per group g = group size; per block
 *           rdiv x g = the block). zp may be NULL (nothing subtracted).
 * D:        the dtype compressed-tensors' decompress returns (the scale's dtype; bf16 for FP4 and
 *           MX), OD the dtype asked for (torch's .to(OD) of the D result); each rounding is RNE.
 *
 * The arithmetic is the torch reference's (../base.py dequantize_unpacked, ../fp4.py, ../fp8.py),
 * operation for operation in fp32: a subtraction, a multiplication (no FMA: -ffp-contract=off),
 * then the roundings. A NaN product is not stored faithfully (torch's NaN bit patterns differ
 * between its scalar and vector paths): the count of NaN products is returned and the caller
 * recomputes such a chunk with torch.
 *
 * Build: cc -O3 -shared -fPIC (no -ffast-math). Called through ctypes, which releases the GIL,
 * so Python threads run disjoint row ranges in parallel.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define CT_AVX2 1
#endif

enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };
enum { TILE = 256 };

#include "fp_bits.h"

/* RNE to bf16 (finite values and infinities; NaN products are counted, not stored). */
static inline uint16_t f32_to_bf16_bits(float x) {
    uint32_t u = f2u(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Round an fp32 value to D and back. */
static inline float rd(float x, int dt) {
    if (dt == DT_BF16) return u2f((uint32_t)f32_to_bf16_bits(x) << 16);
    if (dt == DT_F16) return (float)(_Float16)x;
    return x;
}

/* Store x (an fp32 value) as OD, RNE. */
static inline void store(void *p, int od, int64_t i, float x) {
    if (od == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16_bits(x);
    else if (od == DT_F16) ((_Float16 *)p)[i] = (_Float16)x;
    else ((float *)p)[i] = x;
}

#ifdef CT_AVX2
/* 8 columns [c, c + 8) of one row at a time: the same operations in 8 fp32 lanes (the F16C conversions round
 * to nearest even, as the scalar (_Float16) casts do). Returns a nonzero mask where a product is NaN. */
static inline __attribute__((always_inline)) int seg8(const uint8_t *row, const int nib, int64_t c, const float *lut, __m256 lut_lo, __m256 lut_hi,
                                                      int has_zp, __m256 z, __m256 s, const int mid, const int od, void *out, int64_t o) {
    __m256 v;
    if (!nib) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + c)));
        v = _mm256_i32gather_ps(lut, idx, 4);
    } else {
        uint32_t w;
        memcpy(&w, row + (c >> 1), 4);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
        __m256 lo = _mm256_permutevar8x32_ps(lut_lo, idx), hi = _mm256_permutevar8x32_ps(lut_hi, idx);
        v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
    if (has_zp) v = _mm256_sub_ps(v, z);
    v = _mm256_mul_ps(v, s);
    int bad = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i bits = _mm256_setzero_si256();
    if (mid == DT_BF16) {
        __m256i u = _mm256_castps_si256(v);
        bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
        v = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    } else if (mid == DT_F16) {
        v = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    if (od == DT_BF16) {
        if (mid != DT_BF16) {
            __m256i u = _mm256_castps_si256(v);
            bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
        }
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)out + o), _mm256_castsi256_si128(p));
    } else if (od == DT_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + o), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm256_storeu_ps((float *)out + o, v);
    }
    return bad;
}
#endif

static inline __attribute__((always_inline)) int64_t dequant_impl(const uint8_t *src, const int nib, int64_t r0, int64_t r1, int64_t k, int64_t src_stride,
                                                                   const float *lut, const float *sf, const float *zp, int64_t stride, int64_t rdiv, int64_t g,
                                                                   const int mid, const int od, void *out) {
    float buf[TILE];
    int64_t nan = 0;
#ifdef CT_AVX2
    const __m256 lut_lo = nib ? _mm256_loadu_ps(lut) : _mm256_setzero_ps(), lut_hi = nib ? _mm256_loadu_ps(lut + 8) : _mm256_setzero_ps();
#endif
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = src + r * src_stride;
        const float *srow = sf + (r / rdiv) * stride;
        const float *zrow = zp ? zp + (r / rdiv) * stride : 0;
        for (int64_t c0 = 0; c0 < k;) {
            const int64_t gi = c0 / g;
            int64_t c1 = (gi + 1) * g;
            if (c1 > k) c1 = k;
            if (c1 > c0 + TILE) c1 = c0 + TILE;
            int64_t len = c1 - c0;
#ifdef CT_AVX2
            if (len >= 8 && (!nib || !(c0 & 1))) {  /* runs of 8 columns on the vector path, the rest below */
                const __m256 z = _mm256_set1_ps(zrow ? zrow[gi] : 0.0f), s = _mm256_set1_ps(srow[gi]);
                int bad = 0;
                const int64_t c8 = c0 + (len & ~(int64_t)7);
                for (int64_t c = c0; c < c8; c += 8) bad |= seg8(row, nib, c, lut, lut_lo, lut_hi, zrow != 0, z, s, mid, od, out, r * k + c);
                nan += bad != 0;
                c0 = c8;
                len = c1 - c0;
                if (!len) continue;
            }
#endif
            if (!nib) {
                for (int64_t j = 0; j < len; j++) buf[j] = lut[row[c0 + j]];
            } else if (!(c0 & 1) && !(len & 1)) {
                const uint8_t *b = row + (c0 >> 1);
                for (int64_t j = 0; j < len / 2; j++) {
                    buf[2 * j] = lut[b[j] & 15];
                    buf[2 * j + 1] = lut[b[j] >> 4];
                }
            } else {
                for (int64_t j = 0; j < len; j++) {
                    const int64_t c = c0 + j;
                    const uint8_t b = row[c >> 1];
                    buf[j] = lut[(c & 1) ? (b >> 4) : (b & 15)];
                }
            }
            if (zrow) {
                const float z = zrow[gi];
                for (int64_t j = 0; j < len; j++) buf[j] = buf[j] - z;
            }
            const float s = srow[gi];
            for (int64_t j = 0; j < len; j++) buf[j] = buf[j] * s;
            for (int64_t j = 0; j < len; j++) nan += buf[j] != buf[j];
            const int64_t o = r * k + c0;
            for (int64_t j = 0; j < len; j++) store(out, od, o + j, rd(buf[j], mid));
            c0 = c1;
        }
    }
    return nan;
}

#define CASE(NIB, MID, OD) \
    if (nib == NIB && mid == MID && od == OD) return dequant_impl(src, NIB, r0, r1, k, src_stride, lut, sf, zp, stride, rdiv, g, MID, OD, out);

/* Rows [r0, r1) of the chunk; every pointer is the chunk's start. Returns the number of NaN products
 * (0: every output was stored), or -1 for an unknown dtype code. */
int64_t ct_dequant(const uint8_t *src, int nib, int64_t r0, int64_t r1, int64_t k, int64_t src_stride, const float *lut, const float *sf, const float *zp,
                   int64_t stride, int64_t rdiv, int64_t g, int mid, int od, void *out) {
    CASE(0, DT_BF16, DT_BF16) CASE(0, DT_BF16, DT_F16) CASE(0, DT_BF16, DT_F32)
    CASE(0, DT_F16, DT_BF16) CASE(0, DT_F16, DT_F16) CASE(0, DT_F16, DT_F32)
    CASE(0, DT_F32, DT_BF16) CASE(0, DT_F32, DT_F16) CASE(0, DT_F32, DT_F32)
    CASE(1, DT_BF16, DT_BF16) CASE(1, DT_BF16, DT_F16) CASE(1, DT_BF16, DT_F32)
    CASE(1, DT_F16, DT_BF16) CASE(1, DT_F16, DT_F16) CASE(1, DT_F16, DT_F32)
    CASE(1, DT_F32, DT_BF16) CASE(1, DT_F32, DT_F16) CASE(1, DT_F32, DT_F32)
    return -1;
}
