/* One writer's item of a shard in a single call (ctconvert/checkpoint/native_write.py): the XXH3-128 digests of the
 * whole small tensors it holds, then every run of pieces that lie back to back in the file, one pwritev a run (at
 * most IOV_MAX buffers a call; a short write goes on from where it stopped). Called through ctypes, which lets the
 * GIL go once for the whole item instead of once per piece and per run.
 *
 * The hash function is the XXH3_128bits of the xxhash library the Python package ``xxhash`` is built with (its
 * extension module exports it; xxHash 0.8 API, xxhash.h: XXH128_hash_t XXH3_128bits(const void*, size_t)), passed in
 * as a pointer: this file computes no hash of its own. Digests are written in XXH128's canonical form (xxhash.h
 * XXH128_canonicalFromHash: high64 then low64, each big-endian), which is what ``xxhash.xxh3_128().digest()`` gives. */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    uint64_t low64, high64;
} ct_h128;
typedef ct_h128 (*ct_xxh3_128_fn)(const void *data, size_t len);

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

/* One pwritev of the run's buffers from cur (at most IOV_MAX; with cap > 0 at most cap bytes, the first buffer cut to
 * cap where it is longer: a short write, which the tests force this way). */
static ssize_t write_some(int fd, struct iovec *cur, int left, off_t off, int64_t cap) {
    int n = left < IOV_MAX ? left : IOV_MAX;
    if (cap <= 0)
        return pwritev(fd, cur, n, off);
    size_t sum = 0;
    int k = 0;
    while (k < n && sum + cur[k].iov_len <= (size_t)cap) {
        sum += cur[k].iov_len;
        k++;
    }
    if (k > 0)
        return pwritev(fd, cur, k, off);
    size_t keep = cur->iov_len;
    cur->iov_len = (size_t)cap;
    ssize_t w = pwritev(fd, cur, 1, off);
    cur->iov_len = keep;
    return w;
}

/* hptr/hlen: n_hash buffers to hash, each digest (16 bytes) into digests[16 i]. offsets/counts: n_runs runs, run r
 * writing counts[r] consecutive entries of iov at file offset offsets[r] (iov is modified by short writes).
 * cap: 0, or at most this many bytes a pwritev (tests). Returns 0, or -errno of the failed run with its index in
 * *failed (-EIO where pwritev wrote nothing). */
int ct_write_item(int fd, ct_xxh3_128_fn hash, int n_hash, const uint64_t *hptr, const uint64_t *hlen, unsigned char *digests,
                  int n_runs, const int64_t *offsets, const int32_t *counts, struct iovec *iov, int32_t *failed, int64_t cap) {
    for (int i = 0; i < n_hash; i++) {
        ct_h128 h = hash((const void *)(uintptr_t)hptr[i], (size_t)hlen[i]);
        put_be64(digests + 16 * (size_t)i, h.high64);
        put_be64(digests + 16 * (size_t)i + 8, h.low64);
    }
    struct iovec *run = iov;
    for (int r = 0; r < n_runs; r++) {
        struct iovec *cur = run;
        int left = counts[r];
        off_t off = (off_t)offsets[r];
        while (left > 0 && cur->iov_len == 0) {
            cur++;
            left--;
        }
        while (left > 0) {
            ssize_t w = write_some(fd, cur, left, off, cap);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                *failed = r;
                return w < 0 ? -errno : -EIO;
            }
            off += w;
            while (left > 0 && (size_t)w >= cur->iov_len) { /* buffers written whole */
                w -= (ssize_t)cur->iov_len;
                cur++;
                left--;
            }
            if (left > 0 && w > 0) { /* a buffer written in part: the rest from where it stopped */
                cur->iov_base = (char *)cur->iov_base + w;
                cur->iov_len -= (size_t)w;
            }
            while (left > 0 && cur->iov_len == 0) {
                cur++;
                left--;
            }
        }
        run += counts[r];
    }
    return 0;
}
