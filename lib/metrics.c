/* JSON-lines metrics writer: see metrics.h. */
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct moe_metrics {
    FILE *f;
};

moe_status moe_metrics_open(moe_metrics **out, const char *path, moe_error *err) {
    *out = NULL;
    FILE *f = fopen(path, "w");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO,
                             "cannot open metrics file '%s' for writing: %s "
                             "(fix the path given to --metrics-file, or create its directory)",
                             path, strerror(errno));
    moe_metrics *m = calloc(1, sizeof *m);
    if (!m) {
        fclose(f);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory opening metrics file");
    }
    m->f = f;
    *out = m;
    return MOE_OK;
}

void moe_json_write_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c == '\n')
            fputs("\\n", f);
        else if (c == '\t')
            fputs("\\t", f);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

void moe_metrics_begin(moe_metrics *m, const char *event) {
    if (!m)
        return;
    fputs("{\"event\":", m->f);
    moe_json_write_string(m->f, event);
}

void moe_metrics_num(moe_metrics *m, const char *key, double value) {
    if (!m)
        return;
    fputc(',', m->f);
    moe_json_write_string(m->f, key);
    if (isfinite(value)) {
        /* the shorter of 15 and 17 significant digits that reads back as the same double:
         * typed values stay short (0.001), and a value that needs all its bits gets them, so
         * two runs compare bit for bit (the resume tests compare losses this way) */
        char text[32];
        snprintf(text, sizeof text, "%.15g", value);
        if (strtod(text, NULL) != value)
            snprintf(text, sizeof text, "%.17g", value);
        fprintf(m->f, ":%s", text);
    } else
        fputs(":null", m->f);
}

void moe_metrics_int(moe_metrics *m, const char *key, long long value) {
    if (!m)
        return;
    fputc(',', m->f);
    moe_json_write_string(m->f, key);
    fprintf(m->f, ":%lld", value);
}

void moe_metrics_str(moe_metrics *m, const char *key, const char *value) {
    if (!m)
        return;
    fputc(',', m->f);
    moe_json_write_string(m->f, key);
    fputc(':', m->f);
    moe_json_write_string(m->f, value);
}

void moe_metrics_int_array(moe_metrics *m, const char *key, const long long *v, int n) {
    if (!m)
        return;
    fputc(',', m->f);
    moe_json_write_string(m->f, key);
    fputs(":[", m->f);
    for (int i = 0; i < n; i++)
        fprintf(m->f, i ? ",%lld" : "%lld", v[i]);
    fputc(']', m->f);
}

void moe_metrics_end(moe_metrics *m) {
    if (!m)
        return;
    fputs("}\n", m->f);
    fflush(m->f);
}

void moe_metrics_close(moe_metrics *m) {
    if (!m)
        return;
    fclose(m->f);
    free(m);
}
