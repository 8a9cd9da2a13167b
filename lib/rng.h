/**
 * @file rng.h
 * @brief A counter-based random number generator (Philox4x32-10).
 *
 * Why counter-based: the random value of element i of tensor s under seed k is
 * a pure function philox(k, s, i). Any backend (CPU, CUDA) and any parallel
 * layout (a rank holding rows 512..1023 of an expert) can produce exactly the
 * values it needs without generating the ones before them, so one seed gives
 * the same initial model everywhere. Philox4x32-10 is the generator of
 * Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11), the
 * same one cuRAND and PyTorch use on GPUs.
 *
 * The functions are `static inline` and free of globals so that CUDA code can
 * include this header and get bit-identical streams on the device.
 */
#ifndef MOE_RNG_H
#define MOE_RNG_H

#include <math.h>
#include <stdint.h>

#include "real.h"

/** Four 32-bit words: a Philox counter or output block. */
typedef struct moe_u32x4 {
    uint32_t v[4]; /**< the words */
} moe_u32x4;

/**
 * @brief One Philox4x32-10 block: 10 rounds of multiply-xor on the counter,
 *        keyed by a 64-bit key.
 * @param ctr  the 128-bit counter
 * @param key  the 64-bit key (the seed)
 * @return 128 random bits
 */
static inline MOE_HOSTDEV moe_u32x4 moe_philox4x32(moe_u32x4 ctr, uint64_t key) {
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * ctr.v[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * ctr.v[2];
        moe_u32x4 n;
        n.v[0] = (uint32_t)(p1 >> 32) ^ ctr.v[1] ^ k0;
        n.v[1] = (uint32_t)p1;
        n.v[2] = (uint32_t)(p0 >> 32) ^ ctr.v[3] ^ k1;
        n.v[3] = (uint32_t)p0;
        ctr = n;
        k0 += 0x9E3779B9u; /* the Weyl sequence that bumps the key each round */
        k1 += 0xBB67AE85u;
    }
    return ctr;
}

/** @brief The 128 random bits for element @p index of stream @p stream under @p seed.
 *  @param seed the key  @param stream which tensor/purpose  @param index which element
 *  @return one Philox block */
static inline MOE_HOSTDEV moe_u32x4 moe_rng_bits(uint64_t seed, uint64_t stream, uint64_t index) {
    moe_u32x4 c;
    c.v[0] = (uint32_t)index;
    c.v[1] = (uint32_t)(index >> 32);
    c.v[2] = (uint32_t)stream;
    c.v[3] = (uint32_t)(stream >> 32);
    return moe_philox4x32(c, seed);
}

/** @brief Map 32 random bits to a double in the open interval (0, 1).
 *  @param x random bits  @return (x + 0.5) / 2^32 */
static inline MOE_HOSTDEV double moe_u32_to_unit(uint32_t x) {
    return ((double)x + 0.5) * (1.0 / 4294967296.0);
}

/**
 * @brief A uniform double in (0, 1) for element @p index of stream @p stream.
 * @param seed the run's seed  @param stream which tensor/purpose  @param index which element
 * @return the uniform value
 */
static inline MOE_HOSTDEV double moe_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return moe_u32_to_unit(moe_rng_bits(seed, stream, index).v[0]);
}

/**
 * @brief A standard normal double for element @p index of stream @p stream
 *        (Box–Muller on two words of one Philox block; computed in double so
 *        every backend rounds it the same way).
 * @param seed the run's seed  @param stream which tensor/purpose  @param index which element
 * @return the normal value
 */
static inline MOE_HOSTDEV double moe_rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    moe_u32x4 b = moe_rng_bits(seed, stream, index);
    double u1 = moe_u32_to_unit(b.v[0]), u2 = moe_u32_to_unit(b.v[1]);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925286766559 * u2);
}

#endif /* MOE_RNG_H */
