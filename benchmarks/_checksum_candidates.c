/*
 * Candidate checksums fused into the snapshot copy, measured by benchmarks/checksum.py against the
 * product's fl32x8 (megatron_ft/_native/fastcopy.c). Compiled by the benchmark at run time
 * (cc -O3 -msse4.2 -shared); nothing here is part of the installed package.
 *
 * CRC32C (Castagnoli, the polynomial of iSCSI/ext4/RocksDB) with the SSE4.2 crc32 instruction:
 *   - crc32c_copy_1: one dependent chain of crc32q (latency 3 cycles: ~8 bytes / 3 cycles);
 *   - crc32c_copy_3: three independent chains over consecutive blocks of BLOCK bytes, combined
 *     with precomputed "shift by BLOCK zero bytes" tables (the usual way to reach the
 *     instruction's throughput of 8 bytes per cycle).
 * Both copy src to dst (dst may be NULL) in the same pass and return the CRC32C of src.
 */
#include <stdint.h>
#include <string.h>
#include <nmmintrin.h>

#define POLY 0x82f63b78u /* CRC32C, reflected */
#define BLOCK 8192u

static uint32_t crc_sw_byte(uint32_t crc, uint8_t b) {
    crc ^= b;
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (POLY & (0u - (crc & 1u)));
    return crc;
}

/* multiply-by-x^(8n) tables: shift(crc) = crc of (crc's message followed by n zero bytes), as a
 * linear map applied byte by byte through 4 lookup tables */
static uint32_t shift_tab[4][256];
static int shift_ready = 0;

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (int i = 0; vec; i++, vec >>= 1)
        if (vec & 1) sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

static void init_shift(void) {
    /* operator for one zero bit, then square up to BLOCK*8 zero bits (BLOCK is a power of two) */
    uint32_t odd[32], even[32];
    odd[0] = POLY;
    for (int n = 1, row = 1; n < 32; n++, row <<= 1) odd[n] = row;
    gf2_square(even, odd); /* 2 bits */
    gf2_square(odd, even); /* 4 bits */
    gf2_square(even, odd); /* 8 bits = 1 byte */
    uint32_t *cur = even, *nxt = odd;
    for (uint32_t bytes = 1; bytes < BLOCK; bytes <<= 1) {
        gf2_square(nxt, cur);
        uint32_t *t = cur; cur = nxt; nxt = t;
    }
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) shift_tab[k][b] = gf2_times(cur, (uint32_t)b << (8 * k));
    shift_ready = 1;
}

static inline uint32_t shift_block(uint32_t crc) {
    return shift_tab[0][crc & 0xff] ^ shift_tab[1][(crc >> 8) & 0xff] ^ shift_tab[2][(crc >> 16) & 0xff] ^
           shift_tab[3][crc >> 24];
}

static inline uint64_t crc_chain(uint64_t crc, unsigned char *d, const unsigned char *s, uint64_t n) {
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (d) memcpy(d + i, &w, 8);
        crc = _mm_crc32_u64(crc, w);
    }
    for (; i < n; i++) {
        if (d) d[i] = s[i];
        crc = _mm_crc32_u8((uint32_t)crc, s[i]);
    }
    return crc;
}

uint32_t crc32c_copy_1(void *dst, const void *src, uint64_t n, uint32_t crc) {
    return ~(uint32_t)crc_chain(~crc, (unsigned char *)dst, (const unsigned char *)src, n);
}

uint32_t crc32c_copy_3(void *dst, const void *src, uint64_t n, uint32_t crc) {
    if (!shift_ready) init_shift();
    const unsigned char *s = (const unsigned char *)src;
    unsigned char *d = (unsigned char *)dst;
    uint64_t c0 = ~crc;
    uint64_t done = 0;
    while (n - done >= 3ull * BLOCK) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *s0 = s + done, *s1 = s0 + BLOCK, *s2 = s1 + BLOCK;
        unsigned char *d0 = d ? d + done : 0, *d1 = d ? d0 + BLOCK : 0, *d2 = d ? d1 + BLOCK : 0;
        for (uint32_t i = 0; i < BLOCK; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, s0 + i, 8); memcpy(&w1, s1 + i, 8); memcpy(&w2, s2 + i, 8);
            if (d) { memcpy(d0 + i, &w0, 8); memcpy(d1 + i, &w1, 8); memcpy(d2 + i, &w2, 8); }
            c0 = _mm_crc32_u64(c0, w0); c1 = _mm_crc32_u64(c1, w1); c2 = _mm_crc32_u64(c2, w2);
        }
        /* crc(A B C) = shift(shift(c0) ^ c1) ^ c2 with c1, c2 started from 0 (linearity) */
        c0 = shift_block(shift_block((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        done += 3ull * BLOCK;
    }
    c0 = crc_chain(c0, d ? d + done : 0, s + done, n - done);
    return ~(uint32_t)c0;
}

/* bit-at-a-time reference, for the benchmark's correctness check */
uint32_t crc32c_reference(const void *src, uint64_t n) {
    const unsigned char *s = (const unsigned char *)src;
    uint32_t crc = ~0u;
    for (uint64_t i = 0; i < n; i++) crc = crc_sw_byte(crc, s[i]);
    return ~crc;
}
