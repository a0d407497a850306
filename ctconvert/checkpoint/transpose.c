/* Transposing gather of a strided 2-D source on the CPU (ctconvert/checkpoint/transpose.py):
 * dst[n][r] = src[r * s0 + n * s1] for output rows n in [n0, n1) and every r in [0, rows), dst rows contiguous.
 * Copied in TILE x TILE tiles so that a tile's source lines stay in cache while they are scattered; the bytes are
 * moved, never converted (any element of 1, 2, 4 or 8 bytes). */
#include <stdint.h>
#include <string.h>

#define TILE 16

/* A tile is first read row by row (source lines in order) into a small buffer, then written column by column:
 * neither side walks the source or the destination at a large power-of-two stride, which maps every line of a
 * tile to one cache set (a down_proj region's rows are 4 KB apart). */
#define GATHER(T)                                                                                         \
    static void gather_##T(const T *src, int64_t s0, int64_t s1, int64_t rows, int64_t n0, int64_t n1,   \
                           T *dst) {                                                                      \
        T buf[TILE][TILE];                                                                                \
        for (int64_t nb = n0; nb < n1; nb += TILE) {                                                      \
            int64_t nn = nb + TILE < n1 ? TILE : n1 - nb;                                                 \
            for (int64_t rb = 0; rb < rows; rb += TILE) {                                                 \
                int64_t rr = rb + TILE < rows ? TILE : rows - rb;                                         \
                for (int64_t i = 0; i < rr; i++) {                                                        \
                    const T *s = src + (rb + i) * s0 + nb * s1;                                           \
                    for (int64_t j = 0; j < nn; j++) buf[j][i] = s[j * s1];                               \
                }                                                                                         \
                for (int64_t j = 0; j < nn; j++) memcpy(dst + (nb + j) * rows + rb, buf[j], rr * sizeof(T)); \
            }                                                                                             \
        }                                                                                                 \
    }

GATHER(uint8_t)
GATHER(uint16_t)
GATHER(uint32_t)
GATHER(uint64_t)

/* es: the element size in bytes; strides s0, s1 in elements. Returns 0, or -1 for an element size it does not move. */
int ct_gather_t(const void *src, int64_t s0, int64_t s1, int64_t rows, int64_t n0, int64_t n1, int es, void *dst) {
    switch (es) {
    case 1: gather_uint8_t((const uint8_t *)src, s0, s1, rows, n0, n1, (uint8_t *)dst); return 0;
    case 2: gather_uint16_t((const uint16_t *)src, s0, s1, rows, n0, n1, (uint16_t *)dst); return 0;
    case 4: gather_uint32_t((const uint32_t *)src, s0, s1, rows, n0, n1, (uint32_t *)dst); return 0;
    case 8: gather_uint64_t((const uint64_t *)src, s0, s1, rows, n0, n1, (uint64_t *)dst); return 0;
    default: return -1;
    }
}
