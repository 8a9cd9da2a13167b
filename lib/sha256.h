/**
 * @file sha256.h
 * @brief A small SHA-256 (FIPS 180-4) with a streaming interface.
 *
 * moe.c uses SHA-256 to check that a data file is the one expected (a
 * truncated or wrong download must never be trained on silently). The
 * implementation favours clarity over speed: one 64-byte block at a time,
 * written as the standard describes it (§6.2.2).
 *
 * Streaming use, for data that does not fit in memory or arrives in pieces:
 * @code
 *   moe_sha256_ctx ctx;
 *   uint8_t digest[MOE_SHA256_DIGEST_LEN];
 *   char hex[MOE_SHA256_HEX_LEN];
 *   moe_sha256_init(&ctx);
 *   moe_sha256_update(&ctx, part1, n1);
 *   moe_sha256_update(&ctx, part2, n2);
 *   moe_sha256_final(&ctx, digest);
 *   moe_sha256_hex(digest, hex);   // "ba7816bf..." for "abc"
 * @endcode
 */
#ifndef MOE_SHA256_H
#define MOE_SHA256_H

#include <stddef.h>
#include <stdint.h>

/** Size of a SHA-256 digest in bytes. */
#define MOE_SHA256_DIGEST_LEN 32
/** Size of a SHA-256 digest as lowercase hex, including the terminating zero. */
#define MOE_SHA256_HEX_LEN 65
/** SHA-256 processes its input in blocks of this many bytes. */
#define MOE_SHA256_BLOCK_LEN 64

/** The running state of one SHA-256 computation. */
typedef struct moe_sha256_ctx {
    uint32_t h[8];                          /**< the eight working hash words H0..H7 */
    uint8_t block[MOE_SHA256_BLOCK_LEN];    /**< input bytes not yet hashed (a partial block) */
    size_t block_len;                       /**< how many bytes of @c block are filled */
    uint64_t total_len;                     /**< total input length so far, in bytes */
} moe_sha256_ctx;

/**
 * @brief Start a new hash computation.
 * @param ctx the state to initialise
 */
void moe_sha256_init(moe_sha256_ctx *ctx);

/**
 * @brief Feed @p n more bytes. May be called any number of times, with any sizes.
 * @param ctx  a state from moe_sha256_init
 * @param data the bytes (may be NULL when @p n is 0)
 * @param n    how many
 */
void moe_sha256_update(moe_sha256_ctx *ctx, const void *data, size_t n);

/**
 * @brief Finish: pad the message, hash the last block(s) and write the digest.
 *        The state must be re-initialised before it is used again.
 * @param ctx    the state
 * @param digest receives the 32-byte digest
 */
void moe_sha256_final(moe_sha256_ctx *ctx, uint8_t digest[MOE_SHA256_DIGEST_LEN]);

/**
 * @brief One-shot hash of a buffer (init + update + final).
 * @param data   the bytes (may be NULL when @p n is 0)
 * @param n      how many
 * @param digest receives the 32-byte digest
 */
void moe_sha256_bytes(const void *data, size_t n, uint8_t digest[MOE_SHA256_DIGEST_LEN]);

/**
 * @brief Write a digest as 64 lowercase hex characters plus a terminating zero,
 *        the form `sha256sum` prints.
 * @param digest the 32-byte digest
 * @param hex    receives 65 characters
 */
void moe_sha256_hex(const uint8_t digest[MOE_SHA256_DIGEST_LEN], char hex[MOE_SHA256_HEX_LEN]);

#endif /* MOE_SHA256_H */
