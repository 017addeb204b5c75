/*
 * megatron-ft: fused copy + checksum, one pass over the bytes at memory speed.
 *
 * Checksum "fl64x4": the buffer is read as little-endian uint64 words, zero-padded to a
 * multiple of 4 words (32 bytes). Word i goes to lane i % 4; every lane keeps a Fletcher pair
 * modulo 2^64:  a += w;  b += a.  The digest folds the eight lane values and the byte length:
 *   v2 (written):  h = 0xcbf29ce484222325;  for v in (a0..a3, b0..b3, nbytes): h = fmix64(h ^ v)
 *                  (MurmurHash3's 64-bit finalizer: every input bit reaches every output bit)
 *   v1 (read):     the same with h = (h ^ v) * 0x100000001b3. A multiply moves a difference only
 *                  towards the high bits, so a flip in the top bits of a lane value could cancel
 *                  against the matching flip of the b lane: about 1 % of single-bit flips went
 *                  unnoticed (benchmarks/checksum.py). v2 notices every single-bit flip.
 * The numpy reference in megatron_ft/capture/checksum.py computes the same values.
 *
 * Loaded with ctypes (no Python API), so calls release the GIL.
 */
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL

static uint64_t fmix64(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static uint64_t fold2(const uint64_t a[4], const uint64_t b[4], uint64_t nbytes) {
    uint64_t h = FNV_OFFSET;
    for (int l = 0; l < 4; l++) h = fmix64(h ^ a[l]);
    for (int l = 0; l < 4; l++) h = fmix64(h ^ b[l]);
    return fmix64(h ^ nbytes);
}

static uint64_t fold(const uint64_t a[4], const uint64_t b[4], uint64_t nbytes) {
    uint64_t h = FNV_OFFSET;
    for (int l = 0; l < 4; l++) { h ^= a[l]; h *= FNV_PRIME; }
    for (int l = 0; l < 4; l++) { h ^= b[l]; h *= FNV_PRIME; }
    h ^= nbytes; h *= FNV_PRIME;
    return h;
}

/* The four lanes live in one 256-bit vector; on CPUs with AVX2 gcc's target_clones picks
 * the AVX2 build at load time (one vector add per 32 bytes keeps up with memcpy). */
typedef uint64_t lanes_t __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MFT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MFT_CLONES
#endif

/* Streaming form, for a chunk assembled from several pieces: the state is the 8 lane values.
 * mft_fl_update copies (dst may be NULL) and adds n bytes; a tail of n % 32 bytes is padded with
 * zeros, which is exact when the bytes that follow in the chunk up to the next 32-byte boundary
 * are zero (alignment padding). mft_fl_zeros adds `groups` all-zero 32-byte groups. */
typedef struct { uint64_t a[4], b[4]; } mft_fl_state; /* plain arrays: no alignment demands on callers */

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define MFT_HAVE_STREAM 1
#else
#define MFT_HAVE_STREAM 0
#endif

/* The loop of both update functions; `stream` (a constant in each caller, so it folds away)
 * selects non-temporal stores for the copy. */
static inline __attribute__((always_inline))
void fl_update(mft_fl_state *st, void *dst, const void *src, uint64_t nbytes, int stream) {
    lanes_t a, b;
    memcpy(&a, st->a, 32);
    memcpy(&b, st->b, 32);
    const unsigned char *s = (const unsigned char *)src;
    unsigned char *d = (unsigned char *)dst;
    uint64_t full = nbytes / 32;
    if (d && stream) {
#if MFT_HAVE_STREAM
        for (uint64_t g = 0; g < full; g++) {
            lanes_t w;
            __m128i lo, hi;
            memcpy(&w, s + 32 * g, 32);
            memcpy(&lo, &w, 16);
            memcpy(&hi, (const unsigned char *)&w + 16, 16);
            _mm_stream_si128((__m128i *)(d + 32 * g), lo);
            _mm_stream_si128((__m128i *)(d + 32 * g + 16), hi);
            a += w; b += a;
        }
        _mm_sfence();
#endif
    } else if (d) {
        for (uint64_t g = 0; g < full; g++) {
            lanes_t w;
            memcpy(&w, s + 32 * g, 32);
            memcpy(d + 32 * g, &w, 32);
            a += w; b += a;
        }
    } else {
        for (uint64_t g = 0; g < full; g++) {
            lanes_t w;
            memcpy(&w, s + 32 * g, 32);
            a += w; b += a;
        }
    }
    uint64_t rest = nbytes - full * 32;
    if (rest) {
        lanes_t w = {0, 0, 0, 0};
        memcpy(&w, s + 32 * full, rest);
        if (d) memcpy(d + 32 * full, s + 32 * full, rest);
        a += w; b += a;
    }
    memcpy(st->a, &a, 32);
    memcpy(st->b, &b, 32);
}

MFT_CLONES
void mft_fl_update(mft_fl_state *st, void *dst, const void *src, uint64_t nbytes) {
    fl_update(st, dst, src, nbytes, 0);
}

/* As mft_fl_update with a destination, but the copy uses non-temporal (streaming) stores: the
 * destination lines are written to memory without first being read into the cache (no
 * read-for-ownership), less memory traffic for a large copy whose destination is not read again
 * soon (a restore into the training state). Needs a 16-byte aligned dst (else, and off x86, the
 * stores are normal ones). The checksum is the same. */
MFT_CLONES
void mft_fl_update_nt(mft_fl_state *st, void *dst, const void *src, uint64_t nbytes) {
    fl_update(st, dst, src, nbytes, MFT_HAVE_STREAM && dst && ((uintptr_t)dst & 15) == 0);
}

void mft_fl_zeros(mft_fl_state *st, uint64_t groups) {
    for (int l = 0; l < 4; l++) st->b[l] += groups * st->a[l];
}

/* the v1 digest (read only) */
uint64_t mft_fl_final(const mft_fl_state *st, uint64_t nbytes) {
    return fold(st->a, st->b, nbytes);
}

/* the v2 digest (written) */
uint64_t mft_fl_final2(const mft_fl_state *st, uint64_t nbytes) {
    return fold2(st->a, st->b, nbytes);
}

/* Copy nbytes from src to dst (dst may be NULL: checksum only) and return the v2 checksum of src. */
uint64_t mft_copy_checksum(void *dst, const void *src, uint64_t nbytes) {
    mft_fl_state st;
    memset(&st, 0, sizeof st);
    mft_fl_update(&st, dst, src, nbytes);
    return mft_fl_final2(&st, nbytes);
}

