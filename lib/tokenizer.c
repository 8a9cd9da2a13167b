/* Character-level and byte-level tokenizers: see tokenizer.h.
 *
 * Both tokenizers are lookup tables over the 256 byte values, so encoding and
 * decoding are one array access per byte. The char tokenizer only differs in
 * which bytes get an id: the distinct bytes of the training text, numbered in
 * increasing byte order. That is exactly what nanoGPT's
 * `sorted(list(set(data)))` gives for an ASCII text such as tinyshakespeare
 * (65 symbols: '\n', ' ', '!', ..., 'z'), so token ids -- and therefore losses
 * -- are comparable with nanoGPT's shakespeare_char runs.
 */
#include "tokenizer.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

moe_status moe_tokenizer_build(moe_tokenizer *tok, moe_tokenizer_type type,
                               const unsigned char *text, size_t n, moe_error *err) {
    MOE_ASSERT(tok != NULL);
    memset(tok, 0, sizeof *tok);
    tok->type = type;
    for (int b = 0; b < 256; b++)
        tok->byte_to_id[b] = -1;

    if (type == MOE_TOKENIZER_BYTE) {
        /* The identity map: id b is byte b. The text is not needed, so any
         * file (binary or UTF-8) can be tokenized. */
        for (int b = 0; b < 256; b++) {
            tok->id_to_byte[b] = (unsigned char)b;
            tok->byte_to_id[b] = b;
        }
        tok->vocab_size = 256;
        return MOE_OK;
    }
    if (type != MOE_TOKENIZER_CHAR)
        return moe_error_set(err, MOE_ERR_FLAG,
                             "unknown tokenizer type %d: --tokenizer-type accepts 'char' or 'byte'",
                             (int)type);

    if (n == 0)
        return moe_error_set(err, MOE_ERR_DATA,
                             "cannot build a char tokenizer from an empty text: the vocabulary "
                             "is the set of characters of the text; give a non-empty data file "
                             "(--data-path) or use --tokenizer-type byte");
    MOE_ASSERT(text != NULL);

    /* Mark the bytes that occur, then number them in increasing byte order:
     * scanning 0..255 in order is what makes the vocabulary "sorted". */
    unsigned char seen[256] = {0};
    for (size_t i = 0; i < n; i++)
        seen[text[i]] = 1;
    int id = 0;
    for (int b = 0; b < 256; b++) {
        if (!seen[b])
            continue;
        tok->id_to_byte[id] = (unsigned char)b;
        tok->byte_to_id[b] = id;
        id++;
    }
    tok->vocab_size = id;
    return MOE_OK;
}

moe_status moe_tokenizer_encode(const moe_tokenizer *tok, const unsigned char *text, size_t n,
                                int *ids, moe_error *err) {
    MOE_ASSERT(tok != NULL && (n == 0 || (text != NULL && ids != NULL)));
    for (size_t i = 0; i < n; i++) {
        int id = tok->byte_to_id[text[i]];
        if (id < 0) {
            /* Name the byte both ways: hex always, the character when printable. */
            unsigned char c = text[i];
            char shown[16];
            if (isprint(c))
                snprintf(shown, sizeof shown, "0x%02x ('%c')", c, (char)c);
            else
                snprintf(shown, sizeof shown, "0x%02x", c);
            return moe_error_set(
                err, MOE_ERR_DATA,
                "byte %s at offset %zu is not in the char vocabulary (%d symbols, built from "
                "the training text); encode only text drawn from that file, or use "
                "--tokenizer-type byte, which accepts every byte",
                shown, i, tok->vocab_size);
        }
        ids[i] = id;
    }
    return MOE_OK;
}

void moe_tokenizer_decode(const moe_tokenizer *tok, const int *ids, size_t n, unsigned char *out) {
    MOE_ASSERT(tok != NULL && (n == 0 || (ids != NULL && out != NULL)));
    for (size_t i = 0; i < n; i++) {
        int id = ids[i];
        /* A model samples ids in [0, vocab_size); anything else is a bug in the
         * caller, but decoding is for humans, so show it rather than crash. */
        out[i] = (id >= 0 && id < tok->vocab_size) ? tok->id_to_byte[id] : (unsigned char)'?';
    }
}

moe_status moe_tokenizer_parse_type(const char *name, moe_tokenizer_type *type, moe_error *err) {
    MOE_ASSERT(type != NULL);
    if (name && strcmp(name, "char") == 0) {
        *type = MOE_TOKENIZER_CHAR;
        return MOE_OK;
    }
    if (name && strcmp(name, "byte") == 0) {
        *type = MOE_TOKENIZER_BYTE;
        return MOE_OK;
    }
    return moe_error_set(err, MOE_ERR_FLAG,
                         "unknown --tokenizer-type '%s': use --tokenizer-type char (the distinct "
                         "characters of the text, as nanoGPT's shakespeare_char) or "
                         "--tokenizer-type byte (all 256 byte values, any file)",
                         name ? name : "(missing)");
}
