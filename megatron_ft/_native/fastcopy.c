/*
 * megatron-ft: fused copy + checksum, one pass over the bytes at memory speed.
 *
 * Checksum "fl32x8-v1" (written): the buffer is read as little-endian uint32 words, zero-padded
 * to a multiple of 8 words (32 bytes). Word i goes to lane i % 8; every lane keeps a Fletcher pair
 * of 64-bit sums:  a += w;  b += a.  A lane's a cannot wrap within a chunk (fewer than 2^32 rows),
 * so no difference is lost mod 2^64: every 1- and 2-bit error and every swap of two different
 * words changes (a, b). Digest: h = 0xcbf29ce484222325; for v in (a0..a7, b0..b7, nbytes):
 * h = fmix64(h ^ v) (MurmurHash3's finalizer).
 *
 * Checksum "fl64x4": the buffer is read as little-endian uint64 words, zero-padded to a
 * multiple of 4 words (32 bytes). Word i goes to lane i % 4; every lane keeps a Fletcher pair
 * modulo 2^64:  a += w;  b += a.  The digest folds the eight lane values and the byte length:
 *   v2 (format 2): h = 0xcbf29ce484222325;  for v in (a0..a3, b0..b3, nbytes): h = fmix64(h ^ v)
 *                  (MurmurHash3's 64-bit finalizer: every input bit reaches every output bit)
 *   v1 (read):     the same with h = (h ^ v) * 0x100000001b3. A multiply moves a difference only
 *                  towards the high bits, so a flip in the top bits of a lane value could cancel
 *                  against the matching flip of the b lane: about 1 % of single-bit flips went
 *                  unnoticed (benchmarks/checksum.py). v2 notices every single-bit flip.
 * The numpy reference in megatron_ft/capture/checksum.py computes the same values.
 *
 * A restore's chunk (mft_f8_restore_chunk) is copied, summed and, per floating-point piece,
 * screened for NaN and infinities in the same pass: the value guard need not read it again.
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

/* ---- fl32x8-v1 (written) ---- */
typedef struct { uint64_t a[8], b[8]; } mft_f8_state;
typedef uint32_t half_t __attribute__((vector_size(16)));

/* `screen` (a constant in each caller): also OR (w & mask) + low into *bad for every 64-bit word w of
 * src, where mask holds the exponent bits of each floating-point element of the word and low the
 * lowest of them (see mft_f8_restore_chunk): an element with every exponent bit set (NaN or an
 * infinity) carries into its sign bit, which mask and low leave clear otherwise. */
static inline __attribute__((always_inline))
void f8_update(mft_f8_state *st, void *dst, const void *src, uint64_t nbytes, int stream,
               int screen, uint64_t mask, uint64_t *bad) {
    lanes_t a0, a1, b0, b1;
    lanes_t em = {mask, mask, mask, mask};
    uint64_t low1 = mask & ~(mask << 1);
    lanes_t el = {low1, low1, low1, low1};
    lanes_t ex = {0, 0, 0, 0};
    memcpy(&a0, st->a, 32); memcpy(&a1, st->a + 4, 32);
    memcpy(&b0, st->b, 32); memcpy(&b1, st->b + 4, 32);
    const unsigned char *s = (const unsigned char *)src;
    unsigned char *d = (unsigned char *)dst;
    uint64_t full = nbytes / 32;
    for (uint64_t g = 0; g < full; g++) {
        half_t lo, hi;
        memcpy(&lo, s + 32 * g, 16);
        memcpy(&hi, s + 32 * g + 16, 16);
        if (d) {
#if MFT_HAVE_STREAM
            if (stream) {
                __m128i l, h;
                memcpy(&l, &lo, 16); memcpy(&h, &hi, 16);
                _mm_stream_si128((__m128i *)(d + 32 * g), l);
                _mm_stream_si128((__m128i *)(d + 32 * g + 16), h);
            } else
#endif
            { memcpy(d + 32 * g, &lo, 16); memcpy(d + 32 * g + 16, &hi, 16); }
        }
        if (screen) {
            lanes_t w;
            memcpy(&w, s + 32 * g, 32);
            ex |= (w & em) + el;
        }
        a0 += __builtin_convertvector(lo, lanes_t); a1 += __builtin_convertvector(hi, lanes_t);
        b0 += a0; b1 += a1;
    }
#if MFT_HAVE_STREAM
    if (d && stream) _mm_sfence();
#endif
    uint64_t rest = nbytes - full * 32;
    if (rest) {
        uint32_t tail[8] = {0};
        memcpy(tail, s + 32 * full, rest);
        if (d) memcpy(d + 32 * full, s + 32 * full, rest);
        half_t lo, hi;
        memcpy(&lo, tail, 16); memcpy(&hi, tail + 4, 16);
        if (screen) {  /* the zero padding is finite */
            lanes_t w;
            memcpy(&w, tail, 32);
            ex |= (w & em) + el;
        }
        a0 += __builtin_convertvector(lo, lanes_t); a1 += __builtin_convertvector(hi, lanes_t);
        b0 += a0; b1 += a1;
    }
    if (screen) *bad |= (ex[0] | ex[1] | ex[2] | ex[3]) & (mask + low1);
    memcpy(st->a, &a0, 32); memcpy(st->a + 4, &a1, 32);
    memcpy(st->b, &b0, 32); memcpy(st->b + 4, &b1, 32);
}

MFT_CLONES
void mft_f8_update(mft_f8_state *st, void *dst, const void *src, uint64_t nbytes) {
    f8_update(st, dst, src, nbytes, 0, 0, 0, 0);
}

/* non-temporal stores for the copy (a 16-byte aligned dst; else normal stores), as mft_fl_update_nt */
MFT_CLONES
void mft_f8_update_nt(mft_f8_state *st, void *dst, const void *src, uint64_t nbytes) {
    f8_update(st, dst, src, nbytes, MFT_HAVE_STREAM && dst && ((uintptr_t)dst & 15) == 0, 0, 0, 0);
}

void mft_f8_zeros(mft_f8_state *st, uint64_t groups) {
    for (int l = 0; l < 8; l++) st->b[l] += groups * st->a[l];
}

uint64_t mft_f8_final(const mft_f8_state *st, uint64_t nbytes) {
    uint64_t h = FNV_OFFSET;
    for (int l = 0; l < 8; l++) h = fmix64(h ^ st->a[l]);
    for (int l = 0; l < 8; l++) h = fmix64(h ^ st->b[l]);
    return fmix64(h ^ nbytes);
}

/* One chunk of a restore, in one call: piece i (n_pieces, in chunk order) is copied from
 * src_base + src_off[i] to dst[i] (len[i] bytes; non-temporal stores where dst[i] is 16-byte
 * aligned: the training state is not read again soon) and summed in place at chunk_off[i] of the
 * chunk (32-byte aligned, increasing, non-overlapping, within chunk_nbytes: the caller checks);
 * the bytes no piece covers (alignment padding) are zero. Returns the chunk's fl32x8-v1 digest.
 * Where mask[i] is not 0 the piece is also screened for NaN and infinities in the same pass:
 * mask[i] holds, in every floating-point element of a 64-bit word, that element's exponent bits
 * (float32 0x7f8000007f800000, float64 0x7ff0000000000000, float16 0x7c007c007c007c00,
 * bfloat16 0x7f807f807f807f80); bad[i] is non-zero when an element of the piece has every
 * exponent bit set (NaN or +-Inf), else 0. */
MFT_CLONES
uint64_t mft_f8_restore_chunk(uint64_t chunk_nbytes, uint64_t n_pieces, const uint64_t *chunk_off,
                              const uint64_t *len, const uint64_t *dst, uint64_t src_base,
                              const uint64_t *src_off, const uint64_t *mask, uint64_t *bad) {
    mft_f8_state st;
    memset(&st, 0, sizeof st);
    uint64_t pos = 0; /* bytes accounted for, a multiple of 32 */
    for (uint64_t i = 0; i < n_pieces; i++) {
        mft_f8_zeros(&st, (chunk_off[i] - pos) / 32);
        void *d = (void *)(uintptr_t)dst[i];
        const void *s = (const void *)(uintptr_t)(src_base + src_off[i]);
        int stream = MFT_HAVE_STREAM && ((uintptr_t)d & 15) == 0;
        bad[i] = 0;
        if (mask[i]) {
            if (stream) f8_update(&st, d, s, len[i], 1, 1, mask[i], &bad[i]);
            else f8_update(&st, d, s, len[i], 0, 1, mask[i], &bad[i]);
        } else {
            if (stream) f8_update(&st, d, s, len[i], 1, 0, 0, 0);
            else f8_update(&st, d, s, len[i], 0, 0, 0, 0);
        }
        pos = chunk_off[i] + (len[i] + 31) / 32 * 32;
    }
    uint64_t rows = (chunk_nbytes + 31) / 32;
    if (rows > pos / 32) mft_f8_zeros(&st, rows - pos / 32);
    return mft_f8_final(&st, chunk_nbytes);
}

uint64_t mft_copy_checksum8(void *dst, const void *src, uint64_t nbytes) {
    mft_f8_state st;
    memset(&st, 0, sizeof st);
    mft_f8_update(&st, dst, src, nbytes);
    return mft_f8_final(&st, nbytes);
}

/* ---- fl64x4 (read: snapshots of container formats 1 and 2) ---- */

/* the v1 digest (read only) */
uint64_t mft_fl_final(const mft_fl_state *st, uint64_t nbytes) {
    return fold(st->a, st->b, nbytes);
}

/* the v2 digest (read only) */
uint64_t mft_fl_final2(const mft_fl_state *st, uint64_t nbytes) {
    return fold2(st->a, st->b, nbytes);
}

/* Copy nbytes from src to dst (dst may be NULL: checksum only) and return the fl64x4-v2 checksum of src. */
uint64_t mft_copy_checksum(void *dst, const void *src, uint64_t nbytes) {
    mft_fl_state st;
    memset(&st, 0, sizeof st);
    mft_fl_update(&st, dst, src, nbytes);
    return mft_fl_final2(&st, nbytes);
}

