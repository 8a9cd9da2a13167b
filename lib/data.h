/**
 * @file data.h
 * @brief Finding, verifying, loading and batching the training text.
 *
 * Search order for the data file (first hit wins):
 *  1. the path given with `--data-path` (an error if it does not exist: never
 *     silently fall back when the user named a file);
 *  2. the environment variable `MOE_DATA_PATH`;
 *  3. `data/tinyshakespeare.txt` (relative to the working directory);
 *  4. `../shared/data/tinyshakespeare.txt`;
 *  5. otherwise, download the public file
 *     (https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt)
 *     into `data/tinyshakespeare.txt` with curl or wget where a network exists,
 *     verified against its sha256 before it is used;
 *  6. otherwise an error listing every place looked at and what to do.
 *
 * The text is split 90/10 into train and validation by position (the first
 * 90% of tokens train), as nanoGPT does.
 */
#ifndef MOE_DATA_H
#define MOE_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "tokenizer.h"

/** File name of the default dataset. */
#define MOE_DATA_DEFAULT_NAME "tinyshakespeare.txt"
/** sha256 of the default dataset: a download is checked against it. */
#define MOE_DATA_DEFAULT_SHA256 "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
/** Public source of the default dataset. */
#define MOE_DATA_DEFAULT_URL \
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
/** Environment variable that names the data file. */
#define MOE_DATA_ENV "MOE_DATA_PATH"

/** Which split to draw a batch from. */
typedef enum moe_split { MOE_SPLIT_TRAIN = 0, MOE_SPLIT_VAL = 1 } moe_split;

/** A tokenized text split into train and validation. */
typedef struct moe_dataset {
    char path[4096];        /**< the file that was loaded */
    moe_tokenizer tok;      /**< its tokenizer */
    int *tokens;            /**< all token ids */
    size_t n_tokens;        /**< number of tokens */
    size_t n_train;         /**< tokens [0, n_train) are train, [n_train, n_tokens) are val */
} moe_dataset;

/**
 * @brief Find the data file by the search order above (downloading it as the last resort).
 * @param out        receives the path
 * @param cap        capacity of @p out
 * @param flag_path  the value of --data-path, or NULL/"" when not given
 * @param err        receives the reason on failure
 * @return ::MOE_OK; ::MOE_ERR_IO naming --data-path if that file is missing, or listing
 *         every place looked at when nothing was found and no download was possible;
 *         ::MOE_ERR_DATA if a download did not match the expected sha256
 */
moe_status moe_data_find(char *out, size_t cap, const char *flag_path, moe_error *err);

/**
 * @brief Find (moe_data_find), read, tokenize and split a text file.
 * @param ds         receives the dataset (free with moe_dataset_free)
 * @param flag_path  value of --data-path or NULL
 * @param type       tokenizer type
 * @param err        receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_IO, or ::MOE_ERR_DATA (file too small to split into two
 *         non-empty parts, …)
 */
moe_status moe_dataset_load(moe_dataset *ds, const char *flag_path, moe_tokenizer_type type,
                            moe_error *err);

/**
 * @brief Check that both splits hold at least @p seq_len + 1 tokens.
 * @param ds the dataset  @param seq_len sequence length  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_CONFIG naming --seq-length
 */
moe_status moe_dataset_check_seq_len(const moe_dataset *ds, int seq_len, moe_error *err);

/** @brief Free the dataset's memory. @param ds dataset (fields zeroed) */
void moe_dataset_free(moe_dataset *ds);

/**
 * @brief Draw a batch of @p batch sequences of @p seq_len tokens and their next-token targets.
 *
 * Sequence b of batch number @p batch_index starts at a random offset drawn
 * with the counter-based RNG (seed, stream = split, index = batch_index·batch + b),
 * so a batch depends only on (seed, split, batch_index): reproducible, and
 * any rank can compute any batch.
 *
 * @param ds           the dataset
 * @param split        train or val
 * @param batch        sequences per batch
 * @param seq_len      tokens per sequence
 * @param seed         data seed
 * @param batch_index  which batch
 * @param inputs       batch·seq_len token ids
 * @param targets      batch·seq_len next-token ids
 */
void moe_dataset_batch(const moe_dataset *ds, moe_split split, int batch, int seq_len,
                       uint64_t seed, uint64_t batch_index, int *inputs, int *targets);

/**
 * @brief sha256 of a file as 64 lowercase hex characters.
 * @param path the file  @param hex receives 64 chars + terminator  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_IO
 */
moe_status moe_sha256_file(const char *path, char hex[65], moe_error *err);

#endif /* MOE_DATA_H */
