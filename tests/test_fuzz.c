/* The flag fuzzer (issue #11 §1): thousands of random, seeded command lines, extreme values
 * included, thrown at parsing and validation. Nothing may crash (this suite also runs under
 * AddressSanitizer/UBSan in `make test`), every refusal must be a named error (a message
 * that names a flag), and every configuration that is accepted must have sizes that fit:
 * its memory estimate is computed without overflow, and the small ones are really built
 * and run one forward and backward.
 *
 * The flags come from the flag table itself, so a flag added tomorrow is fuzzed too. A
 * failure prints the seed's case number and its command line: rerun it by hand with
 * bin/moe-train. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "config.h"
#include "helpers.h"
#include "memory.h"
#include "model.h"
#include "moe/capacity.h"
#include "suites.h"

/* splitmix64: a seeded stream, the same on every machine */
static uint64_t next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int pick(uint64_t *s, int n) { return (int)(next(s) % (uint64_t)n); }
static double unit(uint64_t *s) { return (double)(next(s) >> 11) / 9007199254740992.0; }

static const char *const INTS[] = {
    "0", "1", "-1", "2", "3", "4", "6", "7", "8", "16", "32", "64", "100", "128", "255", "256",
    "257", "1023", "1024", "4096", "65536", "1000000", "2147483647", "-2147483648",
    "2147483648", "99999999999", "9223372036854775807", "-9223372036854775809", "abc", "",
    "1e3", "0x10", " 5", "5 ", "--", "1.5"};
static const char *const DOUBLES[] = {
    "nan", "-nan", "inf", "-inf", "infinity", "1e308", "-1e308", "1e400", "-1e400", "1e-308",
    "1e-320", "0", "-0", "1", "-1", "0.5", "2", "10", "1e30", "1e-30", "5e6", "1e7", "0x1p3",
    "abc", "", "1e", ".", "3.4e38", "1.0000001", "0.999999"};
static const char *const LAYER_FREQ[] = {"1", "2", "3", "0", "-1", "0,1", "1,0,1,1", "[1,1,1,1]",
                                         "[0,1]", "x", "", "1,,1", "99999999999", "1,1,1,1,1"};
/* a small model most cases start from, so that many accepted configurations are small
 * enough to build */
static const char TINY[] =
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --num-query-groups 1 "
    "--ffn-hidden-size 16 --num-experts 4 --moe-ffn-hidden-size 8 --seq-length 8 "
    "--micro-batch-size 2 --global-batch-size 2";

/* One random value for @p f, written into @p out. */
static void random_value(uint64_t *s, const moe_flag *f, char *out, size_t cap) {
    switch (f->type) {
    case MOE_FLAG_INT:
    case MOE_FLAG_INT64:
        if (pick(s, 3) == 0)
            snprintf(out, cap, "%d", pick(s, 300) - 10);
        else
            snprintf(out, cap, "%s", INTS[pick(s, (int)(sizeof INTS / sizeof *INTS))]);
        return;
    case MOE_FLAG_DOUBLE:
        if (pick(s, 3) == 0) /* a finite number over many orders of magnitude, either sign */
            snprintf(out, cap, "%.17g",
                     (pick(s, 4) ? 1 : -1) * pow(10.0, 24 * unit(s) - 12));
        else
            snprintf(out, cap, "%s", DOUBLES[pick(s, (int)(sizeof DOUBLES / sizeof *DOUBLES))]);
        return;
    case MOE_FLAG_BOOL:
        snprintf(out, cap, "%s", (const char *[]){"true", "false", "1", "0", "2", "yes"}[pick(s, 6)]);
        return;
    case MOE_FLAG_CHOICE: {
        /* one of its choices, mostly; sometimes garbage */
        const char *c = f->choices;
        int n = 1;
        for (const char *p = c; *p; p++)
            n += *p == '|';
        int want = pick(s, n + 1);
        if (want == n) {
            snprintf(out, cap, "nonsense");
            return;
        }
        for (int i = 0; i < want; i++)
            c = strchr(c, '|') + 1;
        size_t len = strchr(c, '|') ? (size_t)(strchr(c, '|') - c) : strlen(c);
        snprintf(out, cap, "%.*s", (int)len, c);
        return;
    }
    case MOE_FLAG_STRING:
        if (!strcmp(f->name, "moe-layer-freq"))
            snprintf(out, cap, "%s", LAYER_FREQ[pick(s, (int)(sizeof LAYER_FREQ / sizeof *LAYER_FREQ))]);
        else
            snprintf(out, cap, "fuzz-%d", pick(s, 100)); /* validation never opens a path */
        return;
    }
}

/* A command line: the tiny model (mostly), then 1..10 random flags. */
static int random_args(uint64_t *s, char store[][96], char **argv, int cap, const moe_flag *flags,
                       int nflags) {
    int argc = 0;
    argv[argc++] = "moe-train";
    if (pick(s, 4) != 0) {
        char tiny[sizeof TINY];
        memcpy(tiny, TINY, sizeof TINY);
        for (char *tok = strtok(tiny, " "); tok; tok = strtok(NULL, " ")) {
            snprintf(store[argc], 96, "%s", tok);
            argv[argc] = store[argc];
            argc++;
        }
    }
    const int n = 1 + pick(s, 10);
    for (int i = 0; i < n && argc + 2 < cap; i++) {
        const moe_flag *f = &flags[pick(s, nflags)];
        char value[64];
        random_value(s, f, value, sizeof value);
        if (f->type == MOE_FLAG_BOOL && pick(s, 2)) /* the bare switch, or --no-switch */
            snprintf(store[argc], 96, pick(s, 2) ? "--%s" : "--no-%s", f->name);
        else if (pick(s, 2)) {
            snprintf(store[argc], 96, "--%s=%s", f->name, value);
        } else {
            snprintf(store[argc], 96, "--%s", f->name);
            argv[argc] = store[argc];
            argc++;
            snprintf(store[argc], 96, "%s", value);
        }
        argv[argc] = store[argc];
        argc++;
    }
    return argc;
}

static void describe(char *out, size_t cap, int argc, char **argv) {
    out[0] = '\0';
    for (int i = 1; i < argc; i++)
        snprintf(out + strlen(out), cap - strlen(out), " '%s'", argv[i]);
}

/* One forward and backward of an accepted small configuration on the CPU. */
static void build_and_run(const moe_config *c) {
    moe_model *m = NULL;
    moe_error err;
    const moe_backend *be = moe_backend_cpu();
    moe_status st = moe_model_create(&m, c, be, c->micro_batch_size, NULL, &err);
    ck_assert_msg(st == MOE_OK, "an accepted configuration could not be built: %s", err.msg);
    moe_model_init(m, 7);
    const int B = c->micro_batch_size, T = c->seq_length;
    int *tok = malloc(sizeof(int) * (size_t)B * T), *tgt = malloc(sizeof(int) * (size_t)B * T);
    ck_assert(tok && tgt);
    for (int i = 0; i < B * T; i++) {
        tok[i] = i % c->vocab_size;
        tgt[i] = (i * 7 + 1) % c->vocab_size;
    }
    moe_model_zero_grad(m);
    moe_model_forward(m, tok, tgt, B, T);
    moe_model_backward(m, 1.0);
    free(tok);
    free(tgt);
    moe_model_free(m);
}

START_TEST(test_fuzz_flags) {
    int nflags;
    const moe_flag *flags = moe_config_flags(&nflags);
    const int cases = 4000;
    int accepted = 0, built = 0, refused_flag = 0, refused_config = 0;
    uint64_t seed = 0x11EA5EEDull;
    for (int i = 0; i < cases; i++) {
        char store[64][96];
        char *argv[64];
        int argc = random_args(&seed, store, argv, 64, flags, nflags);
        char line[4096];
        describe(line, sizeof line, argc, argv);
        moe_config c;
        moe_error err;
        moe_error_clear(&err);
        moe_config_defaults(&c);
        moe_status s = moe_config_parse(&c, argc, argv, &err);
        if (s == MOE_OK) {
            c.vocab_size = (int[]){2, 65, 256}[pick(&seed, 3)];
            s = moe_config_validate(&c, &err);
        }
        ck_assert_msg(s == MOE_OK || s == MOE_ERR_FLAG || s == MOE_ERR_CONFIG,
                      "case %d:%s: unexpected status %d (%s)", i, line, s, err.msg);
        if (s != MOE_OK) {
            /* a named error: says which flag, and says it in more than a word */
            ck_assert_msg(strstr(err.msg, "--") != NULL && strlen(err.msg) > 20,
                          "case %d:%s: refusal names no flag: '%s'", i, line, err.msg);
            ck_assert_int_eq(err.code, s);
            if (s == MOE_ERR_FLAG)
                refused_flag++;
            else
                refused_config++;
            continue;
        }
        accepted++;
        /* what is accepted has sizes that fit */
        moe_memory_estimate est;
        ck_assert_msg(moe_memory_estimate_model(&c, c.micro_batch_size, 1, sizeof(float), &est,
                                                &err) == MOE_OK,
                      "case %d:%s: accepted but its sizes overflow: %s", i, line, err.msg);
        ck_assert(est.total_bytes > 0 && est.largest <= 2147483647LL);
        if (c.num_experts > 0 && c.moe_expert_capacity_factor > 0) {
            const int N = c.micro_batch_size * c.seq_length;
            const int cap = moe_expert_capacity(N, c.moe_router_topk, c.num_experts,
                                                c.moe_expert_capacity_factor);
            ck_assert_msg(cap >= 0 && cap <= N, "case %d:%s: capacity %d", i, line, cap);
        }
        moe_config_warnings_t w;
        moe_config_warnings(&c, &w);
        ck_assert(w.n >= 0 && w.n <= MOE_MAX_WARNINGS);
        /* small ones are built and run: validation's yes must mean the model works */
        if (est.total_bytes < (4 << 20) && built < 40) {
            build_and_run(&c);
            built++;
        }
    }
    /* the fuzzer must reach every outcome, or it tests less than it claims */
    ck_assert_msg(accepted > 100 && refused_flag > 100 && refused_config > 100 && built >= 20,
                  "accepted %d (built %d), refused as flag %d, as config %d", accepted, built,
                  refused_flag, refused_config);
}
END_TEST

Suite *suite_fuzz(void) {
    Suite *s = suite_create("fuzz");
    const TTest *tests[] = {test_fuzz_flags};
    moe_test_tcase(s, "flags", 300, tests, 1);
    return s;
}
