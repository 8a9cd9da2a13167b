/* Config unit tests: the flag parser, validation with named errors, the MoE layer mask,
 * backend selection, --help, and the flag table's defaults. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "config.h"
#include "context_parallel.h"
#include "error.h"
#include "flags.h"
#include "helpers.h"
#include "moe/experts.h"
#include "suites.h"

/* argv built from string literals: ARGS("--hidden-size", "64") → argc, argv with "moe" first. */
#define ARGV_(...) ((char *[]){"moe", __VA_ARGS__})
#define ARGC_(...) ((int)(sizeof ARGV_(__VA_ARGS__) / sizeof(char *)))
#define ARGS(...) ARGC_(__VA_ARGS__), ARGV_(__VA_ARGS__)

/* Defaults, then the flags, then validation with the vocabulary the trainer would set. */
static moe_status parse_validate(moe_config *cfg, moe_error *err, int argc, char **argv) {
    moe_config_defaults(cfg);
    moe_error_clear(err);
    moe_status s = moe_config_parse(cfg, argc, argv, err);
    if (s != MOE_OK)
        return s;
    cfg->vocab_size = 65;
    return moe_config_validate(cfg, err);
}

static moe_status parse_only(moe_config *cfg, moe_error *err, int argc, char **argv) {
    moe_config_defaults(cfg);
    moe_error_clear(err);
    return moe_config_parse(cfg, argc, argv, err);
}

/* Assert that the flags give status @p want_code with every given text in the message. */
#define EXPECT_ERROR(want_code, needle1, needle2, ...)                                               \
    do {                                                                                        \
        moe_config c_;                                                                          \
        moe_error e_;                                                                           \
        moe_status s_ = parse_validate(&c_, &e_, ARGS(__VA_ARGS__));                            \
        ck_assert_msg(s_ == (want_code), "expected %s, got %s: %s", moe_status_name(want_code),           \
                      moe_status_name(s_), e_.msg);                                             \
        ck_assert_int_eq(e_.code, (want_code));                                                      \
        ck_assert_msg(strstr(e_.msg, (needle1)) != NULL, "message lacks '%s': %s", (needle1),   \
                      e_.msg);                                                                  \
        ck_assert_msg(strstr(e_.msg, (needle2)) != NULL, "message lacks '%s': %s", (needle2),   \
                      e_.msg);                                                                  \
    } while (0)

#define EXPECT_CONFIG_ERROR(needle1, needle2, ...) \
    EXPECT_ERROR(MOE_ERR_CONFIG, needle1, needle2, __VA_ARGS__)
#define EXPECT_FLAG_ERROR(needle1, needle2, ...) \
    EXPECT_ERROR(MOE_ERR_FLAG, needle1, needle2, __VA_ARGS__)

#define EXPECT_OK(cfg, ...)                                                              \
    do {                                                                                 \
        moe_error e_;                                                                    \
        moe_status s_ = parse_validate((cfg), &e_, ARGS(__VA_ARGS__));                   \
        ck_assert_msg(s_ == MOE_OK, "expected ok, got %s: %s", moe_status_name(s_), e_.msg); \
    } while (0)

/* ------------------------------------------------------------------ defaults */

START_TEST(test_defaults_validate) {
    moe_config c;
    moe_config_defaults(&c);
    ck_assert_int_eq(c.num_layers, 4);
    ck_assert_int_eq(c.hidden_size, 128);
    ck_assert_int_eq(c.num_attention_heads, 4);
    ck_assert_int_eq(c.num_experts, 8);
    ck_assert_int_eq(c.moe_router_topk, 2);
    ck_assert_int_eq(c.qk_layernorm, 0);
    ck_assert(c.lr == 2e-3);
    ck_assert(c.seed == 1337);
    ck_assert_str_eq(c.moe_router_score_function, "softmax");
    ck_assert_str_eq(c.device, "auto");
    ck_assert_str_eq(c.data_path, "");
    /* without a vocabulary, validation refuses */
    moe_error err;
    ck_assert_int_eq(moe_config_validate(&c, &err), MOE_ERR_CONFIG);
    c.vocab_size = 65;
    moe_error_clear(&err);
    moe_status s = moe_config_validate(&c, &err);
    ck_assert_msg(s == MOE_OK, "defaults do not validate: %s", err.msg);
    ck_assert_int_eq(c.head_dim, 32);
    ck_assert_int_eq(c.score_fn, MOE_SCORE_SOFTMAX);
    ck_assert_int_eq(c.lb_type, MOE_LB_AUX);
    ck_assert_int_eq(c.lr_style, MOE_LR_COSINE);
    for (int l = 0; l < c.num_layers; l++)
        ck_assert_int_eq(c.is_moe_layer[l], 1);
    for (int l = c.num_layers; l < MOE_MAX_LAYERS; l++)
        ck_assert_int_eq(c.is_moe_layer[l], 0);
    /* validation is idempotent */
    ck_assert_int_eq(moe_config_validate(&c, &err), MOE_OK);
    ck_assert_int_eq(c.head_dim, 32);
}
END_TEST

START_TEST(test_resolved_fields) {
    moe_config c;
    EXPECT_OK(&c, "--hidden-size", "96", "--num-attention-heads", "6", "--num-query-groups", "0",
              "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type",
              "seq_aux_loss", "--lr-decay-style", "linear");
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.num_query_groups, 6); /* 0 = one key/value head per query head */
    ck_assert_int_eq(c.score_fn, MOE_SCORE_SIGMOID);
    ck_assert_int_eq(c.lb_type, MOE_LB_SEQ_AUX);
    ck_assert_int_eq(c.lr_style, MOE_LR_LINEAR);
    EXPECT_OK(&c, "--moe-router-load-balancing-type", "none", "--lr-decay-style", "constant");
    ck_assert_int_eq(c.lb_type, MOE_LB_NONE);
    ck_assert_int_eq(c.lr_style, MOE_LR_CONSTANT);
    ck_assert_int_eq(c.score_fn, MOE_SCORE_SOFTMAX);
}
END_TEST

/* ------------------------------------------------------------------ parsing */

START_TEST(test_parse_forms) {
    moe_config c;
    moe_error err;
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--hidden-size", "64")), MOE_OK);
    ck_assert_int_eq(c.hidden_size, 64);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--hidden-size=96")), MOE_OK);
    ck_assert_int_eq(c.hidden_size, 96);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--hidden_size", "32")), MOE_OK);
    ck_assert_int_eq(c.hidden_size, 32);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--moe_router_topk=4", "--num_experts", "16")),
                     MOE_OK);
    ck_assert_int_eq(c.moe_router_topk, 4);
    ck_assert_int_eq(c.num_experts, 16);
    /* the last occurrence wins */
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--hidden-size", "64", "--hidden-size", "48")),
                     MOE_OK);
    ck_assert_int_eq(c.hidden_size, 48);
    /* negative numbers are values, not flags */
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--num-layers", "-3", "--lr", "-1e-3")), MOE_OK);
    ck_assert_int_eq(c.num_layers, -3);
    ck_assert(c.lr == -1e-3);
    /* doubles, 64-bit integers, strings */
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--lr", "3e-4", "--seed", "12345678901234",
                                               "--data-path", "some dir/input.txt",
                                               "--metrics-file=m.jsonl")),
                     MOE_OK);
    ck_assert(c.lr == 3e-4);
    ck_assert(c.seed == 12345678901234LL);
    ck_assert_str_eq(c.data_path, "some dir/input.txt");
    ck_assert_str_eq(c.metrics_file, "m.jsonl");
    /* a value containing '=' after the first one is kept whole */
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--data-path=a=b.txt")), MOE_OK);
    ck_assert_str_eq(c.data_path, "a=b.txt");
    /* no arguments: the defaults stay */
    moe_config d;
    moe_config_defaults(&d);
    ck_assert_int_eq(parse_only(&c, &err, 1, ARGV_(NULL)), MOE_OK);
    ck_assert(memcmp(&c, &d, sizeof c) == 0);
}
END_TEST

START_TEST(test_parse_bool) {
    moe_config c;
    moe_error err;
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk-layernorm")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 1);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk-layernorm", "--qk-layernorm=false")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 0);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk-layernorm=true")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 1);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk-layernorm=0")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 0);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk_layernorm=1")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 1);
    /* a switch does not swallow the next flag */
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--qk-layernorm", "--hidden-size", "64")), MOE_OK);
    ck_assert_int_eq(c.qk_layernorm, 1);
    ck_assert_int_eq(c.hidden_size, 64);
    EXPECT_FLAG_ERROR("--qk-layernorm", "yes", "--qk-layernorm=yes");
    /* a switch followed by a bare value: the value is a stray argument */
    EXPECT_FLAG_ERROR("'false'", "unexpected argument", "--qk-layernorm", "false");
}
END_TEST

START_TEST(test_parse_choice) {
    moe_config c;
    moe_error err;
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--moe-router-score-function", "sigmoid")), MOE_OK);
    ck_assert_str_eq(c.moe_router_score_function, "sigmoid");
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--tokenizer-type=byte", "--device", "cpu")),
                     MOE_OK);
    ck_assert_str_eq(c.tokenizer_type, "byte");
    ck_assert_str_eq(c.device, "cpu");
    EXPECT_FLAG_ERROR("--moe-router-score-function", "relu", "--moe-router-score-function",
                      "relu");
    /* a prefix of a choice, or the whole list, is not a choice */
    EXPECT_FLAG_ERROR("--moe-router-score-function", "soft", "--moe-router-score-function",
                      "soft");
    EXPECT_FLAG_ERROR("--moe-router-score-function", "softmax|sigmoid",
                      "--moe-router-score-function=softmax|sigmoid");
    EXPECT_FLAG_ERROR("--moe-router-score-function", "must be one of",
                      "--moe-router-score-function=");
    EXPECT_FLAG_ERROR("--lr-decay-style", "cosine|linear|constant", "--lr-decay-style", "step");
    EXPECT_FLAG_ERROR("--device", "tpu", "--device", "tpu");
    EXPECT_FLAG_ERROR("--moe-router-load-balancing-type", "sinkhorn",
                      "--moe-router-load-balancing-type", "sinkhorn");
}
END_TEST

START_TEST(test_parse_errors) {
    EXPECT_FLAG_ERROR("--hiden-size", "did you mean --hidden-size", "--hiden-size", "64");
    EXPECT_FLAG_ERROR("--num-layer", "did you mean --num-layers", "--num-layer=3");
    /* nothing close: no suggestion */
    {
        moe_config c;
        moe_error e;
        ck_assert_int_eq(parse_validate(&c, &e, ARGS("--zzzzzzzzzzzzzz", "1")), MOE_ERR_FLAG);
        ck_assert_msg(strstr(e.msg, "--zzzzzzzzzzzzzz") != NULL, "%s", e.msg);
        ck_assert_msg(strstr(e.msg, "did you mean") == NULL, "%s", e.msg);
    }
    EXPECT_FLAG_ERROR("--hidden-size", "needs a value", "--hidden-size");
    EXPECT_FLAG_ERROR("--lr", "needs a value", "--hidden-size", "64", "--lr");
    EXPECT_FLAG_ERROR("--num-layers", "abc", "--num-layers", "abc");
    EXPECT_FLAG_ERROR("--num-layers", "12x", "--num-layers", "12x");
    EXPECT_FLAG_ERROR("--num-layers", "1.5", "--num-layers=1.5");
    EXPECT_FLAG_ERROR("--num-layers", "99999999999", "--num-layers", "99999999999");
    EXPECT_FLAG_ERROR("--num-layers", "integer", "--num-layers=");
    EXPECT_FLAG_ERROR("--seed", "1e3", "--seed", "1e3");
    EXPECT_FLAG_ERROR("--lr", "fast", "--lr", "fast");
    EXPECT_FLAG_ERROR("--lr", "1e-3x", "--lr", "1e-3x");
    EXPECT_FLAG_ERROR("'stray'", "unexpected argument", "stray");
    EXPECT_FLAG_ERROR("'64'", "unexpected argument", "--num-layers", "2", "64");
    EXPECT_FLAG_ERROR("'-x'", "unexpected argument", "-x");
    /* an overlong string value is refused, not overflowed */
    {
        static char big[MOE_FLAG_STR_LEN + 40];
        memset(big, 'p', sizeof big - 1);
        big[sizeof big - 1] = '\0';
        moe_config c;
        moe_error e;
        ck_assert_int_eq(parse_only(&c, &e, ARGS("--data-path", big)), MOE_ERR_FLAG);
        ck_assert_msg(strstr(e.msg, "--data-path") != NULL, "%s", e.msg);
    }
}
END_TEST

START_TEST(test_parse_help) {
    moe_config c;
    moe_error err;
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--help")), MOE_ERR_HELP);
    ck_assert_int_eq(err.code, MOE_ERR_HELP);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("-h")), MOE_ERR_HELP);
    ck_assert_int_eq(parse_only(&c, &err, ARGS("--hidden-size", "64", "--help")), MOE_ERR_HELP);
}
END_TEST

/* ------------------------------------------------------------------ validation */

START_TEST(test_val_groups_divisible) {
    EXPECT_CONFIG_ERROR("--num-experts 6", "--moe-router-num-groups 4", "--num-experts", "6",
                        "--moe-router-num-groups", "4", "--moe-router-group-topk", "1");
}
END_TEST

START_TEST(test_val_group_topk_gt_groups) {
    EXPECT_CONFIG_ERROR("--moe-router-group-topk 4", "--moe-router-num-groups 2", "--num-experts",
                        "8", "--moe-router-num-groups", "2", "--moe-router-group-topk", "4",
                        "--moe-router-topk", "4");
}
END_TEST

START_TEST(test_val_topk_div_group_topk) {
    EXPECT_CONFIG_ERROR("--moe-router-topk 3", "--moe-router-group-topk 2", "--num-experts", "8",
                        "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                        "--moe-router-topk", "3");
}
END_TEST

START_TEST(test_val_group_topk_per_group) {
    /* 8 experts in 4 groups of 2; top-4 from 1 group would need 4 experts in one group */
    EXPECT_CONFIG_ERROR("--moe-router-topk", "--moe-router-group-topk", "--num-experts", "8",
                        "--moe-router-num-groups", "4", "--moe-router-group-topk", "1",
                        "--moe-router-topk", "4");
    /* the valid DeepSeek-style setting passes */
    moe_config c;
    EXPECT_OK(&c, "--num-experts", "8", "--moe-router-num-groups", "4", "--moe-router-group-topk",
              "2", "--moe-router-topk", "4", "--moe-router-score-function", "sigmoid",
              "--moe-router-enable-expert-bias");
}
END_TEST

START_TEST(test_val_groups_need_both) {
    EXPECT_CONFIG_ERROR("--moe-router-num-groups", "--moe-router-group-topk",
                        "--moe-router-num-groups", "4");
    EXPECT_CONFIG_ERROR("--moe-router-num-groups", "--moe-router-group-topk",
                        "--moe-router-group-topk", "2");
    EXPECT_CONFIG_ERROR("--moe-router-num-groups", ">= 0", "--moe-router-num-groups", "-2",
                        "--moe-router-group-topk", "1");
}
END_TEST

START_TEST(test_val_topk_gt_experts) {
    EXPECT_CONFIG_ERROR("--moe-router-topk 5", "--num-experts 4", "--num-experts", "4",
                        "--moe-router-topk", "5");
}
END_TEST

START_TEST(test_val_topk_zero) {
    EXPECT_CONFIG_ERROR("--moe-router-topk", "got 0", "--moe-router-topk", "0");
    EXPECT_CONFIG_ERROR("--moe-router-topk", "got -1", "--moe-router-topk", "-1");
    EXPECT_CONFIG_ERROR("--moe-router-topk", "got 65", "--num-experts", "100",
                        "--moe-router-topk", "65");
}
END_TEST

START_TEST(test_val_query_groups) {
    EXPECT_CONFIG_ERROR("--num-attention-heads 4", "--num-query-groups 3",
                        "--num-query-groups", "3");
    EXPECT_CONFIG_ERROR("--num-query-groups", "got -1", "--num-query-groups", "-1");
}
END_TEST

START_TEST(test_val_hidden_div_heads) {
    EXPECT_CONFIG_ERROR("--hidden-size 130", "--num-attention-heads 4", "--hidden-size", "130");
}
END_TEST

START_TEST(test_val_odd_head_dim) {
    EXPECT_CONFIG_ERROR("--hidden-size", "RoPE", "--hidden-size", "12");
    EXPECT_CONFIG_ERROR("head dimension 3", "even", "--hidden-size", "12");
}
END_TEST

START_TEST(test_val_sizes) {
    EXPECT_CONFIG_ERROR("--num-layers", "got 0", "--num-layers", "0");
    EXPECT_CONFIG_ERROR("--num-layers", "got 257", "--num-layers", "257");
    EXPECT_CONFIG_ERROR("--hidden-size", "got -1", "--hidden-size", "-1");
    EXPECT_CONFIG_ERROR("--hidden-size", "got 0", "--hidden-size", "0");
    EXPECT_CONFIG_ERROR("--num-attention-heads", "got 0", "--num-attention-heads", "0");
    EXPECT_CONFIG_ERROR("--seq-length", "got 0", "--seq-length", "0");
    EXPECT_CONFIG_ERROR("--micro-batch-size", "got 0", "--micro-batch-size", "0");
    EXPECT_CONFIG_ERROR("--global-batch-size", "got 0", "--global-batch-size", "0");
    EXPECT_CONFIG_ERROR("--moe-ffn-hidden-size", "got 0", "--moe-ffn-hidden-size", "0");
    EXPECT_CONFIG_ERROR("--num-experts", "got -1", "--num-experts", "-1");
    EXPECT_CONFIG_ERROR("--num-experts", "got 1025", "--num-experts", "1025");
    EXPECT_CONFIG_ERROR("--moe-expert-backend grouped", "multiples of 8", "--hidden-size", "132",
                        "--num-attention-heads", "6", "--moe-expert-backend", "grouped");
    EXPECT_CONFIG_ERROR("--moe-expert-backend grouped", "cublas-grouped", "--num-experts", "1000",
                        "--moe-expert-backend", "grouped");
    EXPECT_CONFIG_ERROR("--moe-alltoall-path fused", "multiple of 8", "--hidden-size", "132",
                        "--num-attention-heads", "6", "--moe-alltoall-path", "fused");
    EXPECT_CONFIG_ERROR("--train-iters", "got -1", "--train-iters", "-1");
    EXPECT_CONFIG_ERROR("--lr-warmup-iters", "got -1", "--lr-warmup-iters", "-1");
    EXPECT_CONFIG_ERROR("--lr-decay-iters", "got -5", "--lr-decay-iters", "-5");
    EXPECT_CONFIG_ERROR("--log-interval", "got 0", "--log-interval", "0");
    EXPECT_CONFIG_ERROR("--eval-interval", "got -1", "--eval-interval", "-1");
    EXPECT_CONFIG_ERROR("--eval-iters", "got 0", "--eval-iters", "0");
    EXPECT_CONFIG_ERROR("--sample-length", "got -1", "--sample-length", "-1");
    EXPECT_CONFIG_ERROR("--sample-temperature", "got 0", "--sample-temperature", "0");
    EXPECT_CONFIG_ERROR("--rotary-base", "got 1", "--rotary-base", "1");
    EXPECT_CONFIG_ERROR("--norm-epsilon", "got 0", "--norm-epsilon", "0");
    EXPECT_CONFIG_ERROR("--init-method-std", "got -0.1", "--init-method-std", "-0.1");
    EXPECT_CONFIG_ERROR("--moe-shared-expert-intermediate-size", "got -1",
                        "--moe-shared-expert-intermediate-size", "-1");
}
END_TEST

START_TEST(test_val_global_batch) {
    EXPECT_CONFIG_ERROR("--global-batch-size 24", "--micro-batch-size 16", "--global-batch-size",
                        "24");
    moe_config c;
    EXPECT_OK(&c, "--global-batch-size", "64", "--micro-batch-size", "16");
}
END_TEST

START_TEST(test_val_pre_softmax_sigmoid) {
    EXPECT_CONFIG_ERROR("--moe-router-pre-softmax", "softmax", "--moe-router-score-function",
                        "sigmoid", "--moe-router-pre-softmax");
    moe_config c;
    EXPECT_OK(&c, "--moe-router-pre-softmax");
    ck_assert_int_eq(c.moe_router_pre_softmax, 1);
}
END_TEST

START_TEST(test_val_expert_bias_softmax) {
    EXPECT_CONFIG_ERROR("--moe-router-enable-expert-bias", "sigmoid",
                        "--moe-router-enable-expert-bias");
    moe_config c;
    EXPECT_OK(&c, "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid");
    ck_assert_int_eq(c.score_fn, MOE_SCORE_SIGMOID);
}
END_TEST

START_TEST(test_val_negative_coefficients) {
    EXPECT_CONFIG_ERROR("--moe-aux-loss-coeff", "-0.1", "--moe-aux-loss-coeff", "-0.1");
    EXPECT_CONFIG_ERROR("--moe-z-loss-coeff", "-1", "--moe-z-loss-coeff", "-1");
    EXPECT_CONFIG_ERROR("--moe-router-topk-scaling-factor", "-2",
                        "--moe-router-topk-scaling-factor", "-2");
    EXPECT_CONFIG_ERROR("--moe-router-bias-update-rate", "-0.001",
                        "--moe-router-bias-update-rate", "-0.001");
    EXPECT_CONFIG_ERROR("--weight-decay", "-0.1", "--weight-decay", "-0.1");
    EXPECT_CONFIG_ERROR("--clip-grad", "-1", "--clip-grad", "-1");
    EXPECT_CONFIG_ERROR("--lr", "-0.001", "--lr", "-0.001", "--min-lr", "0");
    EXPECT_CONFIG_ERROR("--adam-eps", "got 0", "--adam-eps", "0");
    /* zero coefficients are fine (off) */
    moe_config c;
    EXPECT_OK(&c, "--moe-aux-loss-coeff", "0", "--moe-z-loss-coeff", "0", "--weight-decay", "0",
              "--clip-grad", "0", "--min-lr", "0");
}
END_TEST

START_TEST(test_val_min_lr) {
    EXPECT_CONFIG_ERROR("--min-lr", "--lr", "--lr", "1e-3", "--min-lr", "1e-2");
    EXPECT_CONFIG_ERROR("--min-lr", "--lr", "--min-lr", "-1e-5");
    moe_config c;
    EXPECT_OK(&c, "--lr", "1e-3", "--min-lr", "1e-3");
}
END_TEST

START_TEST(test_val_adam_betas) {
    EXPECT_CONFIG_ERROR("--adam-beta1", "[0, 1)", "--adam-beta1", "1.0");
    EXPECT_CONFIG_ERROR("--adam-beta1", "got -0.5", "--adam-beta1", "-0.5");
    EXPECT_CONFIG_ERROR("--adam-beta2", "got 1.5", "--adam-beta2", "1.5");
    EXPECT_CONFIG_ERROR("--adam-beta2", "got -0.1", "--adam-beta2", "-0.1");
    moe_config c;
    EXPECT_OK(&c, "--adam-beta1", "0", "--adam-beta2", "0.999");
}
END_TEST

START_TEST(test_val_layer_freq_errors) {
    EXPECT_CONFIG_ERROR("--moe-layer-freq '0,1,1'", "--num-layers is 4", "--moe-layer-freq",
                        "0,1,1");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "--num-layers 4", "--moe-layer-freq", "0,1,1,1,1");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "'x'", "--moe-layer-freq", "0,1,x,1");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "'2'", "--moe-layer-freq", "0,1,2,1");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "positive integer", "--moe-layer-freq", "0");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "positive integer", "--moe-layer-freq", "-1");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "positive integer", "--moe-layer-freq", "2x");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "positive integer", "--moe-layer-freq", "abc");
    EXPECT_CONFIG_ERROR("--moe-layer-freq", "has 0 entries", "--moe-layer-freq", "");
}
END_TEST

START_TEST(test_val_layer_freq_mask) {
    moe_config c;
    EXPECT_OK(&c, "--num-layers", "5", "--moe-layer-freq", "2");
    const int every2[5] = {1, 0, 1, 0, 1};
    for (int l = 0; l < 5; l++)
        ck_assert_msg(c.is_moe_layer[l] == every2[l], "freq 2, layer %d", l);
    ck_assert_int_eq(c.is_moe_layer[5], 0);

    EXPECT_OK(&c, "--num-layers", "7", "--moe-layer-freq", "3");
    const int every3[7] = {1, 0, 0, 1, 0, 0, 1};
    for (int l = 0; l < 7; l++)
        ck_assert_msg(c.is_moe_layer[l] == every3[l], "freq 3, layer %d", l);

    char *lists[] = {"0,1,1,1", "[0,1,1,1]", " 0, 1, 1, 1", "[0, 1, 1, 1]"};
    for (int i = 0; i < 4; i++) {
        EXPECT_OK(&c, "--moe-layer-freq", lists[i]);
        ck_assert_msg(c.is_moe_layer[0] == 0 && c.is_moe_layer[1] == 1 && c.is_moe_layer[2] == 1 &&
                          c.is_moe_layer[3] == 1,
                      "list '%s'", lists[i]);
    }
    EXPECT_OK(&c, "--moe-layer-freq", "1,0,0,1");
    ck_assert(c.is_moe_layer[0] == 1 && c.is_moe_layer[1] == 0 && c.is_moe_layer[2] == 0 &&
              c.is_moe_layer[3] == 1);
    /* a single layer given as a one-entry list */
    EXPECT_OK(&c, "--num-layers", "1", "--moe-layer-freq", "[0]");
    ck_assert_int_eq(c.is_moe_layer[0], 0);

    /* the mask is recomputed: a stale mask from an earlier validation does not survive */
    EXPECT_OK(&c, "--num-layers", "4", "--moe-layer-freq", "1");
    c.num_layers = 2;
    snprintf(c.moe_layer_freq, sizeof c.moe_layer_freq, "0,1");
    moe_error err;
    ck_assert_int_eq(moe_config_validate(&c, &err), MOE_OK);
    ck_assert(c.is_moe_layer[0] == 0 && c.is_moe_layer[1] == 1 && c.is_moe_layer[2] == 0 &&
              c.is_moe_layer[3] == 0);

    /* an all-MoE model needs no dense FFN width */
    EXPECT_OK(&c, "--ffn-hidden-size", "0");
    /* but a model with a dense layer does */
    EXPECT_CONFIG_ERROR("--ffn-hidden-size", "got 0", "--ffn-hidden-size", "0",
                        "--moe-layer-freq", "0,1,1,1");
}
END_TEST

/* chapter 05: the emulated FP8 / NVFP4 flags (lowp.h) */
START_TEST(test_val_lowp) {
    moe_config c;
    /* the default model: K and V are 2 heads of 32 = 64 wide, not a multiple of 128 */
    EXPECT_CONFIG_ERROR("--fp8-recipe blockwise", "attn.wk has output width 64",
                        "--fp8-format", "e4m3", "--fp8-recipe", "blockwise");
    EXPECT_CONFIG_ERROR("--num-query-groups", "tensorwise", "--fp8-format", "e4m3",
                        "--fp8-recipe", "blockwise");
    EXPECT_OK(&c, "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--num-query-groups", "4");
    EXPECT_CONFIG_ERROR("--fp8-recipe mxfp8", "moe.experts.fc2 has input width 48",
                        "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8",
                        "--moe-ffn-hidden-size", "48");
    EXPECT_CONFIG_ERROR("--fp4-recipe nvfp4", "mlp.fc2 has input width 40", "--fp4-format",
                        "e2m1", "--moe-layer-freq", "2", "--ffn-hidden-size", "40");
    EXPECT_CONFIG_ERROR("moe.shared.fc1", "output width 48", "--fp8-format", "e4m3",
                        "--fp8-recipe", "mxfp8", "--moe-shared-expert-intermediate-size", "24");
    EXPECT_OK(&c, "--fp8-format", "e4m3", "--hidden-size", "40", "--num-attention-heads", "4",
              "--moe-ffn-hidden-size", "24"); /* tensorwise takes any width */
    EXPECT_CONFIG_ERROR("--fp8-format e4m3 and --fp4-format e2m1", "pick one", "--fp8-format",
                        "e4m3", "--fp4-format", "e2m1");
    /* delayed scaling and its options (lowp.h, "Delayed scaling") */
    EXPECT_OK(&c, "--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-amax-history-len",
              "16", "--fp8-amax-compute-algo", "max", "--fp8-margin", "2");
    ck_assert_int_eq(c.fp8_amax_history_len, 16);
    ck_assert_str_eq(c.fp8_amax_compute_algo, "max");
    ck_assert_int_eq(c.fp8_margin, 2);
    EXPECT_CONFIG_ERROR("--fp8-amax-history-len 0", "N >= 1", "--fp8-format", "e4m3",
                        "--fp8-recipe", "delayed", "--fp8-amax-history-len", "0");
    EXPECT_CONFIG_ERROR("--fp8-margin -1", "0 to 64", "--fp8-format", "e4m3", "--fp8-recipe",
                        "delayed", "--fp8-margin", "-1");
    EXPECT_CONFIG_ERROR("--fp8-margin 65", "2^margin", "--fp8-format", "e4m3", "--fp8-recipe",
                        "delayed", "--fp8-margin", "65");
    EXPECT_FLAG_ERROR("--fp8-amax-compute-algo", "mean", "--fp8-format", "e4m3",
                      "--fp8-recipe", "delayed", "--fp8-amax-compute-algo", "mean");
    EXPECT_FLAG_ERROR("--fp8-recipe", "fp9", "--fp8-format", "e4m3", "--fp8-recipe", "fp9");
    EXPECT_FLAG_ERROR("--fp4-format", "e3m0", "--fp4-format", "e3m0");
    EXPECT_CONFIG_ERROR("--use-distributed-optimizer", "drop one", "--fp8-format", "e4m3",
                        "--use-distributed-optimizer");
    EXPECT_CONFIG_ERROR("--moe-permute-fusion", "the unquantized tokens", "--fp8-format", "e4m3",
                        "--moe-permute-fusion", "--moe-expert-backend", "grouped");
    /* NVFP4 under CUDA graphs: the stochastic rounding's draw counter lives in device memory
     * (quantize.h, moe_nvfp4_opts::sr_counter), so a replay draws fresh seeds */
    EXPECT_OK(&c, "--fp4-format", "e2m1", "--cuda-graph-scope", "attn");
    ck_assert_str_eq(c.cuda_graph_scope, "attn");
    /* the wgrad's random Hadamard transform: on by default, off by flag, NVFP4 only */
    ck_assert_int_eq(c.fp4_disable_rht, 0);
    EXPECT_OK(&c, "--fp4-format", "e2m1", "--fp4-disable-rht");
    ck_assert_int_eq(c.fp4_disable_rht, 1);
    EXPECT_CONFIG_ERROR("--fp4-disable-rht without --fp4-format e2m1", "part of the NVFP4 recipe",
                        "--fp4-disable-rht");
    EXPECT_CONFIG_ERROR("--fp4-disable-rht without --fp4-format e2m1", "drop --fp4-disable-rht",
                        "--fp8-format", "e4m3", "--fp4-disable-rht");
    /* the default (no flag) is off */
    EXPECT_OK(&c, "--seed", "1");
    ck_assert_str_eq(c.fp8_format, "none");
    ck_assert_str_eq(c.fp4_format, "none");
    /* Megatron's defaults for delayed scaling */
    ck_assert_int_eq(c.fp8_amax_history_len, 1);
    ck_assert_str_eq(c.fp8_amax_compute_algo, "most_recent");
    ck_assert_int_eq(c.fp8_margin, 0);
}
END_TEST

START_TEST(test_val_dense_model) {
    moe_config c;
    /* router settings are irrelevant in a dense model and are not checked */
    EXPECT_OK(&c, "--num-experts", "0", "--moe-router-topk", "5", "--moe-router-num-groups", "3");
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        ck_assert_int_eq(c.is_moe_layer[l], 0);
    /* --moe-layer-freq is ignored without experts */
    EXPECT_OK(&c, "--num-experts", "0", "--moe-layer-freq", "1,1,1,1");
    for (int l = 0; l < c.num_layers; l++)
        ck_assert_int_eq(c.is_moe_layer[l], 0);
    EXPECT_CONFIG_ERROR("--ffn-hidden-size", "dense", "--num-experts", "0", "--ffn-hidden-size",
                        "0");
    /* a layer mask of all zeros is dense too */
    EXPECT_OK(&c, "--moe-layer-freq", "0,0,0,0", "--moe-router-topk", "99");
    for (int l = 0; l < c.num_layers; l++)
        ck_assert_int_eq(c.is_moe_layer[l], 0);
}
END_TEST

/* ------------------------------------------------------------------ backend */

/* --moe-expert-backend: explicit choices, and what auto means on each backend */
START_TEST(test_expert_backend_choice) {
    const moe_backend *cpu = moe_backend_cpu();
    moe_backend gpu = *cpu; /* a stand-in with a GPU's device tag: only the tag is read */
    gpu.device = MOE_DEVICE_CUDA;
    moe_config c;
    EXPECT_OK(&c, "--moe-expert-backend", "loop");
    ck_assert_int_eq(moe_expert_impl_from_config(&c, &gpu), MOE_EXPERTS_LOOP);
    EXPECT_OK(&c, "--moe-expert-backend", "cublas-grouped");
    ck_assert_int_eq(moe_expert_impl_from_config(&c, cpu), MOE_EXPERTS_CUBLAS);
    EXPECT_OK(&c, "--moe-expert-backend", "grouped");
    ck_assert_int_eq(moe_expert_impl_from_config(&c, cpu), MOE_EXPERTS_KERNEL);
    EXPECT_OK(&c); /* auto: the loop on the CPU, our kernel on a GPU */
    ck_assert_int_eq(moe_expert_impl_from_config(&c, cpu), MOE_EXPERTS_LOOP);
    ck_assert_int_eq(moe_expert_impl_from_config(&c, &gpu), MOE_EXPERTS_KERNEL);
    EXPECT_OK(&c, "--moe-grouped-gemm"); /* Megatron's switch makes auto grouped on the CPU */
    ck_assert_int_eq(moe_expert_impl_from_config(&c, cpu), MOE_EXPERTS_KERNEL);
    /* auto on a GPU with a shape the kernel does not take: cuBLAS's grouped GEMM */
    EXPECT_OK(&c, "--hidden-size", "132", "--num-attention-heads", "6");
    ck_assert_int_eq(moe_expert_impl_from_config(&c, &gpu), MOE_EXPERTS_CUBLAS);
    EXPECT_FLAG_ERROR("--moe-expert-backend", "fast", "--moe-expert-backend", "fast");
}
END_TEST

START_TEST(test_backend_select) {
    const moe_backend *b = NULL;
    moe_error err;
    moe_error_clear(&err);
    const int gpu = moe_test_have_gpu();
    if (gpu) { /* on a GPU machine cuda must work, and auto must pick it */
        ck_assert_int_eq(moe_backend_select("cuda", &b, &err), MOE_OK);
        ck_assert_int_eq(b->device, MOE_DEVICE_CUDA);
    } else {
        ck_assert_int_eq(moe_backend_select("cuda", &b, &err), MOE_ERR_BACKEND);
        ck_assert_int_eq(err.code, MOE_ERR_BACKEND);
        ck_assert_msg(strstr(err.msg, "--device") != NULL, "%s", err.msg);
        ck_assert_msg(strstr(err.msg, "cpu") != NULL, "message does not suggest cpu: %s",
                      err.msg);
    }

    b = NULL;
    ck_assert_int_eq(moe_backend_select("cpu", &b, &err), MOE_OK);
    ck_assert_ptr_nonnull(b);
    ck_assert_ptr_eq(b, moe_backend_cpu());
    ck_assert_int_eq(b->device, MOE_DEVICE_CPU);
    ck_assert_str_eq(b->name, "cpu");
    b = NULL;
    ck_assert_int_eq(moe_backend_select("auto", &b, &err), MOE_OK);
    ck_assert_int_eq(b->device, gpu ? MOE_DEVICE_CUDA : MOE_DEVICE_CPU);

    moe_error_clear(&err);
    ck_assert_int_ne(moe_backend_select("tpu", &b, &err), MOE_OK);
    ck_assert_msg(strstr(err.msg, "--device") != NULL, "%s", err.msg);
}
END_TEST

/* ------------------------------------------------------------------ --help and the flag table */

START_TEST(test_help_lists_every_flag) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ck_assert_ptr_nonnull(f);
    moe_config_print_help(f, "moe-train");
    fclose(f);
    ck_assert_ptr_nonnull(buf);
    ck_assert_msg(strstr(buf, "usage: moe-train") != NULL, "%s", buf);

    int n;
    const moe_flag *flags = moe_config_flags(&n);
    ck_assert_int_gt(n, 40);
    for (int i = 0; i < n; i++) {
        /* the line that starts with the flag (followed by a space, so --lr is not --lr-…) */
        char key[160];
        snprintf(key, sizeof key, "\n  --%s ", flags[i].name);
        const char *line = strstr(buf, key);
        ck_assert_msg(line != NULL, "--help does not list --%s", flags[i].name);
        line++;
        const char *eol = strchr(line, '\n');
        ck_assert_ptr_nonnull(eol);
        size_t ll = (size_t)(eol - line);
        char *text = malloc(ll + 1);
        ck_assert_ptr_nonnull(text);
        memcpy(text, line, ll);
        text[ll] = '\0';
        char want[600];
        if (flags[i].type == MOE_FLAG_BOOL && !strcmp(flags[i].def, "1"))
            snprintf(want, sizeof want, "(default: on; --no-%s turns it off)", flags[i].name);
        else if (flags[i].type == MOE_FLAG_BOOL)
            snprintf(want, sizeof want, "(default: off)");
        else
            snprintf(want, sizeof want, "(default: %s)", *flags[i].def ? flags[i].def : "none");
        ck_assert_msg(strstr(text, want) != NULL, "help line for --%s lacks '%s': %s",
                      flags[i].name, want, text);
        ck_assert_msg(strstr(text, flags[i].help) != NULL, "help line for --%s lacks its meaning",
                      flags[i].name);
        if (flags[i].type == MOE_FLAG_CHOICE)
            ck_assert_msg(strstr(text, flags[i].choices) != NULL, "--%s: choices not listed",
                          flags[i].name);
        free(text);
    }
    free(buf);
}
END_TEST

START_TEST(test_flag_table_sane) {
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    for (int i = 0; i < n; i++) {
        const moe_flag *f = &flags[i];
        ck_assert_ptr_nonnull(f->name);
        ck_assert_ptr_nonnull(f->def);
        ck_assert_ptr_nonnull(f->help);
        ck_assert_ptr_nonnull(f->group);
        ck_assert_msg(strncmp(f->name, "-", 1) != 0 && !strchr(f->name, '_') &&
                          !strchr(f->name, '='),
                      "flag name '%s' must be dashed, without leading dashes", f->name);
        ck_assert_msg(f->offset < sizeof(moe_config), "--%s: offset out of the struct", f->name);
        ck_assert_msg((f->type == MOE_FLAG_CHOICE) == (f->choices != NULL),
                      "--%s: choices given iff the flag is a choice", f->name);
        for (int j = 0; j < i; j++) {
            ck_assert_msg(strcmp(f->name, flags[j].name) != 0, "--%s listed twice", f->name);
            ck_assert_msg(f->offset != flags[j].offset, "--%s and --%s share a field", f->name,
                          flags[j].name);
        }
    }
}
END_TEST

START_TEST(test_every_default_round_trips) {
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    moe_config ref;
    moe_config_defaults(&ref);
    for (int i = 0; i < n; i++) {
        const moe_flag *f = &flags[i];
        char arg[700];
        moe_config c;
        moe_error err;

        /* --name=default */
        snprintf(arg, sizeof arg, "--%s=%s", f->name, f->def);
        moe_status s = parse_only(&c, &err, ARGS(arg));
        ck_assert_msg(s == MOE_OK, "%s: %s", arg, err.msg);
        ck_assert_msg(memcmp(&c, &ref, sizeof c) == 0, "%s changed the config", arg);
        c.vocab_size = 65;
        s = moe_config_validate(&c, &err);
        ck_assert_msg(s == MOE_OK, "%s does not validate: %s", arg, err.msg);

        /* --name default (switches only take the = form) */
        if (f->type != MOE_FLAG_BOOL) {
            snprintf(arg, sizeof arg, "--%s", f->name);
            s = parse_validate(&c, &err, ARGS(arg, (char *)f->def));
            ck_assert_msg(s == MOE_OK, "%s '%s': %s", arg, f->def, err.msg);
        }

        /* the value as formatted for the metrics dump parses back to the same config */
        char val[MOE_FLAG_STR_LEN];
        moe_flags_format_value(f, &ref, val, sizeof val);
        snprintf(arg, sizeof arg, "--%s=%s", f->name, val);
        s = parse_only(&c, &err, ARGS(arg));
        ck_assert_msg(s == MOE_OK, "%s: %s", arg, err.msg);
        ck_assert_msg(memcmp(&c, &ref, sizeof c) == 0, "%s (formatted) changed the config", arg);
    }
}
END_TEST

/* ------------------------------------------------- parallel folding (chapter 04) */

/* Every inconsistent combination of the parallel sizes that does not depend on the number
 * of ranks is a named error (moe_grid_resolve() and its tests in test_parallel.c cover the
 * products that must divide the world). */
START_TEST(test_val_folding) {
    moe_config c;
#define DENSE "--num-experts", "0"
    EXPECT_OK(&c, DENSE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--make-vocab-size-divisible-by", "8");
    ck_assert_int_eq(c.tensor_model_parallel_size, 2);
    ck_assert_int_eq(c.sequence_parallel, 1);
    ck_assert_int_eq(c.vocab_size, 72); /* the tokenizer's 65 ids, padded to a multiple of 8 */
    EXPECT_OK(&c, "--make-vocab-size-divisible-by", "5");
    ck_assert_int_eq(c.vocab_size, 65); /* already a multiple: unchanged */
    /* the vocabulary is split by rows over TP: 65 ids cannot be, and the message says how */
    EXPECT_CONFIG_ERROR("vocabulary (65 ids", "--make-vocab-size-divisible-by 2", DENSE,
                        "--tensor-model-parallel-size", "2");
    EXPECT_CONFIG_ERROR("--make-vocab-size-divisible-by", "between 1 and 65536",
                        "--make-vocab-size-divisible-by", "0");
    EXPECT_CONFIG_ERROR("--tensor-model-parallel-size", ">= 1", DENSE,
                        "--tensor-model-parallel-size", "0");
    EXPECT_CONFIG_ERROR("--sequence-parallel", "--tensor-model-parallel-size > 1",
                        "--sequence-parallel");
    EXPECT_CONFIG_ERROR("--num-attention-heads 4", "--tensor-model-parallel-size 8", DENSE,
                        "--tensor-model-parallel-size", "8", "--hidden-size", "256");
    EXPECT_CONFIG_ERROR("--num-query-groups 2", "does not replicate key/value heads", DENSE,
                        "--tensor-model-parallel-size", "4");
    EXPECT_CONFIG_ERROR("--ffn-hidden-size 30", "fc1", DENSE, "--ffn-hidden-size", "30",
                        "--tensor-model-parallel-size", "4", "--num-query-groups", "4");
    EXPECT_CONFIG_ERROR("--seq-length 10", "--sequence-parallel", DENSE, "--seq-length", "10",
                        "--tensor-model-parallel-size", "4", "--num-query-groups", "4",
                        "--sequence-parallel");
    /* context parallelism (chapter 07): 2·CP chunks of every sequence, an exchange that fits
     * the heads of a TP rank, a2a+p2p's two levels, and no per-sequence aux loss */
    EXPECT_OK(&c, "--context-parallel-size", "4");
    ck_assert_int_eq(c.cp_comm, MOE_CP_P2P);
    EXPECT_OK(&c, "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
              "--hierarchical-context-parallel-sizes", "2,2");
    ck_assert_int_eq(c.cp_comm, MOE_CP_A2A_P2P);
    ck_assert_int_eq(c.cp_a2a, 2);
    EXPECT_CONFIG_ERROR("--seq-length 12 is not a multiple of 2 x --context-parallel-size (8)",
                        "Use --seq-length 8 or 16", "--context-parallel-size", "4",
                        "--seq-length", "12");
    EXPECT_CONFIG_ERROR("--cp-comm-type a2a splits the heads", "--num-query-groups 2",
                        "--context-parallel-size", "4", "--cp-comm-type", "a2a");
    EXPECT_CONFIG_ERROR("--cp-comm-type a2a splits the heads", "use --cp-comm-type p2p",
                        "--context-parallel-size", "2", "--cp-comm-type", "a2a",
                        "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                        "2", "--num-experts", "0");
    EXPECT_CONFIG_ERROR("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
                        "A x P = --context-parallel-size 4", "--context-parallel-size", "4",
                        "--cp-comm-type", "a2a+p2p");
    EXPECT_CONFIG_ERROR("--hierarchical-context-parallel-sizes '2,4'", "product",
                        "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                        "--hierarchical-context-parallel-sizes", "2,4");
    EXPECT_CONFIG_ERROR("--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p",
                        "drop it", "--context-parallel-size", "4",
                        "--hierarchical-context-parallel-sizes", "2,2");
    { /* the per-sequence aux loss runs under CP (each sequence's two chunks per rank) */
        moe_config cs;
        EXPECT_OK(&cs, "--context-parallel-size", "2", "--moe-router-load-balancing-type",
                  "seq_aux_loss");
    }
    EXPECT_FLAG_ERROR("--cp-comm-type", "ring", "--cp-comm-type", "ring");
    EXPECT_CONFIG_ERROR("--pipeline-model-parallel-size 2", "not planned",
                        "--pipeline-model-parallel-size", "2");
    /* ETP splits each expert's width (moe/expert_tp.h): it must divide it, and the fused
     * permutation (one rank, tokens read in place) cannot gather the ETP group's rows */
    EXPECT_OK(&c, "--expert-tensor-parallel-size", "2");
    EXPECT_CONFIG_ERROR("--moe-ffn-hidden-size 30 is not divisible by "
                        "--expert-tensor-parallel-size 4", "a multiple of 4",
                        "--moe-ffn-hidden-size", "30", "--expert-tensor-parallel-size", "4");
    EXPECT_CONFIG_ERROR("--moe-permute-fusion with --expert-tensor-parallel-size 2",
                        "drop --moe-permute-fusion", "--moe-permute-fusion",
                        "--expert-tensor-parallel-size", "2");
    /* MoE layers with TP run on sequence shards: SP is required, and the shared expert is
     * split like a dense FFN */
    EXPECT_CONFIG_ERROR("--tensor-model-parallel-size 2 with MoE layers",
                        "needs --sequence-parallel", "--tensor-model-parallel-size", "2",
                        "--make-vocab-size-divisible-by", "2");
    EXPECT_OK(&c, "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--make-vocab-size-divisible-by", "2", "--expert-model-parallel-size", "2");
    EXPECT_CONFIG_ERROR("--moe-shared-expert-intermediate-size 7", "shared expert",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--make-vocab-size-divisible-by", "2",
                        "--moe-shared-expert-intermediate-size", "7");
    EXPECT_CONFIG_ERROR("--num-experts 8", "--expert-model-parallel-size 3",
                        "--expert-model-parallel-size", "3");
#undef DENSE
}
END_TEST

/* A folded run whose capacity drops tokens cannot equal one process: the start-up warning
 * says so under TP (each rank routes its sequence shard), and stays quiet where the run does
 * equal one process (EP alone, or dropless). */
static int drop_warning(int argc, char **argv) {
    moe_config c;
    moe_error err;
    ck_assert_msg(parse_validate(&c, &err, argc, argv) == MOE_OK, "%s", err.msg);
    moe_config_warnings_t w;
    moe_config_warnings(&c, &w);
    int n = 0;
    for (int i = 0; i < w.n; i++)
        if (strstr(w.msg[i], "token drops depend on the local batch")) {
            ck_assert_msg(strstr(w.msg[i], "--moe-expert-capacity-factor 1 with "
                                           "--tensor-model-parallel-size 2") &&
                              strstr(w.msg[i], "differs from one process by design") &&
                              strstr(w.msg[i], "dropless runs match"),
                          "%s", w.msg[i]);
            n++;
        }
    return n;
}

START_TEST(test_warn_folded_drops) {
#define TP2 "--tensor-model-parallel-size", "2", "--sequence-parallel", \
            "--make-vocab-size-divisible-by", "8"
    ck_assert_int_eq(drop_warning(ARGS(TP2, "--moe-expert-capacity-factor", "1.0")), 1);
    ck_assert_int_eq(drop_warning(ARGS(TP2)), 0); /* dropless */
    /* a factor of at least E/k = 8/2 never drops */
    ck_assert_int_eq(drop_warning(ARGS(TP2, "--moe-expert-capacity-factor", "4")), 0);
    /* EP alone: each rank's micro-batch is whole, as on one process (tests/mpi_ep.c) */
    ck_assert_int_eq(drop_warning(ARGS("--expert-model-parallel-size", "2",
                                       "--moe-expert-capacity-factor", "1.0")), 0);
#undef TP2
}
END_TEST

Suite *suite_config(void) {
    Suite *s = suite_create("config");

    TCase *def = tcase_create("defaults");
    tcase_add_test(def, test_defaults_validate);
    tcase_add_test(def, test_resolved_fields);
    tcase_add_test(def, test_flag_table_sane);
    tcase_add_test(def, test_every_default_round_trips);
    tcase_add_test(def, test_help_lists_every_flag);
    suite_add_tcase(s, def);

    TCase *par = tcase_create("parse");
    tcase_add_test(par, test_parse_forms);
    tcase_add_test(par, test_parse_bool);
    tcase_add_test(par, test_parse_choice);
    tcase_add_test(par, test_parse_errors);
    tcase_add_test(par, test_parse_help);
    suite_add_tcase(s, par);

    TCase *val = tcase_create("validate");
    tcase_add_test(val, test_val_groups_divisible);
    tcase_add_test(val, test_val_group_topk_gt_groups);
    tcase_add_test(val, test_val_topk_div_group_topk);
    tcase_add_test(val, test_val_group_topk_per_group);
    tcase_add_test(val, test_val_groups_need_both);
    tcase_add_test(val, test_val_topk_gt_experts);
    tcase_add_test(val, test_val_topk_zero);
    tcase_add_test(val, test_val_query_groups);
    tcase_add_test(val, test_val_hidden_div_heads);
    tcase_add_test(val, test_val_odd_head_dim);
    tcase_add_test(val, test_val_sizes);
    tcase_add_test(val, test_val_global_batch);
    tcase_add_test(val, test_val_pre_softmax_sigmoid);
    tcase_add_test(val, test_val_expert_bias_softmax);
    tcase_add_test(val, test_val_negative_coefficients);
    tcase_add_test(val, test_val_min_lr);
    tcase_add_test(val, test_val_adam_betas);
    tcase_add_test(val, test_val_layer_freq_errors);
    tcase_add_test(val, test_val_layer_freq_mask);
    tcase_add_test(val, test_val_dense_model);
    tcase_add_test(val, test_val_lowp);
    suite_add_tcase(s, val);

    TCase *fold = tcase_create("folding");
    tcase_set_tags(fold, "ch04");
    tcase_add_test(fold, test_val_folding);
    tcase_add_test(fold, test_warn_folded_drops);
    suite_add_tcase(s, fold);

    TCase *be = tcase_create("backend");
    tcase_add_test(be, test_backend_select);
    tcase_add_test(be, test_expert_backend_choice);
    suite_add_tcase(s, be);
    return s;
}
