/* Core unit tests: the counter-based RNG, error values, the metrics writer, the parameter
 * table, the optimizer (schedule, clipping, AdamW) and the timer. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "bench.h"
#include "config.h"
#include "error.h"
#include "helpers.h"
#include "metrics.h"
#include "optimizer.h"
#include "params.h"
#include "real.h"
#include "rng.h"
#include "step_flags.h"
#include "suites.h"
#include "timer.h"

/* ------------------------------------------------------------------ Philox4x32-10 */

/* Known-answer vectors from Random123's kat_vectors (philox4x32_10). The key is
 * given as {k0, k1}; moe_philox4x32 takes it as one uint64 with k0 in the low half. */
static void check_philox_kat(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                             uint32_t k1, uint32_t e0, uint32_t e1, uint32_t e2, uint32_t e3) {
    moe_u32x4 ctr = {{c0, c1, c2, c3}};
    uint64_t key = ((uint64_t)k1 << 32) | k0;
    moe_u32x4 r = moe_philox4x32(ctr, key);
    ck_assert_msg(r.v[0] == e0 && r.v[1] == e1 && r.v[2] == e2 && r.v[3] == e3,
                  "philox4x32_10 ctr={%08x,%08x,%08x,%08x} key={%08x,%08x}: got "
                  "{%08x,%08x,%08x,%08x}, expected {%08x,%08x,%08x,%08x}",
                  c0, c1, c2, c3, k0, k1, r.v[0], r.v[1], r.v[2], r.v[3], e0, e1, e2, e3);
}

START_TEST(test_philox_kat_zero) {
    check_philox_kat(0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
}
END_TEST

START_TEST(test_philox_kat_ones) {
    check_philox_kat(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu,
                     0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu);
}
END_TEST

START_TEST(test_philox_kat_pi) {
    check_philox_kat(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u,
                     0x299f31d0u, 0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
}
END_TEST

START_TEST(test_rng_bits_layout) {
    /* moe_rng_bits is philox on the counter {index lo, index hi, stream lo, stream hi}. */
    uint64_t seed = 0x0123456789abcdefull, stream = 0xfedcba9876543210ull,
             index = 0x1122334455667788ull;
    moe_u32x4 c = {{0x55667788u, 0x11223344u, 0x76543210u, 0xfedcba98u}};
    moe_u32x4 a = moe_rng_bits(seed, stream, index), b = moe_philox4x32(c, seed);
    ck_assert(memcmp(&a, &b, sizeof a) == 0);
}
END_TEST

/* ------------------------------------------------------------------ normal / uniform */

START_TEST(test_rng_normal_moments) {
    const int n = 200000;
    double s = 0.0, ss = 0.0;
    int within1 = 0;
    for (int i = 0; i < n; i++) {
        double x = moe_rng_normal(42, 7, (uint64_t)i);
        ck_assert(isfinite(x));
        s += x;
        ss += x * x;
        within1 += fabs(x) < 1.0;
    }
    double mean = s / n, var = ss / n - mean * mean;
    ck_assert_msg(fabs(mean) < 0.01, "normal mean %g not ~0", mean);
    ck_assert_msg(fabs(var - 1.0) < 0.02, "normal variance %g not ~1", var);
    /* P(|x| < 1) = 0.682689 for a standard normal. */
    double frac = (double)within1 / n;
    ck_assert_msg(fabs(frac - 0.682689) < 0.005, "P(|x|<1) = %g, expected 0.6827", frac);
}
END_TEST

START_TEST(test_rng_pure_function) {
    double a = moe_rng_normal(1337, 99, 12345);
    ck_assert(a == moe_rng_normal(1337, 99, 12345));
    ck_assert(a == moe_rng_normal(1337, 99, 12345));
    ck_assert(a != moe_rng_normal(1337, 99, 12346)); /* other index */
    ck_assert(a != moe_rng_normal(1337, 98, 12345)); /* other stream */
    ck_assert(a != moe_rng_normal(1338, 99, 12345)); /* other seed */
    /* the high halves of index, stream and seed matter too */
    ck_assert(a != moe_rng_normal(1337, 99, 12345 + (1ull << 32)));
    ck_assert(a != moe_rng_normal(1337, 99 + (1ull << 32), 12345));
    ck_assert(a != moe_rng_normal(1337 + (1ull << 32), 99, 12345));
    double u = moe_rng_uniform(5, 6, 7);
    ck_assert(u == moe_rng_uniform(5, 6, 7));
    ck_assert(u != moe_rng_uniform(5, 6, 8));
}
END_TEST

START_TEST(test_rng_uniform_open_interval) {
    ck_assert(moe_u32_to_unit(0) > 0.0);
    ck_assert(moe_u32_to_unit(0xffffffffu) < 1.0);
    ck_assert(moe_u32_to_unit(0x80000000u) > 0.5 && moe_u32_to_unit(0x7fffffffu) < 0.5);
    const int n = 100000;
    double s = 0.0, lo = 1.0, hi = 0.0;
    for (int i = 0; i < n; i++) {
        double u = moe_rng_uniform(3, 4, (uint64_t)i);
        ck_assert_msg(u > 0.0 && u < 1.0, "uniform %g outside (0,1) at %d", u, i);
        s += u;
        if (u < lo)
            lo = u;
        if (u > hi)
            hi = u;
    }
    ck_assert_msg(fabs(s / n - 0.5) < 0.005, "uniform mean %g", s / n);
    ck_assert(lo < 0.001 && hi > 0.999);
}
END_TEST

/* ------------------------------------------------------------------ errors */

START_TEST(test_error_set_clear) {
    moe_error err;
    moe_error_clear(&err);
    ck_assert_int_eq(err.code, MOE_OK);
    ck_assert_str_eq(err.msg, "");
    moe_status s = moe_error_set(&err, MOE_ERR_IO, "cannot open '%s' (%d)", "x.txt", 42);
    ck_assert_int_eq(s, MOE_ERR_IO);
    ck_assert_int_eq(err.code, MOE_ERR_IO);
    ck_assert_str_eq(err.msg, "cannot open 'x.txt' (42)");
    moe_error_clear(&err);
    ck_assert_int_eq(err.code, MOE_OK);
    ck_assert_str_eq(err.msg, "");
    /* NULL is allowed: the code still comes back */
    ck_assert_int_eq(moe_error_set(NULL, MOE_ERR_DATA, "dropped %d", 1), MOE_ERR_DATA);
    moe_error_clear(NULL);
    /* an overlong message is truncated, not overflowed */
    char *big = malloc(4000);
    ck_assert_ptr_nonnull(big);
    memset(big, 'a', 3999);
    big[3999] = '\0';
    moe_error_set(&err, MOE_ERR_CONFIG, "%s", big);
    free(big);
    ck_assert_uint_eq(strlen(err.msg), MOE_ERROR_MSG_LEN - 1);
}
END_TEST

START_TEST(test_status_names) {
    const moe_status all[] = {MOE_OK,        MOE_ERR_CONFIG,  MOE_ERR_FLAG, MOE_ERR_IO,
                              MOE_ERR_DATA,  MOE_ERR_NOMEM,   MOE_ERR_BACKEND, MOE_ERR_HELP,
                              MOE_ERR_NONFINITE};
    const int n = (int)(sizeof all / sizeof all[0]);
    ck_assert_str_eq(moe_status_name(MOE_OK), "ok");
    ck_assert_str_eq(moe_status_name(MOE_ERR_IO), "I/O error");
    for (int i = 0; i < n; i++) {
        const char *a = moe_status_name(all[i]);
        ck_assert_ptr_nonnull(a);
        ck_assert_uint_gt(strlen(a), 0);
        ck_assert_str_ne(a, "unknown error");
        for (int j = 0; j < i; j++)
            ck_assert_str_ne(a, moe_status_name(all[j]));
    }
    ck_assert_str_eq(moe_status_name((moe_status)99), "unknown error");
}
END_TEST

static int g_try_calls;

static moe_status try_step(int fail, moe_error *err) {
    g_try_calls++;
    if (fail)
        return moe_error_set(err, MOE_ERR_DATA, "step %d failed", g_try_calls);
    return MOE_OK;
}

/* Runs three steps through MOE_TRY; step @p fail_at (or none when -1) fails. */
static moe_status try_chain(int fail_at, moe_error *err) {
    for (int i = 0; i < 3; i++)
        MOE_TRY(try_step(i == fail_at, err));
    return MOE_OK;
}

START_TEST(test_moe_try) {
    moe_error err;
    moe_error_clear(&err);
    g_try_calls = 0;
    ck_assert_int_eq(try_chain(-1, &err), MOE_OK);
    ck_assert_int_eq(g_try_calls, 3);
    ck_assert_int_eq(err.code, MOE_OK);
    g_try_calls = 0;
    ck_assert_int_eq(try_chain(1, &err), MOE_ERR_DATA);
    ck_assert_int_eq(g_try_calls, 2); /* the third step never ran */
    ck_assert_int_eq(err.code, MOE_ERR_DATA);
    ck_assert_str_eq(err.msg, "step 2 failed");
    g_try_calls = 0;
    ck_assert_int_eq(try_chain(0, NULL), MOE_ERR_DATA);
    ck_assert_int_eq(g_try_calls, 1);
}
END_TEST

/* ------------------------------------------------------------------ metrics */

/* Read a whole file into a malloc'd, zero-terminated buffer. */
static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot reopen %s", path);
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    ck_assert_ptr_nonnull(buf);
    size_t got;
    while ((got = fread(buf + len, 1, cap - 1 - len, f)) > 0) {
        len += got;
        if (len + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert_ptr_nonnull(buf);
        }
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

START_TEST(test_metrics_records) {
    char path[512];
    moe_test_tmp_path(path, sizeof path, "metrics.jsonl");
    moe_metrics *m = NULL;
    moe_error err;
    moe_error_clear(&err);
    ck_assert_int_eq(moe_metrics_open(&m, path, MOE_OUTFILE_OVERWRITE, &err), MOE_OK);
    ck_assert_ptr_nonnull(m);

    const long long counts[] = {1, 2, 30, -4};
    moe_metrics_begin(m, "train");
    moe_metrics_int(m, "step", 10);
    moe_metrics_num(m, "loss", 2.5);
    moe_metrics_num(m, "lr", 0.001);
    moe_metrics_num(m, "nan", NAN);
    moe_metrics_num(m, "inf", -INFINITY);
    moe_metrics_int_array(m, "counts", counts, 4);
    ck_assert_int_eq(moe_metrics_end(m, NULL), MOE_OK);

    moe_metrics_begin(m, "sample");
    moe_metrics_str(m, "text", "say \"hi\"\nback\\slash\ttab\x01");
    moe_metrics_int(m, "neg", -5);
    moe_metrics_int(m, "big", 123456789012345LL);
    moe_metrics_int_array(m, "empty", counts, 0);
    moe_metrics_num(m, "third", 1.0 / 3.0);
    ck_assert_int_eq(moe_metrics_end(m, NULL), MOE_OK);

    moe_metrics_begin(m, "qu\"ote");
    ck_assert_int_eq(moe_metrics_end(m, NULL), MOE_OK);
    moe_metrics_close(m);

    const char *expected =
        "{\"event\":\"train\",\"step\":10,\"loss\":2.5,\"lr\":0.001,\"nan\":null,\"inf\":null,"
        "\"counts\":[1,2,30,-4]}\n"
        "{\"event\":\"sample\",\"text\":\"say \\\"hi\\\"\\nback\\\\slash\\ttab\\u0001\","
        "\"neg\":-5,\"big\":123456789012345,\"empty\":[],\"third\":0.33333333333333331}\n"
        "{\"event\":\"qu\\\"ote\"}\n";
    char *got = slurp(path);
    unlink(path);
    ck_assert_msg(strcmp(got, expected) == 0, "metrics file:\n%s\nexpected:\n%s", got, expected);
    free(got);

    /* a NULL writer is a no-op everywhere */
    moe_metrics_begin(NULL, "x");
    moe_metrics_num(NULL, "a", 1.0);
    moe_metrics_int(NULL, "b", 1);
    moe_metrics_str(NULL, "c", "d");
    moe_metrics_int_array(NULL, "e", counts, 2);
    ck_assert_int_eq(moe_metrics_end(NULL, NULL), MOE_OK);
    moe_metrics_close(NULL);
}
END_TEST

START_TEST(test_metrics_truncates) {
    char path[512];
    moe_test_tmp_path(path, sizeof path, "metrics_trunc.jsonl");
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("old content that must disappear\n", f);
    fclose(f);
    moe_metrics *m = NULL;
    /* without --overwrite an existing file is refused, and left as it was */
    moe_error err;
    ck_assert_int_eq(moe_metrics_open(&m, path, MOE_OUTFILE_NEW, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(err.msg, "--overwrite") != NULL, "%s", err.msg);
    char *kept = slurp(path);
    ck_assert_str_eq(kept, "old content that must disappear\n");
    free(kept);
    ck_assert_int_eq(moe_metrics_open(&m, path, MOE_OUTFILE_OVERWRITE, NULL), MOE_OK);
    moe_metrics_begin(m, "e");
    ck_assert_int_eq(moe_metrics_end(m, NULL), MOE_OK);
    moe_metrics_close(m);
    char *got = slurp(path);
    unlink(path);
    ck_assert_str_eq(got, "{\"event\":\"e\"}\n");
    free(got);
}
END_TEST

START_TEST(test_metrics_bad_dir) {
    const char *path = "/nonexistent_moe_dir_4242/sub/metrics.jsonl";
    moe_metrics *m = (moe_metrics *)&m; /* must be reset to NULL on failure */
    moe_error err;
    moe_error_clear(&err);
    ck_assert_int_eq(moe_metrics_open(&m, path, MOE_OUTFILE_NEW, &err), MOE_ERR_IO);
    ck_assert_ptr_null(m);
    ck_assert_int_eq(err.code, MOE_ERR_IO);
    ck_assert_msg(strstr(err.msg, path) != NULL, "message does not name the path: %s", err.msg);
    ck_assert_msg(strstr(err.msg, "--metrics-file") != NULL, "message does not name the flag: %s",
                  err.msg);
}
END_TEST

/* ------------------------------------------------------------------ benchmark flags */

START_TEST(test_bench_parse_ints) {
    int v[3];
    ck_assert_int_eq(moe_bench_parse_ints("1024,4096", v, 3), 2);
    ck_assert_int_eq(v[0], 1024);
    ck_assert_int_eq(v[1], 4096);
    ck_assert_int_eq(moe_bench_parse_ints("7", v, 3), 1);
    ck_assert_int_eq(v[0], 7);
    /* refused: empty, a word, zero, negative, a trailing comma or space, too large, too many */
    const char *bad[] = {"", "abc", "0", "-4", "16,", "16 ", "16x", "99999999", "1,2,3,4"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        ck_assert_msg(moe_bench_parse_ints(bad[i], v, 3) == -1, "'%s' was accepted", bad[i]);
}
END_TEST

/* ------------------------------------------------------------------ parameter table */

START_TEST(test_params_table_layout) {
    moe_param_table pt = {0};
    ck_assert_uint_eq(moe_params_add(&pt, "emb", 2, 65, 16, 999, MOE_INIT_NORMAL, 0.02, 1), 0);
    ck_assert_uint_eq(moe_params_add(&pt, "norm", 1, 16, 77, 88, MOE_INIT_ONES, 0.0, 0), 65 * 16);
    ck_assert_uint_eq(moe_params_add(&pt, "experts", 3, 4, 8, 16, MOE_INIT_NORMAL, 0.01, 1),
                      65 * 16 + 16);
    /* enough tensors to force the table to grow past its first allocation */
    char name[32];
    for (int i = 0; i < 100; i++) {
        snprintf(name, sizeof name, "bias.%d", i);
        moe_params_add(&pt, name, 1, i + 1, 0, 0, MOE_INIT_ZEROS, 0.0, 0);
    }
    ck_assert_int_eq(pt.n, 103);
    size_t expect = 0;
    for (int i = 0; i < pt.n; i++) {
        const moe_tensor *t = &pt.t[i];
        ck_assert_msg(t->offset == expect, "%s at offset %zu, expected %zu", t->name, t->offset,
                      expect);
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++)
            numel *= (size_t)t->shape[d];
        ck_assert_uint_eq(t->numel, numel);
        expect += t->numel;
    }
    ck_assert_uint_eq(pt.total, expect);

    const moe_tensor *e = moe_params_find(&pt, "experts");
    ck_assert_ptr_nonnull(e);
    ck_assert_str_eq(e->name, "experts");
    ck_assert_int_eq(e->ndim, 3);
    ck_assert_int_eq(e->shape[0], 4);
    ck_assert_int_eq(e->shape[1], 8);
    ck_assert_int_eq(e->shape[2], 16);
    ck_assert_uint_eq(e->numel, 512);
    ck_assert_int_eq(e->init, MOE_INIT_NORMAL);
    ck_assert(e->std == 0.01);
    ck_assert_int_eq(e->decay, 1);
    const moe_tensor *nrm = moe_params_find(&pt, "norm");
    ck_assert_ptr_nonnull(nrm);
    ck_assert_int_eq(nrm->ndim, 1);
    ck_assert_uint_eq(nrm->numel, 16); /* trailing sizes of a 1-D tensor are ignored */
    ck_assert_int_eq(nrm->decay, 0);
    ck_assert_ptr_nonnull(moe_params_find(&pt, "bias.99"));
    ck_assert_uint_eq(moe_params_find(&pt, "bias.99")->numel, 100);
    ck_assert_ptr_null(moe_params_find(&pt, "missing"));
    ck_assert_ptr_null(moe_params_find(&pt, "emb2"));
    moe_params_free(&pt);
    ck_assert_ptr_null(pt.t);
    ck_assert_int_eq(pt.n, 0);
    ck_assert_uint_eq(pt.total, 0);
}
END_TEST

START_TEST(test_hash_name_fnv1a) {
    /* published FNV-1a 64-bit test values */
    ck_assert_msg(moe_hash_name("") == 0xcbf29ce484222325ull,
                  "FNV-1a of \"\" is %016llx, expected the offset basis cbf29ce484222325 "
                  "(14695981039346656037)",
                  (unsigned long long)moe_hash_name(""));
    ck_assert(moe_hash_name("a") == 0xaf63dc4c8601ec8cull);
    ck_assert(moe_hash_name("foobar") == 0x85944171f73967e8ull);
    ck_assert(moe_hash_name("layers.0.attn.wq") != moe_hash_name("layers.0.attn.wk"));
}
END_TEST

START_TEST(test_params_init_kinds) {
    const int big = 200000;
    moe_param_table pt = {0};
    moe_params_add(&pt, "ones", 1, 37, 0, 0, MOE_INIT_ONES, 0.0, 0);
    moe_params_add(&pt, "zeros", 2, 5, 7, 0, MOE_INIT_ZEROS, 0.0, 0);
    moe_params_add(&pt, "w", 2, big / 100, 100, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "w_wide", 1, 20000, 0, 0, MOE_INIT_NORMAL, 1.5, 1);
    moe_real *p = malloc(sizeof *p * pt.total);
    ck_assert_ptr_nonnull(p);
    moe_test_poison(p, pt.total);
    moe_params_init(&pt, p, 1337);

    const moe_tensor *t = moe_params_find(&pt, "ones");
    for (size_t j = 0; j < t->numel; j++)
        ck_assert(p[t->offset + j] == 1.0f);
    t = moe_params_find(&pt, "zeros");
    for (size_t j = 0; j < t->numel; j++)
        ck_assert(p[t->offset + j] == 0.0f);

    const struct {
        const char *name;
        double std, tol;
    } cases[] = {{"w", 0.02, 0.01}, {"w_wide", 1.5, 0.03}};
    for (int c = 0; c < 2; c++) {
        t = moe_params_find(&pt, cases[c].name);
        double s = 0.0, ss = 0.0;
        for (size_t j = 0; j < t->numel; j++) {
            double x = p[t->offset + j];
            ck_assert(isfinite(x));
            s += x;
            ss += x * x;
        }
        double mean = s / (double)t->numel;
        double sd = sqrt(ss / (double)t->numel - mean * mean);
        ck_assert_msg(fabs(sd / cases[c].std - 1.0) < cases[c].tol, "%s: std %g, asked for %g",
                      cases[c].name, sd, cases[c].std);
        ck_assert_msg(fabs(mean) < 5.0 * cases[c].std / sqrt((double)t->numel), "%s: mean %g",
                      cases[c].name, mean);
        /* the contract: element j is std * normal(seed, hash(name), j), rounded to moe_real */
        uint64_t stream = moe_hash_name(t->name);
        for (size_t j = 0; j < t->numel; j += 997)
            ck_assert(p[t->offset + j] ==
                      (moe_real)(cases[c].std * moe_rng_normal(1337, stream, j)));
    }
    free(p);
    moe_params_free(&pt);
}
END_TEST

START_TEST(test_params_init_deterministic_by_name) {
    /* Table A: "a" then "w"; table B: "w" then "b" then "c". "w" sits at different offsets. */
    moe_param_table a = {0}, b = {0};
    moe_params_add(&a, "a", 1, 100, 0, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&a, "w", 2, 30, 40, 0, MOE_INIT_NORMAL, 0.05, 1);
    moe_params_add(&b, "w", 2, 30, 40, 0, MOE_INIT_NORMAL, 0.05, 1);
    moe_params_add(&b, "b", 1, 50, 0, 0, MOE_INIT_NORMAL, 0.05, 1);
    moe_params_add(&b, "c", 2, 30, 40, 0, MOE_INIT_NORMAL, 0.05, 1);
    moe_real *pa = malloc(sizeof *pa * a.total), *pa2 = malloc(sizeof *pa2 * a.total);
    moe_real *pb = malloc(sizeof *pb * b.total), *pa3 = malloc(sizeof *pa3 * a.total);
    ck_assert(pa && pa2 && pb && pa3);
    moe_params_init(&a, pa, 7);
    moe_params_init(&a, pa2, 7);
    moe_params_init(&b, pb, 7);
    moe_params_init(&a, pa3, 8);

    /* same seed, same table: bit-identical */
    ck_assert(memcmp(pa, pa2, sizeof *pa * a.total) == 0);
    /* other seed: different values */
    ck_assert(memcmp(pa, pa3, sizeof *pa * a.total) != 0);

    const moe_tensor *wa = moe_params_find(&a, "w"), *wb = moe_params_find(&b, "w");
    ck_assert_uint_ne(wa->offset, wb->offset);
    ck_assert(memcmp(pa + wa->offset, pb + wb->offset, sizeof *pa * wa->numel) == 0);
    /* a same-shaped tensor with another name gets other values */
    const moe_tensor *cb = moe_params_find(&b, "c");
    ck_assert(memcmp(pb + wb->offset, pb + cb->offset, sizeof *pb * wb->numel) != 0);
    free(pa);
    free(pa2);
    free(pb);
    free(pa3);
    moe_params_free(&a);
    moe_params_free(&b);
}
END_TEST

/* ------------------------------------------------------------------ learning-rate schedule */

static moe_config lr_config(const char *style, double lr, double min_lr, int warmup, int decay,
                            int train) {
    moe_config c;
    moe_config_defaults(&c);
    snprintf(c.lr_decay_style, sizeof c.lr_decay_style, "%s", style);
    c.lr = lr;
    c.min_lr = min_lr;
    c.lr_warmup_iters = warmup;
    c.lr_decay_iters = decay;
    c.train_iters = train;
    c.vocab_size = 65;
    moe_error err;
    moe_status s = moe_config_validate(&c, &err);
    ck_assert_msg(s == MOE_OK, "%s", err.msg);
    return c;
}

#define ASSERT_NEAR(a, b, tol)                                                                 \
    do {                                                                                       \
        double a_ = (a), b_ = (b);                                                             \
        ck_assert_msg(fabs(a_ - b_) <= (tol), "%s = %.12g, expected %.12g", #a, a_, b_);      \
    } while (0)

START_TEST(test_lr_warmup) {
    const double lr = 1e-3, min_lr = 1e-4;
    moe_config c = lr_config("cosine", lr, min_lr, 10, 110, 200);
    for (int s = 0; s < 10; s++)
        ASSERT_NEAR(moe_lr_at(&c, s), lr * (s + 1) / 10.0, 1e-15);
    ASSERT_NEAR(moe_lr_at(&c, 9), lr, 1e-15);
    ck_assert(moe_lr_at(&c, 0) > 0.0);
    /* warmup also applies in front of the constant and linear styles */
    moe_config k = lr_config("constant", lr, min_lr, 10, 110, 200);
    ASSERT_NEAR(moe_lr_at(&k, 4), lr * 0.5, 1e-15);
    moe_config l = lr_config("linear", lr, min_lr, 10, 110, 200);
    ASSERT_NEAR(moe_lr_at(&l, 4), lr * 0.5, 1e-15);
    /* no warmup: the first step already runs at the peak rate */
    moe_config n = lr_config("cosine", lr, min_lr, 0, 100, 200);
    ASSERT_NEAR(moe_lr_at(&n, 0), lr, 1e-15);
}
END_TEST

START_TEST(test_lr_cosine) {
    const double lr = 1e-3, min_lr = 1e-4;
    moe_config c = lr_config("cosine", lr, min_lr, 10, 110, 200);
    ASSERT_NEAR(moe_lr_at(&c, 10), lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&c, 60), (lr + min_lr) / 2, 1e-15);
    /* a quarter of the way: min + (lr-min) * (1 + cos(pi/4)) / 2 */
    ASSERT_NEAR(moe_lr_at(&c, 35), min_lr + (lr - min_lr) * 0.5 * (1.0 + sqrt(0.5)), 1e-15);
    ASSERT_NEAR(moe_lr_at(&c, 110), min_lr, 1e-15);
    ck_assert(moe_lr_at(&c, 109) > min_lr && moe_lr_at(&c, 109) < min_lr + 1e-6);
    ASSERT_NEAR(moe_lr_at(&c, 150), min_lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&c, 100000), min_lr, 1e-15);
    for (int s = 10; s < 110; s++)
        ck_assert_msg(moe_lr_at(&c, s + 1) < moe_lr_at(&c, s), "cosine not decreasing at %d", s);
}
END_TEST

START_TEST(test_lr_linear_constant) {
    const double lr = 2e-3, min_lr = 2e-4;
    moe_config l = lr_config("linear", lr, min_lr, 10, 110, 200);
    ASSERT_NEAR(moe_lr_at(&l, 10), lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&l, 35), min_lr + 0.75 * (lr - min_lr), 1e-15);
    ASSERT_NEAR(moe_lr_at(&l, 60), (lr + min_lr) / 2, 1e-15);
    ASSERT_NEAR(moe_lr_at(&l, 85), min_lr + 0.25 * (lr - min_lr), 1e-15);
    ASSERT_NEAR(moe_lr_at(&l, 110), min_lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&l, 500), min_lr, 1e-15);

    moe_config k = lr_config("constant", lr, min_lr, 10, 110, 200);
    ASSERT_NEAR(moe_lr_at(&k, 10), lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&k, 60), lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&k, 110), lr, 1e-15);
    ASSERT_NEAR(moe_lr_at(&k, 5000), lr, 1e-15);
}
END_TEST

START_TEST(test_lr_decay_iters_default) {
    /* --lr-decay-iters 0 means decay over --train-iters */
    const char *styles[] = {"cosine", "linear"};
    for (int i = 0; i < 2; i++) {
        moe_config z = lr_config(styles[i], 1e-3, 1e-4, 10, 0, 110);
        moe_config e = lr_config(styles[i], 1e-3, 1e-4, 10, 110, 110);
        for (int s = 0; s <= 120; s++)
            ck_assert_msg(moe_lr_at(&z, s) == moe_lr_at(&e, s), "%s step %d: %g vs %g", styles[i],
                          s, moe_lr_at(&z, s), moe_lr_at(&e, s));
        ASSERT_NEAR(moe_lr_at(&z, 60), 5.5e-4, 1e-15);
        ASSERT_NEAR(moe_lr_at(&z, 110), 1e-4, 1e-15);
    }
}
END_TEST

/* ------------------------------------------------------------------ gradient clipping */

START_TEST(test_clip_grad_norm) {
    moe_real g[2] = {3.0f, 4.0f};
    /* below the threshold: measured, untouched */
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, 2, 10.0) == 5.0);
    ck_assert(g[0] == 3.0f && g[1] == 4.0f);
    /* max_norm 0: measure only */
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, 2, 0.0) == 5.0);
    ck_assert(g[0] == 3.0f && g[1] == 4.0f);
    /* exactly at the threshold: untouched */
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, 2, 5.0) == 5.0);
    ck_assert(g[0] == 3.0f && g[1] == 4.0f);
    /* above: scaled to max_norm, direction kept; the norm returned is the one before */
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, 2, 1.0) == 5.0);
    ASSERT_NEAR(g[0], 0.6, 1e-6);
    ASSERT_NEAR(g[1], 0.8, 1e-6);
    double after = moe_clip_grad_norm(moe_backend_cpu(), g, 2, 0.0);
    ASSERT_NEAR(after, 1.0, 1e-6);
    ck_assert(after <= 1.0 + 1e-7);

    /* zero gradients: norm 0, nothing divides by zero */
    moe_real zero[3] = {0, 0, 0};
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), zero, 3, 1.0) == 0.0);
    ck_assert(zero[0] == 0 && zero[1] == 0 && zero[2] == 0);
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), zero, 0, 1.0) == 0.0);
}
END_TEST

START_TEST(test_clip_grad_norm_large) {
    /* more elements than one summation block, with a ragged tail */
    const size_t n = 3 * 4096 + 123;
    moe_real *g = malloc(sizeof *g * n), *orig = malloc(sizeof *orig * n);
    ck_assert(g && orig);
    moe_test_randn(g, n, 77, 0.5);
    memcpy(orig, g, sizeof *g * n);
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)g[i] * (double)g[i];
    double ref = sqrt(ss);
    double norm = moe_clip_grad_norm(moe_backend_cpu(), g, n, 0.0);
    ck_assert_msg(fabs(norm - ref) <= 1e-12 * ref, "norm %.15g, expected %.15g", norm, ref);
    ck_assert(memcmp(g, orig, sizeof *g * n) == 0);
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, n, 2.0 * ref) == norm);
    ck_assert(memcmp(g, orig, sizeof *g * n) == 0);

    double max_norm = ref / 4.0;
    ck_assert(moe_clip_grad_norm(moe_backend_cpu(), g, n, max_norm) == norm);
    for (size_t i = 0; i < n; i += 101)
        ASSERT_NEAR(g[i], orig[i] * 0.25, 1e-6 * fabs(orig[i]) + 1e-9);
    ASSERT_NEAR(moe_clip_grad_norm(moe_backend_cpu(), g, n, 0.0), max_norm, 1e-5 * max_norm);
    free(g);
    free(orig);
}
END_TEST

/* ------------------------------------------------------------------ AdamW */

START_TEST(test_adamw_first_steps) {
    moe_param_table pt = {0};
    moe_params_add(&pt, "w", 1, 4, 0, 0, MOE_INIT_NORMAL, 0.02, 1);    /* decayed */
    moe_params_add(&pt, "norm", 1, 3, 0, 0, MOE_INIT_ONES, 0.0, 0);    /* not decayed */
    const size_t n = pt.total;
    ck_assert_uint_eq(n, 7);
    moe_real p[7] = {0.5f, -0.25f, 1.0f, 2.0f, 1.0f, -0.5f, 0.75f};
    const moe_real g1[7] = {0.1f, -0.2f, 3.0f, -1e-3f, 0.5f, -0.5f, 0.0f};
    const moe_real g2[7] = {-0.3f, 0.1f, 1.0f, 2.0f, 0.25f, -1.0f, 0.5f};
    const double lr = 0.01, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;

    moe_adamw opt;
    moe_error err;
    ck_assert_int_eq(moe_adamw_init(&opt, moe_backend_cpu(), &pt, &err), MOE_OK);
    ck_assert_uint_eq(opt.n, n);
    ck_assert_int_eq(opt.step, 0);
    for (size_t i = 0; i < n; i++)
        ck_assert(opt.m[i] == 0.0f && opt.v[i] == 0.0f);

    /* reference in double, with the moments rounded to fp32 as the state stores them */
    double ref[7], m[7] = {0}, v[7] = {0};
    for (size_t i = 0; i < n; i++)
        ref[i] = p[i];

    /* step 1: bias correction makes m̂ = g and v̂ = g², so the update is g/(|g|+eps) + wd·p */
    moe_adamw_step(&opt, p, g1, NULL, lr, b1, b2, eps, wd, NULL, NULL, NULL);
    ck_assert_int_eq(opt.step, 1);
    for (size_t i = 0; i < n; i++) {
        double d = i < 4 ? wd : 0.0;
        double g = g1[i];
        double expect = ref[i] - lr * (g / (fabs(g) + eps) + d * ref[i]);
        ck_assert_msg(fabs(p[i] - expect) <= 1e-6 * fabs(expect) + 1e-9,
                      "step 1, element %zu: %.9g, expected %.9g", i, (double)p[i], expect);
        m[i] = (float)((1 - b1) * g);
        v[i] = (float)((1 - b2) * g * g);
        ck_assert(opt.m[i] == (float)m[i]);
        ck_assert_msg(fabs(opt.v[i] - v[i]) <= 1e-7 * v[i], "v[%zu]", i);
        ref[i] = p[i];
    }
    /* the non-decayed tensor with a zero gradient did not move at all */
    ck_assert(p[6] == 0.75f);
    /* a large gradient moves its parameter by about lr, whatever its size */
    ASSERT_NEAR(p[2], 1.0 - lr * (1.0 + wd * 1.0), 1e-6);
    /* the non-decayed element: exactly lr·sign(g) */
    ASSERT_NEAR(p[4], 1.0 - lr, 1e-6);

    /* step 2: general form with bias correction 1-β^2 */
    moe_adamw_step(&opt, p, g2, NULL, lr, b1, b2, eps, wd, NULL, NULL, NULL);
    ck_assert_int_eq(opt.step, 2);
    const double bc1 = 1 - b1 * b1, bc2 = 1 - b2 * b2;
    for (size_t i = 0; i < n; i++) {
        double d = i < 4 ? wd : 0.0;
        double g = g2[i];
        double mm = b1 * m[i] + (1 - b1) * g, vv = b2 * v[i] + (1 - b2) * g * g;
        double expect = ref[i] - lr * ((mm / bc1) / (sqrt(vv / bc2) + eps) + d * ref[i]);
        ck_assert_msg(fabs(p[i] - expect) <= 1e-6 * fabs(expect) + 1e-8,
                      "step 2, element %zu: %.9g, expected %.9g", i, (double)p[i], expect);
    }
    moe_adamw_free(&opt);
    ck_assert_ptr_null(opt.m);
    ck_assert_ptr_null(opt.v);
    moe_params_free(&pt);
}
END_TEST

START_TEST(test_adamw_decay_only_where_enabled) {
    /* zero gradients: the only movement is weight decay, p ← p − lr·wd·p, on decayed tensors */
    moe_param_table pt = {0};
    moe_params_add(&pt, "norm", 1, 3, 0, 0, MOE_INIT_ONES, 0.0, 0);
    moe_params_add(&pt, "w", 2, 2, 2, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "norm2", 1, 2, 0, 0, MOE_INIT_ONES, 0.0, 0);
    moe_real p[9] = {1, -2, 3, 1, -2, 3, 4, 5, -6};
    moe_real g[9] = {0};
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init(&opt, moe_backend_cpu(), &pt, NULL), MOE_OK);
    const double lr = 0.1, wd = 0.5;
    moe_adamw_step(&opt, p, g, NULL, lr, 0.9, 0.999, 1e-8, wd, NULL, NULL, NULL);
    const moe_real before[9] = {1, -2, 3, 1, -2, 3, 4, 5, -6};
    for (int i = 0; i < 9; i++) {
        int decayed = i >= 3 && i < 7;
        double expect = decayed ? before[i] * (1.0 - lr * wd) : before[i];
        ck_assert_msg(fabs(p[i] - expect) <= 1e-6, "element %d: %g, expected %g", i, (double)p[i],
                      expect);
        if (!decayed)
            ck_assert(p[i] == before[i]);
    }
    /* wd = 0 leaves even the decayed tensor alone */
    moe_real q[9];
    memcpy(q, before, sizeof q);
    moe_adamw_step(&opt, q, g, NULL, lr, 0.9, 0.999, 1e-8, 0.0, NULL, NULL, NULL);
    ck_assert(memcmp(q, before, sizeof q) == 0);
    moe_adamw_free(&opt);
    moe_params_free(&pt);
}
END_TEST

/* The step before the run list, element by element: each tensor's part of each piece, with
 * its weight decay, the gradient times the clip factor. @p w holds the weights at the state
 * offsets when @p master (the optimizer's own), else laid out like the flat buffer. */
static void adamw_reference(const moe_param_table *pt, const moe_adamw *opt, int master,
                            moe_real *w, const moe_real *g, float *m, float *v, long long step,
                            double lr, double b1, double b2, double eps, double wd, double clip) {
    const double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    for (int k = 0; k < opt->n_pieces; k++) {
        const moe_adamw_piece *pc = &opt->piece[k];
        for (int t = 0; t < pt->n; t++) {
            const moe_tensor *ten = &pt->t[t];
            for (size_t i = ten->offset; i < ten->offset + ten->numel; i++) {
                if (i < pc->lo || i >= pc->hi)
                    continue;
                const size_t st = pc->state + (i - pc->lo);
                moe_adamw_update(&w[master ? st : i], (moe_real)(g[i] * clip), &m[st], &v[st],
                                 lr, b1, b2, eps, ten->decay ? wd : 0.0, bc1, bc2);
            }
        }
    }
}

/* Neighbouring tensors with the same weight decay form one run, never across a piece of the
 * distributed optimizer's state, and one backend call walks every run (one launch a step
 * on a GPU), with the bits of one update per element as before. */
static int g_adamw_calls, g_adamw_runs;
static size_t g_adamw_n[8];
static void counting_adamw(const moe_adamw_runs *runs, moe_real *p, const moe_real *g, float *m,
                           float *v, void *act, double lr, double beta1, double beta2, double eps,
                           double wd, double bc1, double bc2, const double *clip,
                           const int *flags, const double *hyper) {
    g_adamw_calls++;
    g_adamw_runs = runs->n;
    for (int r = 0; r < runs->n && r < 8; r++)
        g_adamw_n[r] = runs->run[r].n;
    moe_backend_cpu()->adamw(runs, p, g, m, v, act, lr, beta1, beta2, eps, wd, bc1, bc2, clip,
                             flags, hyper);
}

START_TEST(test_adamw_one_call_over_runs) {
    moe_param_table pt = {0};
    moe_params_add(&pt, "a", 1, 5, 0, 0, MOE_INIT_NORMAL, 0.02, 1);  /* decayed ... */
    moe_params_add(&pt, "b", 2, 2, 3, 0, MOE_INIT_NORMAL, 0.02, 1);  /* ... one run of 11 */
    moe_params_add(&pt, "n1", 1, 3, 0, 0, MOE_INIT_ONES, 0.0, 0);    /* not decayed: 3 */
    moe_params_add(&pt, "c", 1, 4, 0, 0, MOE_INIT_NORMAL, 0.02, 1);  /* decayed ... */
    moe_params_add(&pt, "d", 1, 6, 0, 0, MOE_INIT_NORMAL, 0.02, 1);  /* ... one run of 10 */
    const size_t n = pt.total;
    ck_assert_uint_eq(n, 24);
    moe_real p0[24], g[24], p[24], q[24], act[24];
    for (size_t i = 0; i < n; i++) {
        p0[i] = (moe_real)moe_rng_normal(11, 0, i);
        g[i] = (moe_real)moe_rng_normal(12, 0, i);
    }
    moe_backend be = *moe_backend_cpu();
    be.adamw = counting_adamw;
    const double lr = 0.01, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
    /* one piece (the whole state), then two pieces cut inside tensor "c" (at 16) */
    const moe_adamw_piece one[] = {{0, n, 0}}, two[] = {{0, 16, 0}, {16, n, 16}};
    const size_t want_one[] = {11, 3, 10}, want_two[] = {11, 3, 2, 8};
    for (int cut = 0; cut < 2; cut++) {
        moe_adamw opt;
        ck_assert_int_eq(
            moe_adamw_init_pieces(&opt, &be, &pt, cut ? two : one, cut ? 2 : 1, 0, NULL), MOE_OK);
        float *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
        memcpy(p, p0, sizeof p);
        memcpy(q, p0, sizeof q);
        for (int step = 1; step <= 2; step++) {
            g_adamw_calls = 0;
            moe_test_poison(act, n);
            moe_adamw_step(&opt, p, g, act, lr, b1, b2, eps, wd, NULL, NULL, NULL);
            const size_t *want = cut ? want_two : want_one;
            ck_assert_int_eq(g_adamw_calls, 1);
            ck_assert_int_eq(g_adamw_runs, cut ? 4 : 3);
            for (int r = 0; r < g_adamw_runs; r++)
                ck_assert_uint_eq(g_adamw_n[r], want[r]);
            adamw_reference(&pt, &opt, 0, q, g, m, v, step, lr, b1, b2, eps, wd, 1.0);
            ck_assert_msg(!memcmp(p, q, sizeof p) && !memcmp(opt.m, m, n * sizeof(float)) &&
                              !memcmp(opt.v, v, n * sizeof(float)),
                          "pieces %d, step %d: the weights or moments differ from one update "
                          "per element", cut + 1, step);
            /* the compute copy (moe_real on the CPU: cast_to_act is a copy) */
            ck_assert_msg(!memcmp(act, p, sizeof p), "pieces %d, step %d: act is not the "
                          "weights", cut + 1, step);
        }
        free(m);
        free(v);
        moe_adamw_free(&opt);
        ck_assert_ptr_null(opt.runs.run);
    }
    moe_params_free(&pt);
}
END_TEST

/* The run list on a table with runs of several chunks, odd lengths, mixed decay, and three
 * pieces of optimizer state that hold their own master weights (the distributed
 * optimizer's layout, where the weights' offsets are not the gradients'): every chunk finds
 * its run, the step equals one update per element bit for bit (with a clip factor and
 * {lr, bias corrections} read from memory), the compute copy is cast_to_act of the updated
 * weights where this rank updates and untouched elsewhere, and a step flag leaves p, m and
 * v as they were while the copy is still written. */
START_TEST(test_adamw_runs_chunks_master) {
    const int C = MOE_ADAMW_CHUNK;
    moe_param_table pt = moe_test_adamw_table();
    const size_t n = pt.total, t_c = pt.t[3].offset;
    /* piece 0 inside "big" (two chunks of one run), piece 1 from "odd" into "c", piece 2 to
     * the end but one element; the rest is another rank's */
    const moe_adamw_piece pieces[] = {{1000, 1000 + C + 77, 0},
                                      {3 * (size_t)C + 9, t_c + 500, 0},
                                      {t_c + 500, n - 1, 0}};
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init_pieces(&opt, moe_backend_cpu(), &pt, pieces, 3, 1, NULL),
                     MOE_OK);
    /* runs: big | odd, n1, c | c (where the piece starts again), n2, e and d */
    ck_assert_int_eq(opt.runs.n, 7);
    const moe_adamw_run *run = opt.runs.run;
    size_t chunks = 0;
    for (int r = 0; r < opt.runs.n; r++) {
        ck_assert_uint_eq(run[r].chunk, chunks);
        ck_assert_uint_eq(run[r].weight, run[r].state); /* the master is laid out like m */
        chunks += (run[r].n + C - 1) / C;
        for (size_t c = run[r].chunk; c < chunks; c++)
            ck_assert_int_eq(moe_adamw_run_of_chunk(run, opt.runs.n, c), r);
    }
    ck_assert_uint_eq(opt.runs.chunks, chunks);
    ck_assert_uint_eq(run[0].n, (size_t)C + 77);
    ck_assert_uint_eq(run[1].grad, 3 * (size_t)C + 9);
    ck_assert_uint_eq(run[1].state, (size_t)C + 77);
    ck_assert(run[0].decay && run[1].decay && !run[2].decay && run[3].decay && run[4].decay &&
              !run[5].decay && run[6].decay);

    const size_t ns = opt.n;
    moe_real *g = malloc(sizeof(moe_real) * n), *act = malloc(sizeof(moe_real) * n);
    moe_real *w = malloc(sizeof(moe_real) * ns), *w0 = malloc(sizeof(moe_real) * ns);
    float *m = malloc(sizeof(float) * ns), *v = malloc(sizeof(float) * ns);
    float *m0 = malloc(sizeof(float) * ns), *v0 = malloc(sizeof(float) * ns);
    moe_test_randn(g, n, 21, 1e-2);
    moe_test_randn(opt.master, ns, 22, 1.0);
    moe_test_randn(opt.m, ns, 23, 1e-3);
    moe_test_randn(opt.v, ns, 24, 1e-3);
    for (size_t i = 0; i < ns; i++)
        opt.v[i] *= opt.v[i];
    memcpy(w, opt.master, sizeof(moe_real) * ns);
    memcpy(m, opt.m, sizeof(float) * ns);
    memcpy(v, opt.v, sizeof(float) * ns);
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, clip = 0.37;
    for (int step = 1; step <= 2; step++) {
        double hyper[3];
        moe_adamw_next_hyper(&opt, 1e-3 * step, b1, b2, hyper);
        moe_test_poison(act, n);
        moe_adamw_step(&opt, NULL, g, act, 99.0, b1, b2, eps, wd, &clip, NULL, hyper);
        adamw_reference(&pt, &opt, 1, w, g, m, v, step, 1e-3 * step, b1, b2, eps, wd, clip);
        ck_assert_msg(!memcmp(opt.master, w, sizeof(moe_real) * ns) &&
                          !memcmp(opt.m, m, sizeof(float) * ns) &&
                          !memcmp(opt.v, v, sizeof(float) * ns),
                      "step %d: the multi-tensor step differs from one update per element",
                      step);
        for (int k = 0; k < opt.n_pieces; k++) /* the copy of this rank's pieces ... */
            ck_assert(!memcmp(act + pieces[k].lo, w + opt.piece[k].state,
                              sizeof(moe_real) * (pieces[k].hi - pieces[k].lo)));
        for (size_t i = 0; i < pieces[0].lo; i++) /* ... and nothing else */
            ck_assert(isnan(act[i]));
        ck_assert(isnan(act[pieces[0].hi]) && isnan(act[pieces[1].lo - 1]) && isnan(act[n - 1]));
    }
    /* a skipped step: p, m, v untouched, the copy still written (of the unchanged weights) */
    memcpy(w0, opt.master, sizeof(moe_real) * ns);
    memcpy(m0, opt.m, sizeof(float) * ns);
    memcpy(v0, opt.v, sizeof(float) * ns);
    const int flag = MOE_STEP_NONFINITE;
    moe_test_poison(act, n);
    moe_adamw_step(&opt, NULL, g, act, 1e-3, b1, b2, eps, wd, &clip, &flag, NULL);
    ck_assert(!memcmp(opt.master, w0, sizeof(moe_real) * ns) &&
              !memcmp(opt.m, m0, sizeof(float) * ns) && !memcmp(opt.v, v0, sizeof(float) * ns));
    for (int k = 0; k < opt.n_pieces; k++)
        ck_assert(!memcmp(act + pieces[k].lo, w0 + opt.piece[k].state,
                          sizeof(moe_real) * (pieces[k].hi - pieces[k].lo)));
    moe_adamw_free(&opt);
    free(g), free(act), free(w), free(w0), free(m), free(v), free(m0), free(v0);
    moe_params_free(&pt);
}
END_TEST

/* ------------------------------------------------------------------ timer */

START_TEST(test_timer) {
    moe_timer t;
    moe_timer_start(&t);
    double e0 = moe_timer_elapsed(&t);
    ck_assert(e0 >= 0.0);
    double prev = moe_time_now();
    double e1 = e0;
    /* spin for ~2 ms (bounded, so a broken clock fails instead of hanging) */
    for (long i = 0; i < 200000000L && e1 < 0.002; i++) {
        double now = moe_time_now();
        ck_assert_msg(now >= prev, "moe_time_now went backwards: %.9f < %.9f", now, prev);
        prev = now;
        e1 = moe_timer_elapsed(&t);
    }
    ck_assert_msg(e1 >= 0.002, "timer never reached 2 ms (elapsed %g)", e1);
    ck_assert(e1 > e0);
    ck_assert(e1 < 5.0);
    /* restarting resets the origin */
    moe_timer_start(&t);
    double e2 = moe_timer_elapsed(&t);
    ck_assert(e2 >= 0.0 && e2 < e1);
}
END_TEST

Suite *suite_core(void) {
    Suite *s = suite_create("core");

    TCase *rng = tcase_create("rng");
    tcase_add_test(rng, test_philox_kat_zero);
    tcase_add_test(rng, test_philox_kat_ones);
    tcase_add_test(rng, test_philox_kat_pi);
    tcase_add_test(rng, test_rng_bits_layout);
    tcase_add_test(rng, test_rng_normal_moments);
    tcase_add_test(rng, test_rng_pure_function);
    tcase_add_test(rng, test_rng_uniform_open_interval);
    suite_add_tcase(s, rng);

    TCase *errs = tcase_create("errors");
    tcase_add_test(errs, test_error_set_clear);
    tcase_add_test(errs, test_status_names);
    tcase_add_test(errs, test_moe_try);
    suite_add_tcase(s, errs);

    TCase *met = tcase_create("metrics");
    tcase_add_test(met, test_metrics_records);
    tcase_add_test(met, test_metrics_truncates);
    tcase_add_test(met, test_metrics_bad_dir);
    tcase_add_test(met, test_bench_parse_ints);
    suite_add_tcase(s, met);

    TCase *par = tcase_create("params");
    tcase_add_test(par, test_params_table_layout);
    tcase_add_test(par, test_hash_name_fnv1a);
    tcase_add_test(par, test_params_init_kinds);
    tcase_add_test(par, test_params_init_deterministic_by_name);
    suite_add_tcase(s, par);

    TCase *opt = tcase_create("optimizer");
    tcase_add_test(opt, test_lr_warmup);
    tcase_add_test(opt, test_lr_cosine);
    tcase_add_test(opt, test_lr_linear_constant);
    tcase_add_test(opt, test_lr_decay_iters_default);
    tcase_add_test(opt, test_clip_grad_norm);
    tcase_add_test(opt, test_clip_grad_norm_large);
    tcase_add_test(opt, test_adamw_first_steps);
    tcase_add_test(opt, test_adamw_decay_only_where_enabled);
    tcase_add_test(opt, test_adamw_one_call_over_runs);
    tcase_add_test(opt, test_adamw_runs_chunks_master);
    suite_add_tcase(s, opt);

    TCase *tim = tcase_create("timer");
    tcase_add_test(tim, test_timer);
    suite_add_tcase(s, tim);
    return s;
}
