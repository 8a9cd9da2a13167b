/*
 * Checkpoint and resume (checkpoint.h, checkpoint_file.h):
 *  - through bin/moe-train: kill -9 past half way, resume, and the loss curve is the
 *    uninterrupted one bit for bit; the same after SIGTERM with --exit-signal-handler (which
 *    must save and exit 0); a kill -9 in the middle of a save leaves the previous checkpoint
 *    the latest and loadable;
 *  - in process: save, free, load gives the same next losses bit for bit;
 *  - every corruption of a file, and every mismatch, is its own named error, and a failed
 *    load leaves the trainer untouched.
 * Loading into another expert-parallel folding is tested under MPI (tests/mpi_checkpoint.c).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "checkpoint_file.h"
#include "helpers.h"
#include "suites.h"

/* A tiny MoE with the aux-loss-free expert bias (state beyond the parameters), a shared
 * expert and a fixed LR schedule (--lr-decay-iters), so --train-iters may change on resume. */
#define CK_SMALL "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
                 "--seq-length 16 --micro-batch-size 2 --global-batch-size 4 --num-experts 4 "  \
                 "--moe-ffn-hidden-size 16 --ffn-hidden-size 32 --moe-layer-freq 0,1 "          \
                 "--moe-shared-expert-intermediate-size 8 --moe-router-score-function sigmoid " \
                 "--moe-router-enable-expert-bias --lr 3e-3 --lr-warmup-iters 2 "              \
                 "--lr-decay-iters 16 --eval-iters 1 --sample-length 0 "

/* a trainer on the CPU (the helper adds --device cpu) */
static moe_trainer *make(const char *flags) { return moe_test_trainer(flags, NULL, 0); }

static void sh(const char *fmt, const char *a, const char *b) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, fmt, a, b);
    ck_assert_msg(system(cmd) == 0, "%s", cmd);
}

/* ------------------------------------------------------------------ through moe-train */

/* Interrupt a run with @p sig past half way, resume it: the same losses (helpers.h). */
static void resume_after(int sig) {
    if (!moe_test_have_program("bin/moe-train"))
        return;
    char why[4096];
    ck_assert_msg(moe_test_resume_after_signal(CK_SMALL "--device cpu", 16, sig, why,
                                               sizeof why), "%s", why);
}

START_TEST(test_resume_after_kill9) { resume_after(SIGKILL); }
END_TEST

START_TEST(test_resume_after_sigterm) { resume_after(SIGTERM); }
END_TEST

START_TEST(test_kill9_during_save) {
    if (!moe_test_have_program("bin/moe-train"))
        return;
    static char out[1 << 16];
    char dir[512], cmd[2048];
    moe_test_tmp_path(dir, sizeof dir, "kill_in_save");
    sh("rm -rf %s%s", dir, "");
    /* the second save (step 4) dies by SIGKILL halfway through its file */
    snprintf(cmd, sizeof cmd, "MOE_TEST_KILL_IN_SAVE=2 MOE_NO_DOWNLOAD=1 exec ./bin/moe-train "
             CK_SMALL "--device cpu --train-iters 6 --save %s --save-interval 2", dir);
    ck_assert_int_eq(moe_test_run(cmd, out, sizeof out), -1); /* killed, did not exit */
    char path[700];
    snprintf(path, sizeof path, "%s/latest_checkpointed_iteration.txt", dir);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int latest = -1;
    ck_assert_int_eq(fscanf(f, "%d", &latest), 1);
    fclose(f);
    ck_assert_int_eq(latest, 2);
    /* the half-written file is a temporary, never the final name */
    snprintf(path, sizeof path, "%s/iter_0000004/rank_00000.moeckpt", dir);
    ck_assert_msg(access(path, F_OK) != 0, "a half-written checkpoint has its final name");
    snprintf(cmd, sizeof cmd, "MOE_NO_DOWNLOAD=1 ./bin/moe-train " CK_SMALL
             "--device cpu --train-iters 6 --load %s --save %s", dir, dir);
    ck_assert_msg(moe_test_run(cmd, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "resumed from") && strstr(out, "at step 2"), "%s", out);
    sh("rm -rf %s%s", dir, "");
}
END_TEST

START_TEST(test_checkpoint_flags) {
    if (!moe_test_have_program("bin/moe-train"))
        return;
    static char out[1 << 16];
    ck_assert_int_eq(moe_test_run("MOE_NO_DOWNLOAD=1 ./bin/moe-train --save-interval 5", out,
                                  sizeof out), 2);
    ck_assert_msg(strstr(out, "--save"), "%s", out);
    ck_assert_int_eq(moe_test_run("MOE_NO_DOWNLOAD=1 ./bin/moe-train " CK_SMALL
                                  "--load /nonexistent/ckpt", out, sizeof out), 1);
    ck_assert_msg(strstr(out, "--load") && strstr(out, "no checkpoint"), "%s", out);
}
END_TEST

/* ------------------------------------------------------------------ in process */

/* Train 6 steps straight, and 3 + save + load into a new trainer + 3: the same losses, bit
 * for bit (@p extra: more flags for both runs). */
static void resume_in_process(const char *extra) {
    char dir[512], flags[1024];
    moe_test_tmp_path(dir, sizeof dir, "inproc");
    sh("rm -rf %s%s", dir, "");
    snprintf(flags, sizeof flags, CK_SMALL "%s ", extra);
    double ref[6], got[6];
    moe_trainer *a = make(flags);
    for (int i = 0; i < 6; i++)
        ref[i] = moe_test_step(a);
    moe_trainer_free(a);
    moe_error err;
    moe_trainer *b = make(flags);
    for (int i = 0; i < 3; i++)
        moe_test_step(b);
    ck_assert_msg(moe_checkpoint_save(b, dir, 2, &err) == MOE_OK, "%s", err.msg);
    moe_trainer_free(b);
    char more[1100];
    snprintf(more, sizeof more, "%s --train-iters 99", flags); /* may differ on resume */
    moe_trainer *c = make(more);
    int loaded = 0;
    ck_assert_msg(moe_checkpoint_load(c, dir, 0, &loaded, &err) == MOE_OK, "%s", err.msg);
    ck_assert_int_eq(loaded, 1);
    ck_assert_int_eq(c->step, 3);
    for (int i = 3; i < 6; i++)
        got[i] = moe_test_step(c);
    moe_trainer_free(c);
    for (int i = 3; i < 6; i++)
        ck_assert_msg(memcmp(&got[i], &ref[i], sizeof(double)) == 0,
                      "%s: step %d: %.17g resumed vs %.17g uninterrupted", extra, i + 1, got[i],
                      ref[i]);
    sh("rm -rf %s%s", dir, "");
}

START_TEST(test_resume_in_process) {
    resume_in_process("");
    /* chapter 05: NVFP4's stochastic rounding draws its seeds from a counter of the gradient
     * quantizations, which the checkpoint must carry (widths: multiples of NVFP4's 16) */
    resume_in_process("--fp4-format e2m1 --fp4-recipe nvfp4 --ffn-hidden-size 32 "
                      "--moe-shared-expert-intermediate-size 16 --num-query-groups 4");
    /* FP8 delayed scaling: every site's scales, amax window and slot (lowp.h), and the
     * weights cast again with their saved scales (a window of 4 holds a step's amaxes
     * beyond the last one, so the max algorithm needs the whole window back) */
    resume_in_process("--fp8-format e4m3 --fp8-recipe delayed --fp8-amax-history-len 4 "
                      "--fp8-amax-compute-algo max --fp8-margin 1");
}
END_TEST

/* ------------------------------------------------------------------ corruption */

static char g_base[512]; /* a good checkpoint of step 2 */

static void file_path(char *out, size_t cap, const char *dir, int step) {
    snprintf(out, cap, "%s/iter_%07d/rank_00000.moeckpt", dir, step);
}

/* A copy of the good checkpoint as the checkpoint of @p step in @p dir. */
static void copy_base(const char *dir, int step) {
    char src[700], dst[700], cmd[2048];
    file_path(src, sizeof src, g_base, 2);
    file_path(dst, sizeof dst, dir, step);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s/iter_%07d && cp %s %s && echo %d > "
             "%s/latest_checkpointed_iteration.txt", dir, dir, step, src, dst, step, dir);
    ck_assert_msg(system(cmd) == 0, "%s", cmd);
}

static long file_size(const char *path) {
    struct stat sb;
    ck_assert_int_eq(stat(path, &sb), 0);
    return (long)sb.st_size;
}

/* XOR the byte at @p at (negative: from the end) with @p x. */
static void flip(const char *path, long at, int x) {
    FILE *f = fopen(path, "r+b");
    ck_assert_ptr_nonnull(f);
    if (at < 0)
        at += file_size(path);
    fseek(f, at, SEEK_SET);
    int c = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(c ^ x, f);
    fclose(f);
}

/* A trainer that failing loads are tried on, and a copy of its initial weights. */
typedef struct victim {
    moe_trainer *t;
    moe_real *init;
} victim;

static victim make_victim(const char *flags) {
    victim v = {make(flags), NULL};
    const size_t bytes = sizeof(moe_real) * v.t->model->table.total;
    v.init = malloc(bytes);
    ck_assert_ptr_nonnull(v.init);
    memcpy(v.init, v.t->model->params, bytes); /* CPU: host memory */
    return v;
}

static void free_victim(victim *v) {
    moe_trainer_free(v->t);
    free(v->init);
}

/* Load @p dir into the victim: it must fail with @p code and a message holding @p needle, and
 * leave the trainer as it was (step 0, its initial weights). One victim takes every failing
 * load in turn, so each case also checks that the ones before it changed nothing. */
static void expect_load_error(victim *v, const char *dir, moe_status code, const char *needle) {
    moe_error err;
    moe_error_clear(&err);
    int loaded = 7;
    moe_status s = moe_checkpoint_load(v->t, dir, 0, &loaded, &err);
    ck_assert_msg(s == code, "expected status %d, got %d (%s)", code, s, err.msg);
    ck_assert_msg(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
    ck_assert_int_eq(loaded, 0);
    ck_assert_int_eq(v->t->step, 0);
    ck_assert_msg(memcmp(v->init, v->t->model->params,
                         sizeof(moe_real) * v->t->model->table.total) == 0,
                  "a failed load changed the weights");
}

START_TEST(test_corrupt_checkpoints) {
    moe_error err;
    moe_test_tmp_path(g_base, sizeof g_base, "ckpt_base");
    sh("rm -rf %s%s", g_base, "");
    moe_trainer *t = make(CK_SMALL);
    moe_test_step(t);
    moe_test_step(t);
    ck_assert_msg(moe_checkpoint_save(t, g_base, 0, &err) == MOE_OK, "%s", err.msg);
    moe_trainer_free(t);
    char dir[512], path[700];
    moe_test_tmp_path(dir, sizeof dir, "ckpt_case");
    file_path(path, sizeof path, dir, 2);

    copy_base(dir, 2); /* the copy itself loads */
    moe_trainer *ok = make(CK_SMALL);
    int loaded = 0;
    ck_assert_msg(moe_checkpoint_load(ok, dir, 0, &loaded, &err) == MOE_OK, "%s", err.msg);
    ck_assert_int_eq(ok->step, 2);
    moe_trainer_free(ok);

    victim v = make_victim(CK_SMALL);
    copy_base(dir, 2); /* a flipped bit in the first tensor's data */
    moe_ckpt_file cf;
    ck_assert_int_eq(moe_ckpt_file_read(&cf, path, &err), MOE_OK);
    long data0 = (long)((const unsigned char *)cf.t[0].data - cf.buf);
    char first[MOE_CKPT_NAME_LEN + 32];
    snprintf(first, sizeof first, "'%s' fails its SHA-256", cf.t[0].name);
    moe_ckpt_file_free(&cf);
    flip(path, data0 + 5, 0x10);
    expect_load_error(&v, dir, MOE_ERR_DATA, first);

    copy_base(dir, 2); /* the header (the step field) */
    flip(path, 16, 0x01);
    expect_load_error(&v, dir, MOE_ERR_DATA, "header or tensor index fails");
    copy_base(dir, 2); /* the tensor index (a name) */
    flip(path, 96 + 3, 0x20);
    expect_load_error(&v, dir, MOE_ERR_DATA, "header or tensor index fails");
    copy_base(dir, 2); /* padding after the last tensor, or the last tensor */
    flip(path, -1, 0x01);
    expect_load_error(&v, dir, MOE_ERR_DATA, "(the file is corrupt)");

    copy_base(dir, 2); /* truncated */
    ck_assert_int_eq(truncate(path, file_size(path) - 100), 0);
    expect_load_error(&v, dir, MOE_ERR_DATA, "truncated");
    copy_base(dir, 2);
    ck_assert_int_eq(truncate(path, 40), 0);
    expect_load_error(&v, dir, MOE_ERR_DATA, "truncated");

    copy_base(dir, 2); /* not a checkpoint */
    flip(path, 0, 'M' ^ 'X');
    expect_load_error(&v, dir, MOE_ERR_DATA, "not a moe.c checkpoint");
    copy_base(dir, 2); /* another version */
    flip(path, 8, 0x03);
    expect_load_error(&v, dir, MOE_ERR_DATA, "format version 2");

    copy_base(dir, 2); /* another model */
    victim wide = make_victim(CK_SMALL "--hidden-size 64");
    victim all_moe = make_victim(CK_SMALL "--moe-layer-freq 1");
    expect_load_error(&wide, dir, MOE_ERR_CONFIG, "--hidden-size 32");
    expect_load_error(&all_moe, dir, MOE_ERR_CONFIG, "--moe-layer-freq");
    free_victim(&wide);
    free_victim(&all_moe);

    copy_base(dir, 4); /* a file of step 2 where step 4 should be */
    expect_load_error(&v, dir, MOE_ERR_DATA, "does not belong");

    /* a missing shard: the same file, rewritten as file 0 of 2 */
    copy_base(dir, 2);
    ck_assert_int_eq(moe_ckpt_file_read(&cf, path, &err), MOE_OK);
    cf.info.file_count = 2;
    ck_assert_msg(moe_ckpt_file_write(path, &cf.info, cf.t, cf.n, &err) == MOE_OK, "%s", err.msg);
    moe_ckpt_file_free(&cf);
    expect_load_error(&v, dir, MOE_ERR_IO, "missing shard");

    /* no checkpoint at all, and a pointer that holds no step */
    sh("rm -rf %s && mkdir -p %s", dir, dir);
    expect_load_error(&v, dir, MOE_ERR_IO, "no checkpoint");
    ck_assert_int_eq(moe_checkpoint_load(v.t, dir, 1, &loaded, &err), MOE_OK);
    ck_assert_int_eq(loaded, 0);
    sh("echo x > %s/latest_checkpointed_iteration.txt%s", dir, "");
    expect_load_error(&v, dir, MOE_ERR_DATA, "does not hold a step");
    free_victim(&v);

    sh("rm -rf %s %s", dir, g_base);
}
END_TEST

/* --keep-last: older checkpoints go once a newer one is complete. */
START_TEST(test_keep_last) {
    char dir[512], path[700];
    moe_test_tmp_path(dir, sizeof dir, "keep");
    sh("rm -rf %s%s", dir, "");
    moe_error err;
    moe_trainer *t = make(CK_SMALL);
    for (int i = 0; i < 4; i++) {
        moe_test_step(t);
        ck_assert_msg(moe_checkpoint_save(t, dir, 2, &err) == MOE_OK, "%s", err.msg);
    }
    moe_trainer_free(t);
    for (int s = 1; s <= 4; s++) {
        snprintf(path, sizeof path, "%s/iter_%07d", dir, s);
        ck_assert_msg((access(path, F_OK) == 0) == (s >= 3), "%s %s", path,
                      s >= 3 ? "was deleted" : "was kept");
    }
    sh("rm -rf %s%s", dir, "");
}
END_TEST

Suite *suite_checkpoint(void) {
    Suite *s = suite_create("checkpoint");
    const TTest *const in_process[] = {test_resume_in_process, test_corrupt_checkpoints,
                                              test_keep_last};
    moe_test_tcase(s, "in process", 120, in_process, 3);
    const TTest *const program[] = {test_resume_after_kill9, test_resume_after_sigterm,
                                           test_kill9_during_save, test_checkpoint_flags};
    moe_test_tcase(s, "moe-train", 300, program, 4);
    return s;
}
