/* Table-driven long-flag parser: see flags.h. */
#include "flags.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void *field(void *base, const moe_flag *f) { return (char *)base + f->offset; }
static const void *cfield(const void *base, const moe_flag *f) {
    return (const char *)base + f->offset;
}

int moe_flags_choice_index(const char *choices, const char *v) {
    size_t len = strlen(v);
    const char *p = choices;
    for (int index = 0; *p; index++) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncmp(p, v, n) == 0)
            return index;
        if (!bar)
            break;
        p = bar + 1;
    }
    return -1;
}

/* Parse @p text into the field of @p f; on failure say which flag and why. */
static moe_status set_value(const moe_flag *f, void *base, const char *text, moe_error *err) {
    char *end = NULL;
    errno = 0;
    switch (f->type) {
    case MOE_FLAG_INT: {
        long v = strtol(text, &end, 10);
        if (errno || end == text || *end || v < INT_MIN || v > INT_MAX)
            return moe_error_set(err, MOE_ERR_FLAG, "--%s expects an integer, got '%s'", f->name,
                                 text);
        *(int *)field(base, f) = (int)v;
        return MOE_OK;
    }
    case MOE_FLAG_INT64: {
        long long v = strtoll(text, &end, 10);
        if (errno || end == text || *end)
            return moe_error_set(err, MOE_ERR_FLAG, "--%s expects an integer, got '%s'", f->name,
                                 text);
        *(long long *)field(base, f) = v;
        return MOE_OK;
    }
    case MOE_FLAG_DOUBLE: {
        double v = strtod(text, &end);
        if (errno || end == text || *end)
            return moe_error_set(err, MOE_ERR_FLAG, "--%s expects a number, got '%s'", f->name,
                                 text);
        /* strtod reads "nan", "inf" and "infinity" as numbers, but no setting of moe.c means
         * any of them: a non-finite value would only come back later as a NaN loss */
        if (!isfinite(v))
            return moe_error_set(err, MOE_ERR_FLAG, "--%s expects a finite number, got '%s'",
                                 f->name, text);
        *(double *)field(base, f) = v;
        return MOE_OK;
    }
    case MOE_FLAG_BOOL: {
        int v;
        if (!strcmp(text, "1") || !strcmp(text, "true"))
            v = 1;
        else if (!strcmp(text, "0") || !strcmp(text, "false"))
            v = 0;
        else
            return moe_error_set(err, MOE_ERR_FLAG,
                                 "--%s is a switch: give it alone, or as --%s=true/false (got '%s')",
                                 f->name, f->name, text);
        *(int *)field(base, f) = v;
        return MOE_OK;
    }
    case MOE_FLAG_CHOICE:
        if (moe_flags_choice_index(f->choices, text) < 0)
            return moe_error_set(err, MOE_ERR_FLAG, "--%s must be one of %s, got '%s'", f->name,
                                 f->choices, text);
        /* fall through */
    case MOE_FLAG_STRING:
        if (strlen(text) >= MOE_FLAG_STR_LEN)
            return moe_error_set(err, MOE_ERR_FLAG, "--%s: value longer than %d characters",
                                 f->name, MOE_FLAG_STR_LEN - 1);
        strcpy((char *)field(base, f), text);
        return MOE_OK;
    }
    return moe_error_set(err, MOE_ERR_FLAG, "--%s: unknown flag type", f->name);
}

void moe_flags_set_defaults(const moe_flag *flags, int n, void *base) {
    for (int i = 0; i < n; i++) {
        moe_status s = set_value(&flags[i], base, flags[i].def, NULL);
        MOE_ASSERT(s == MOE_OK); /* a default that does not parse is a bug in the table */
    }
}

static const moe_flag *find(const moe_flag *flags, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(flags[i].name, name))
            return &flags[i];
    return NULL;
}

/* Levenshtein distance, for "did you mean --hidden-size?" */
static int edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63 || lb > 63)
        return 99;
    int d[64][64];
    for (int i = 0; i <= la; i++)
        d[i][0] = i;
    for (int j = 0; j <= lb; j++)
        d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c)
                c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c)
                c = d[i][j - 1] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}

moe_status moe_flags_parse(const moe_flag *flags, int n, void *base, int argc, char **argv,
                           moe_error *err) {
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h"))
            return moe_error_set(err, MOE_ERR_HELP, "help requested");
        if (strncmp(arg, "--", 2) != 0)
            return moe_error_set(err, MOE_ERR_FLAG,
                                 "unexpected argument '%s': flags look like --name value "
                                 "(see --help)",
                                 arg);
        char name[128];
        const char *eq = strchr(arg + 2, '=');
        size_t len = eq ? (size_t)(eq - (arg + 2)) : strlen(arg + 2);
        if (len >= sizeof name)
            return moe_error_set(err, MOE_ERR_FLAG, "flag name too long: '%s'", arg);
        memcpy(name, arg + 2, len);
        name[len] = '\0';
        /* Megatron spells flags with dashes; accept underscores too. */
        for (char *c = name; *c; c++)
            if (*c == '_')
                *c = '-';
        const moe_flag *f = find(flags, n, name);
        const char *value = NULL;
        /* Megatron turns a switch that is on by default off with --no-NAME */
        if (!f && !strncmp(name, "no-", 3) && (f = find(flags, n, name + 3)) != NULL) {
            if (f->type != MOE_FLAG_BOOL || eq)
                return moe_error_set(err, MOE_ERR_FLAG,
                                     "--%s: only a switch can be turned off with --no-, and then "
                                     "without a value (see --help)",
                                     name);
            value = "0";
        }
        if (!f) {
            int best = -1, bestd = 4;
            for (int i = 0; i < n; i++) {
                int d = edit_distance(name, flags[i].name);
                if (d < bestd) {
                    bestd = d;
                    best = i;
                }
            }
            if (best >= 0)
                return moe_error_set(err, MOE_ERR_FLAG,
                                     "unknown flag --%s (did you mean --%s? see --help)", name,
                                     flags[best].name);
            return moe_error_set(err, MOE_ERR_FLAG, "unknown flag --%s (see --help)", name);
        }
        if (!value) {
            if (eq)
                value = eq + 1;
            else if (f->type == MOE_FLAG_BOOL)
                value = "1";
            else if (a + 1 < argc)
                value = argv[++a];
            else
                return moe_error_set(err, MOE_ERR_FLAG, "--%s needs a value (see --help)",
                                     f->name);
        }
        MOE_TRY(set_value(f, base, value, err));
    }
    return MOE_OK;
}

void moe_flags_format_value(const moe_flag *f, const void *base, char *out, size_t cap) {
    const void *p = cfield(base, f);
    switch (f->type) {
    case MOE_FLAG_INT: snprintf(out, cap, "%d", *(const int *)p); break;
    case MOE_FLAG_INT64: snprintf(out, cap, "%lld", *(const long long *)p); break;
    case MOE_FLAG_DOUBLE: {
        /* the shortest text that reads back as the same double */
        double v = *(const double *)p;
        for (int prec = 6; prec <= 17; prec++) {
            snprintf(out, cap, "%.*g", prec, v);
            if (strtod(out, NULL) == v)
                break;
        }
        break;
    }
    case MOE_FLAG_BOOL: snprintf(out, cap, "%s", *(const int *)p ? "true" : "false"); break;
    case MOE_FLAG_STRING:
    case MOE_FLAG_CHOICE: snprintf(out, cap, "%s", (const char *)p); break;
    }
}

void moe_flags_print_help(FILE *out, const char *prog, const char *summary, const moe_flag *flags,
                          int n) {
    fprintf(out, "usage: %s [--flag value ...]\n\n%s\n", prog, summary);
    const char *group = NULL;
    for (int i = 0; i < n; i++) {
        const moe_flag *f = &flags[i];
        if (!group || strcmp(group, f->group) != 0) {
            group = f->group;
            fprintf(out, "\n%s:\n", group);
        }
        char lhs[160];
        const char *meta = f->type == MOE_FLAG_BOOL     ? ""
                           : f->type == MOE_FLAG_CHOICE ? f->choices
                           : f->type == MOE_FLAG_STRING ? "STR"
                           : f->type == MOE_FLAG_DOUBLE ? "X"
                                                        : "N";
        snprintf(lhs, sizeof lhs, "--%s%s%s", f->name, *meta ? " " : "", meta);
        fprintf(out, "  %-44s %s", lhs, f->help);
        if (f->type == MOE_FLAG_BOOL && !strcmp(f->def, "1"))
            fprintf(out, " (default: on; --no-%s turns it off)\n", f->name);
        else if (f->type == MOE_FLAG_BOOL)
            fprintf(out, " (default: off)\n");
        else
            fprintf(out, " (default: %s)\n", *f->def ? f->def : "none");
    }
}
