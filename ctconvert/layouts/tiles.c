/* Marlin weight tiles on the CPU (docs/kernel-layouts.md §3.1, §3.4): the same bit moves as the
 * Triton kernel in gpu.py. Source: int32 words W[n, kw] (compressed-tensors weight_packed,
 * or a GPTQ tensor through its strides), pack factor 32/bits along K, low bits first;
 * words past N or KW read as zero (vLLM's tile padding). Output: int32 [KT, NT*T],
 * T = 1024/pf words per 16x64 tile, k-tile-major; this call fills k-tiles [kt0, kt1). */
#include <stdint.h>

static inline uint32_t word4(uint32_t xa, uint32_t xb, uint32_t ya, uint32_t yb) {
    /* nibbles a0 a2 b0 b2 a1 a3 b1 b3: low/high nibble of a byte = rows 2i / 2i+1 */
    return (xa & 15) | ((xb & 15) << 4) | ((ya & 15) << 8) | ((yb & 15) << 12)
         | ((xa >> 4) << 16) | ((xb >> 4) << 20) | ((ya >> 4) << 24) | ((yb >> 4) << 28);
}

static inline uint32_t word8(uint32_t lo, uint32_t hi, int sh) {
    /* bytes a0 a2 a1 a3: rows 2i, 2i+8, 2i+1, 2i+9 of one column */
    uint32_t a = (lo >> sh) & 0xFFFF, c = (hi >> sh) & 0xFFFF;
    return (a & 0xFF) | ((c & 0xFF) << 8) | ((a >> 8) << 16) | ((c >> 8) << 24);
}

void ct_marlin_tiles(const int32_t *w, int64_t n_rows, int64_t kw_len, int64_t s_n, int64_t s_k, int bits,
                     int64_t kt0, int64_t kt1, int64_t nt_len, int32_t *out) {
    const int wpt = bits / 2;              /* source words per k-tile and column */
    const int64_t t = 1024 / (32 / bits);  /* words per tile */
    const int64_t o_k = nt_len * t;
    for (int64_t kt = kt0; kt < kt1; kt++) {
        for (int64_t nt = 0; nt < nt_len; nt++) {
            uint32_t *o = (uint32_t *)out + kt * o_k + nt * t;
            for (int i = 0; i < 8; i++) {
                for (int warp = 0; warp < 4; warp++) {
                    int64_t n0 = nt * 64 + 16 * warp + i, n1 = n0 + 8;
                    uint32_t x[4] = {0, 0, 0, 0}, y[4] = {0, 0, 0, 0};
                    for (int j = 0; j < wpt; j++) {
                        int64_t kw = kt * wpt + j;
                        if (kw < kw_len) {
                            if (n0 < n_rows) x[j] = (uint32_t)w[n0 * s_n + kw * s_k];
                            if (n1 < n_rows) y[j] = (uint32_t)w[n1 * s_n + kw * s_k];
                        }
                    }
                    if (bits == 4) {
                        for (int b = 0; b < 4; b++) {
                            int sh = 8 * b;
                            o[16 * i + 4 * b + warp] = word4((x[0] >> sh) & 0xFF, (x[1] >> sh) & 0xFF,
                                                             (y[0] >> sh) & 0xFF, (y[1] >> sh) & 0xFF);
                        }
                    } else {
                        uint32_t *q = o + 32 * i + 2 * warp;
                        q[0] = word8(x[0], x[2], 0);  q[8] = word8(x[0], x[2], 16);
                        q[16] = word8(x[1], x[3], 0); q[24] = word8(x[1], x[3], 16);
                        q[1] = word8(y[0], y[2], 0);  q[9] = word8(y[0], y[2], 16);
                        q[17] = word8(y[1], y[3], 0); q[25] = word8(y[1], y[3], 16);
                    }
                }
            }
        }
    }
}
