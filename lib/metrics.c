/* JSON-lines metrics writer: see metrics.h. */
#include "metrics.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct moe_metrics {
    int fd;
    char *path;    /* for messages */
    char *line;    /* the record being built */
    size_t len, cap;
    int oom;       /* the record could not grow: moe_metrics_end reports it */
};

moe_status moe_metrics_open(moe_metrics **out, const char *path, moe_outfile_mode mode,
                            moe_error *err) {
    *out = NULL;
    moe_metrics *m = calloc(1, sizeof *m);
    char *p = strdup(path);
    if (!m || !p) {
        free(m);
        free(p);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory opening metrics file");
    }
    moe_status s = moe_outfile_open(&m->fd, path, "metrics-file", mode, err);
    if (s != MOE_OK) {
        free(m);
        free(p);
        return s;
    }
    m->path = p;
    *out = m;
    return MOE_OK;
}

/* The JSON escape of one byte: itself, or a backslash sequence. */
static const char *json_escape(unsigned char c, char buf[8]) {
    if (c == '"' || c == '\\')
        snprintf(buf, 8, "\\%c", c);
    else if (c == '\n')
        return "\\n";
    else if (c == '\t')
        return "\\t";
    else if (c < 0x20)
        snprintf(buf, 8, "\\u%04x", c);
    else {
        buf[0] = (char)c;
        buf[1] = '\0';
    }
    return buf;
}

void moe_json_write_string(FILE *f, const char *s) {
    char buf[8];
    fputc('"', f);
    for (; *s; s++)
        fputs(json_escape((unsigned char)*s, buf), f);
    fputc('"', f);
}

/* Append printf-style text to the record. */
static void put(moe_metrics *m, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void put(moe_metrics *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || m->oom)
        return;
    if (m->len + (size_t)n + 1 > m->cap) {
        size_t cap = 2 * (m->len + (size_t)n + 1) + 256;
        char *line = realloc(m->line, cap);
        if (!line) {
            m->oom = 1;
            return;
        }
        m->line = line;
        m->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(m->line + m->len, m->cap - m->len, fmt, ap);
    va_end(ap);
    m->len += (size_t)n;
}

static void put_string(moe_metrics *m, const char *s) {
    char buf[8];
    put(m, "\"");
    for (; *s; s++)
        put(m, "%s", json_escape((unsigned char)*s, buf));
    put(m, "\"");
}

static void put_key(moe_metrics *m, const char *key) {
    put(m, ",");
    put_string(m, key);
    put(m, ":");
}

void moe_metrics_begin(moe_metrics *m, const char *event) {
    if (!m)
        return;
    m->len = 0;
    m->oom = 0;
    put(m, "{\"event\":");
    put_string(m, event);
}

void moe_metrics_num(moe_metrics *m, const char *key, double value) {
    if (!m)
        return;
    put_key(m, key);
    if (isfinite(value)) {
        /* the shorter of 15 and 17 significant digits that reads back as the same double:
         * typed values stay short (0.001), and a value that needs all its bits gets them, so
         * two runs compare bit for bit (the resume tests compare losses this way) */
        char text[32];
        snprintf(text, sizeof text, "%.15g", value);
        if (strtod(text, NULL) != value)
            snprintf(text, sizeof text, "%.17g", value);
        put(m, "%s", text);
    } else
        put(m, "null");
}

void moe_metrics_int(moe_metrics *m, const char *key, long long value) {
    if (!m)
        return;
    put_key(m, key);
    put(m, "%lld", value);
}

void moe_metrics_str(moe_metrics *m, const char *key, const char *value) {
    if (!m)
        return;
    put_key(m, key);
    put_string(m, value);
}

void moe_metrics_int_array(moe_metrics *m, const char *key, const long long *v, int n) {
    if (!m)
        return;
    put_key(m, key);
    put(m, "[");
    for (int i = 0; i < n; i++)
        put(m, i ? ",%lld" : "%lld", v[i]);
    put(m, "]");
}

moe_status moe_metrics_end(moe_metrics *m, moe_error *err) {
    if (!m)
        return MOE_OK;
    put(m, "}\n");
    if (m->oom)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory building a metrics record for "
                             "'%s' (--metrics-file)", m->path);
    /* the whole line in one write: see the top of metrics.h */
    moe_status s = moe_outfile_write(m->fd, m->line, m->len, m->path, "metrics-file", err);
    m->len = 0;
    return s;
}

void moe_metrics_close(moe_metrics *m) {
    if (!m)
        return;
    close(m->fd);
    free(m->line);
    free(m->path);
    free(m);
}
