/*
 * Resume on the GPU reproduces the loss curve bit for bit, through bin/moe-train --device
 * cuda: kill -9 past half way, resume from the checkpoint, and every later step logs the
 * uninterrupted run's loss exactly (the CUDA kernels use no floating-point atomics, and the
 * bf16 compute copy is derived from the saved fp32 master weights, as after every step).
 * The CPU twin of this test is in tests/test_checkpoint.c.
 */
#include <signal.h>

#include "helpers.h"
#include "suites.h"

#define CK_GPU "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 " \
               "--seq-length 32 --micro-batch-size 4 --global-batch-size 8 --num-experts 8 "  \
               "--moe-ffn-hidden-size 32 --ffn-hidden-size 64 --moe-layer-freq 0,1 "         \
               "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "        \
               "--lr 3e-3 --lr-warmup-iters 2 --lr-decay-iters 16 --eval-iters 1 "           \
               "--sample-length 0 --device cuda "

START_TEST(test_gpu_resume_after_kill9) {
    if (!moe_test_have_program("bin/moe-train"))
        return;
    char why[4096];
    ck_assert_msg(moe_test_resume_after_signal(CK_GPU, 16, SIGKILL, why, sizeof why), "%s",
                  why);
}
END_TEST

Suite *suite_gpu_checkpoint(void) {
    Suite *s = suite_create("gpu-checkpoint");
    const TTest *const tests[] = {test_gpu_resume_after_kill9};
    moe_test_tcase(s, "resume", 300, tests, 1);
    return s;
}
