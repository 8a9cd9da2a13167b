/* Error values: see error.h. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

moe_status moe_error_set(moe_error *err, moe_status code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

void moe_error_clear(moe_error *err) {
    if (err) {
        err->code = MOE_OK;
        err->msg[0] = '\0';
    }
}

const char *moe_status_name(moe_status code) {
    switch (code) {
    case MOE_OK: return "ok";
    case MOE_ERR_CONFIG: return "configuration error";
    case MOE_ERR_FLAG: return "flag error";
    case MOE_ERR_IO: return "I/O error";
    case MOE_ERR_DATA: return "data error";
    case MOE_ERR_NOMEM: return "out of memory";
    case MOE_ERR_BACKEND: return "backend error";
    case MOE_ERR_HELP: return "help";
    case MOE_ERR_NONFINITE: return "non-finite value";
    }
    return "unknown error";
}

void moe_fatal_oom(const char *what, size_t bytes, const char *file, int line) {
    fprintf(stderr,
            "error: out of memory: %s needs %.3g GB while a step runs (%s:%d); free memory on "
            "this machine, or reduce --micro-batch-size or --seq-length (or the model: "
            "--hidden-size, --num-experts, --moe-ffn-hidden-size)\n",
            what, (double)bytes / 1e9, file, line);
    fflush(stderr);
    exit(1);
}
