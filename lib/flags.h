/**
 * @file flags.h
 * @brief A table-driven parser for Megatron-style long flags (`--hidden-size 128`).
 *
 * One table describes every flag once: its name, its type, where its value
 * lives in the config struct, its default and its meaning. From that single
 * table we get the defaults, the parser, `--help`, and the config dump that
 * goes into the metrics file — so they can never disagree.
 */
#ifndef MOE_FLAGS_H
#define MOE_FLAGS_H

#include <stddef.h>
#include <stdio.h>

#include "error.h"

/** The type of a flag's value. */
typedef enum moe_flag_type {
    MOE_FLAG_INT,    /**< `int` field */
    MOE_FLAG_INT64,  /**< `long long` field */
    MOE_FLAG_DOUBLE, /**< `double` field */
    MOE_FLAG_BOOL,   /**< `int` field set to 1 by the bare flag (store_true) */
    MOE_FLAG_STRING, /**< `char[MOE_FLAG_STR_LEN]` field */
    MOE_FLAG_CHOICE  /**< string field restricted to `choices` */
} moe_flag_type;

/** Capacity of string-valued flag fields. */
#define MOE_FLAG_STR_LEN 512

/** One flag. */
typedef struct moe_flag {
    const char *name;     /**< without the leading dashes, e.g. "hidden-size" */
    moe_flag_type type;   /**< value type */
    size_t offset;        /**< offsetof(struct, field) */
    const char *def;      /**< default, as it would be typed on the command line ("" for none) */
    const char *help;     /**< one-line meaning */
    const char *choices;  /**< for ::MOE_FLAG_CHOICE: '|'-separated accepted values */
    const char *group;    /**< heading under which --help lists it */
} moe_flag;

/**
 * @brief Write every flag's default into @p base.
 * @param flags table  @param n its length  @param base the struct the offsets refer to
 */
void moe_flags_set_defaults(const moe_flag *flags, int n, void *base);

/**
 * @brief Where @p value stands in a ::MOE_FLAG_CHOICE list: 0 for the first choice of
 *        "auto|collective|fused", 2 for "fused". Declaring an enum in the same order turns
 *        a parsed choice into that enum with no string compares afterwards.
 * @param choices '|'-separated values  @param value the value
 * @return its index, or -1 when it is not one of the choices
 */
int moe_flags_choice_index(const char *choices, const char *value);

/**
 * @brief Parse argv[1..argc-1] into @p base. Accepts `--name value` and `--name=value`;
 *        a switch (::MOE_FLAG_BOOL) is set by `--name` and cleared by `--no-name`. A
 *        ::MOE_FLAG_DOUBLE value must be finite: nan and inf are refused.
 * @param flags table  @param n its length  @param base struct to fill
 * @param argc argument count  @param argv arguments
 * @param err receives the reason on failure
 * @return ::MOE_OK; ::MOE_ERR_HELP when --help/-h was given (the caller prints help);
 *         ::MOE_ERR_FLAG for an unknown flag (with a did-you-mean suggestion), a missing
 *         value, a value that does not parse, or a value outside the choices
 */
moe_status moe_flags_parse(const moe_flag *flags, int n, void *base, int argc, char **argv,
                           moe_error *err);

/**
 * @brief Print `--help`: every flag, grouped, with its default and meaning.
 * @param f stream  @param prog program name  @param summary one-paragraph description
 * @param flags table  @param n its length
 */
void moe_flags_print_help(FILE *f, const char *prog, const char *summary, const moe_flag *flags,
                          int n);

/**
 * @brief Format a flag's current value in @p base as text.
 * @param flag the flag  @param base struct  @param out buffer  @param cap its capacity
 */
void moe_flags_format_value(const moe_flag *flag, const void *base, char *out, size_t cap);

#endif /* MOE_FLAGS_H */
