/**
 * @file checkpoint_file.h
 * @brief The checkpoint file format: named tensor shards behind a checksummed header.
 *
 * One file holds any number of tensors, each keyed by a name and by the shard of the whole
 * tensor it is (global shape, split dimension, shard index and count), so a reader can
 * reassemble a tensor from the files of every rank and slice it again for another layout.
 * The header and the index carry a SHA-256, and so does every tensor's data: a reader
 * checks every byte before it hands anything out, so a flipped bit, a truncated file or a
 * file of another format is an error, never a silently wrong model. The byte layout is
 * specified in docs/checkpoint-format.md.
 *
 * Files are written atomically (atomic_file.h): a crash during a write leaves the previous
 * file, or none, under the final name.
 */
#ifndef MOE_CHECKPOINT_FILE_H
#define MOE_CHECKPOINT_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "sha256.h"

/** The first 8 bytes of every checkpoint file. */
#define MOE_CKPT_MAGIC "MOECKPT\0"
/** The format version this build writes and reads. */
#define MOE_CKPT_VERSION 1
/** Longest tensor name, with its terminating zero. */
#define MOE_CKPT_NAME_LEN 128

/** Element types a checkpoint tensor may have. */
typedef enum moe_ckpt_dtype {
    MOE_CKPT_F32 = 1, /**< IEEE float */
    MOE_CKPT_F64 = 2, /**< IEEE double */
    MOE_CKPT_I64 = 3, /**< signed 64-bit integer */
    MOE_CKPT_U8 = 4   /**< byte (text) */
} moe_ckpt_dtype;

/** One tensor of a file: which shard of which tensor, and its bytes. */
typedef struct moe_ckpt_tensor {
    char name[MOE_CKPT_NAME_LEN]; /**< e.g. "model.layers.1.moe.experts.fc1" */
    moe_ckpt_dtype dtype;         /**< element type */
    int ndim;                     /**< 1..3 */
    int64_t global_shape[3];      /**< sizes of the whole tensor, outermost first */
    int shard_dim;                /**< dimension the whole tensor is split along */
    int shard_index;              /**< this piece, 0 .. shard_count-1 */
    int shard_count;              /**< pieces (1: the whole tensor) */
    uint64_t bytes;               /**< size of the data */
    const void *data;             /**< the data (the writer's, or inside a read file) */
    uint8_t sha256[MOE_SHA256_DIGEST_LEN]; /**< checksum of the data (filled by the writer) */
} moe_ckpt_tensor;

/** What a file says about itself: which checkpoint, and which of its files. */
typedef struct moe_ckpt_file_info {
    int64_t step;      /**< optimizer steps taken when it was saved */
    int file_index;    /**< this file, 0 .. file_count-1 (the writing rank) */
    int file_count;    /**< files of the checkpoint (ranks that saved it) */
} moe_ckpt_file_info;

/** A file read and verified: its info and tensors (pointing into one buffer). */
typedef struct moe_ckpt_file {
    char path[1024];          /**< where it was read from (for messages) */
    moe_ckpt_file_info info;  /**< its header */
    moe_ckpt_tensor *t;       /**< its tensors */
    int n;                    /**< how many */
    unsigned char *buf;       /**< the whole file */
} moe_ckpt_file;

/** @brief Bytes per element of @p dtype. @param dtype type @return 4, 8 or 1 */
size_t moe_ckpt_dtype_size(moe_ckpt_dtype dtype);

/**
 * @brief Write @p n tensors to @p path atomically: checksums, header, index, data.
 * @param path the file  @param info its header
 * @param t tensors (name, dtype, shape, shard, bytes and data set; sha256 is computed)
 * @param n how many  @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_IO (the previous file under @p path is then kept)
 */
moe_status moe_ckpt_file_write(const char *path, const moe_ckpt_file_info *info,
                               moe_ckpt_tensor *t, int n, moe_error *err);

/**
 * @brief Read @p path and verify it completely: magic, version, size, header checksum, the
 *        bounds and checksum of every tensor. Nothing is returned unless all of it holds.
 * @param out receives the file (free with moe_ckpt_file_free)  @param path the file
 * @param err receives the reason on failure, naming the file and what is wrong
 * @return ::MOE_OK, ::MOE_ERR_IO (missing, unreadable), ::MOE_ERR_DATA (not a checkpoint,
 *         another version, truncated, a checksum mismatch) or ::MOE_ERR_NOMEM
 */
moe_status moe_ckpt_file_read(moe_ckpt_file *out, const char *path, moe_error *err);

/** @brief Free a file read by moe_ckpt_file_read. @param f file (zeroed afterwards) */
void moe_ckpt_file_free(moe_ckpt_file *f);

#endif /* MOE_CHECKPOINT_FILE_H */
