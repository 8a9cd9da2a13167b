/* SHA-256 (FIPS 180-4): see sha256.h.
 *
 * Section numbers below refer to FIPS 180-4, "Secure Hash Standard" (2015).
 * SHA-256 is defined on big-endian 32-bit words; we load and store bytes
 * explicitly, so the code gives the same digest on any host byte order.
 */
#include "sha256.h"

#include <string.h>

/* §4.2.2: the first 32 bits of the fractional parts of the cube roots of the
 * first 64 primes, one constant per round. */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

/* §3.2 and §4.1.2: the bit operations of the compression function. */
static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
static inline uint32_t ch(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (~x & z); }
static inline uint32_t maj(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (x & z) ^ (y & z); }
static inline uint32_t big_sigma0(uint32_t x) { return rotr(x, 2) ^ rotr(x, 13) ^ rotr(x, 22); }
static inline uint32_t big_sigma1(uint32_t x) { return rotr(x, 6) ^ rotr(x, 11) ^ rotr(x, 25); }
static inline uint32_t small_sigma0(uint32_t x) { return rotr(x, 7) ^ rotr(x, 18) ^ (x >> 3); }
static inline uint32_t small_sigma1(uint32_t x) { return rotr(x, 17) ^ rotr(x, 19) ^ (x >> 10); }

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t x) {
    p[0] = (uint8_t)(x >> 24);
    p[1] = (uint8_t)(x >> 16);
    p[2] = (uint8_t)(x >> 8);
    p[3] = (uint8_t)x;
}

/* §6.2.2: hash one 64-byte block into the state h[8]. */
static void compress(uint32_t h[8], const uint8_t block[MOE_SHA256_BLOCK_LEN]) {
    /* 1. The message schedule: 16 words from the block, 48 more derived from them. */
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = load_be32(block + 4 * t);
    for (int t = 16; t < 64; t++)
        w[t] = small_sigma1(w[t - 2]) + w[t - 7] + small_sigma0(w[t - 15]) + w[t - 16];

    /* 2.-3. Initialise the eight working variables and run the 64 rounds. */
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
    uint32_t e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = hh + big_sigma1(e) + ch(e, f, g) + K[t] + w[t];
        uint32_t t2 = big_sigma0(a) + maj(a, b, c);
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }

    /* 4. Add the block's result into the running hash (all arithmetic is mod 2^32). */
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
}

void moe_sha256_init(moe_sha256_ctx *ctx) {
    /* §5.3.3: the first 32 bits of the fractional parts of the square roots
     * of the first 8 primes. */
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(ctx->h, h0, sizeof h0);
    memset(ctx->block, 0, sizeof ctx->block);
    ctx->block_len = 0;
    ctx->total_len = 0;
}

void moe_sha256_update(moe_sha256_ctx *ctx, const void *data, size_t n) {
    if (n == 0)
        return; /* also keeps memcpy away from a NULL pointer, which is undefined even for 0 bytes */
    const uint8_t *p = (const uint8_t *)data;
    ctx->total_len += n;

    /* Top up a partial block left over from the previous call first. */
    if (ctx->block_len > 0) {
        size_t take = MOE_SHA256_BLOCK_LEN - ctx->block_len;
        if (take > n)
            take = n;
        memcpy(ctx->block + ctx->block_len, p, take);
        ctx->block_len += take;
        p += take;
        n -= take;
        if (ctx->block_len < MOE_SHA256_BLOCK_LEN)
            return; /* still not a full block: wait for more input */
        compress(ctx->h, ctx->block);
        ctx->block_len = 0;
    }
    /* Whole blocks straight from the caller's buffer, without copying. */
    while (n >= MOE_SHA256_BLOCK_LEN) {
        compress(ctx->h, p);
        p += MOE_SHA256_BLOCK_LEN;
        n -= MOE_SHA256_BLOCK_LEN;
    }
    /* Keep the tail for the next call (or for final). */
    if (n > 0) {
        memcpy(ctx->block, p, n);
        ctx->block_len = n;
    }
}

void moe_sha256_final(moe_sha256_ctx *ctx, uint8_t digest[MOE_SHA256_DIGEST_LEN]) {
    /* §5.1.1 padding: a single 1 bit, zeros, then the message length in bits
     * as a 64-bit big-endian number, so that the total is a multiple of 512
     * bits. If the length does not fit after the 1 bit in this block (fewer
     * than 8 bytes left), the padding spills into one more block. */
    uint64_t bit_len = ctx->total_len * 8;
    ctx->block[ctx->block_len++] = 0x80;
    if (ctx->block_len > MOE_SHA256_BLOCK_LEN - 8) {
        memset(ctx->block + ctx->block_len, 0, MOE_SHA256_BLOCK_LEN - ctx->block_len);
        compress(ctx->h, ctx->block);
        ctx->block_len = 0;
    }
    memset(ctx->block + ctx->block_len, 0, MOE_SHA256_BLOCK_LEN - 8 - ctx->block_len);
    store_be32(ctx->block + 56, (uint32_t)(bit_len >> 32));
    store_be32(ctx->block + 60, (uint32_t)bit_len);
    compress(ctx->h, ctx->block);

    /* §6.2.2: the digest is H0..H7, big-endian. */
    for (int i = 0; i < 8; i++)
        store_be32(digest + 4 * i, ctx->h[i]);
    memset(ctx, 0, sizeof *ctx); /* a finished state is not reusable; make that obvious */
}

void moe_sha256_bytes(const void *data, size_t n, uint8_t digest[MOE_SHA256_DIGEST_LEN]) {
    moe_sha256_ctx ctx;
    moe_sha256_init(&ctx);
    moe_sha256_update(&ctx, data, n);
    moe_sha256_final(&ctx, digest);
}

void moe_sha256_hex(const uint8_t digest[MOE_SHA256_DIGEST_LEN], char hex[MOE_SHA256_HEX_LEN]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < MOE_SHA256_DIGEST_LEN; i++) {
        hex[2 * i] = digits[digest[i] >> 4];
        hex[2 * i + 1] = digits[digest[i] & 0xf];
    }
    hex[2 * MOE_SHA256_DIGEST_LEN] = '\0';
}
