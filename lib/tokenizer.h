/**
 * @file tokenizer.h
 * @brief Character-level and byte-level tokenizers.
 *
 * - `char`: the vocabulary is the sorted set of distinct bytes of the training
 *   text (for tinyshakespeare: 65 symbols), exactly as nanoGPT's
 *   `shakespeare_char/prepare.py` builds it, so losses are comparable with it.
 * - `byte`: the vocabulary is all 256 byte values; works for any file.
 */
#ifndef MOE_TOKENIZER_H
#define MOE_TOKENIZER_H

#include <stddef.h>

#include "error.h"

/** Which tokenizer. */
typedef enum moe_tokenizer_type {
    MOE_TOKENIZER_CHAR = 0, /**< distinct characters of the text, sorted */
    MOE_TOKENIZER_BYTE = 1  /**< all 256 byte values */
} moe_tokenizer_type;

/** A tokenizer: a bijection between token ids [0, vocab_size) and bytes. */
typedef struct moe_tokenizer {
    moe_tokenizer_type type;   /**< char or byte */
    int vocab_size;            /**< number of token ids */
    unsigned char id_to_byte[256]; /**< decode table */
    int byte_to_id[256];       /**< encode table; -1 where the byte is not in the vocabulary */
} moe_tokenizer;

/**
 * @brief Build a tokenizer for @p text.
 * @param tok   receives the tokenizer
 * @param type  ::MOE_TOKENIZER_CHAR or ::MOE_TOKENIZER_BYTE
 * @param text  the training text (only read for the char tokenizer)
 * @param n     its length in bytes
 * @param err   receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_DATA for an empty text
 */
moe_status moe_tokenizer_build(moe_tokenizer *tok, moe_tokenizer_type type,
                               const unsigned char *text, size_t n, moe_error *err);

/**
 * @brief Encode @p n bytes into token ids.
 * @param tok  the tokenizer  @param text input bytes  @param n count  @param ids output (n ids)
 * @param err  receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_DATA naming the first byte that is not in the vocabulary
 */
moe_status moe_tokenizer_encode(const moe_tokenizer *tok, const unsigned char *text, size_t n,
                                int *ids, moe_error *err);

/**
 * @brief Decode token ids into bytes (ids out of range decode as '?').
 * @param tok the tokenizer  @param ids input ids  @param n count  @param out n bytes (no terminator added)
 */
void moe_tokenizer_decode(const moe_tokenizer *tok, const int *ids, size_t n, unsigned char *out);

/**
 * @brief Parse a tokenizer name ("char" or "byte").
 * @param name text  @param type receives the type  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_FLAG naming --tokenizer-type and the accepted values
 */
moe_status moe_tokenizer_parse_type(const char *name, moe_tokenizer_type *type, moe_error *err);

#endif /* MOE_TOKENIZER_H */
