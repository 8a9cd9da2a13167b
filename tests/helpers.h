/**
 * @file helpers.h
 * @brief Small helpers shared by the Check test suites.
 */
#ifndef MOE_TEST_HELPERS_H
#define MOE_TEST_HELPERS_H

#include <check.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "config.h"
#include "params.h"
#include "real.h"

/** 1 when MOE_TEST_QUICK is set (the sanitizer run uses smaller problems). */
int moe_test_quick(void);

/** Fill @p x with n normals * scale from the counter-based RNG (stream picks the tensor). */
void moe_test_randn(moe_real *x, size_t n, uint64_t stream, double scale);

/** Fill @p x with n copies of NaN, so outputs that a function forgot to write fail the check. */
void moe_test_poison(moe_real *x, size_t n);

/** A buffer of @p be holding n normals * scale in its activation type, and the same values
 *  (rounded to it) in @p host, so both backends start from the same numbers. */
void *moe_test_upload(const moe_backend *be, moe_real *host, size_t n, uint64_t stream,
                      double scale);

/** A parameter table for the multi-tensor AdamW's tests: runs of several chunks
 *  (::MOE_ADAMW_CHUNK), odd lengths (so some runs start off 16-byte alignment) and mixed
 *  weight decay: big (3 chunks + 5, decay), odd [2,3,7] (decay), n1 [13], c [129,65] (decay),
 *  n2 [1], e [256,64] (decay), d [chunk + 1] (decay). Free with moe_params_free(). */
moe_param_table moe_test_adamw_table(void);

/** The `adamw` op's run list for plain arrays of @p n elements (> 0): one run at offset 0,
 *  with weight decay, in @p be's memory; release it with be->free(runs.run). */
moe_adamw_runs moe_test_adamw_flat(const moe_backend *be, size_t n);

/** Largest |a-b| / max(|b|, floor) over n elements (NaN counts as infinite). */
double moe_test_max_rel_err(const moe_real *a, const moe_real *b, size_t n, double floor);

/** Parse a space-separated flag string over the defaults into @p cfg (not validated).
 *  Returns moe_config_parse's status. */
moe_status moe_test_config(moe_config *cfg, const char *flags, moe_error *err);

/** 1 when this build has the CUDA backend and a GPU is usable (tests that expect
 *  "no GPU" errors check the other branch then). */
int moe_test_have_gpu(void);

/** A temporary file path unique to this process (caller frees nothing; static buffer per call site is not kept). */
void moe_test_tmp_path(char *out, size_t cap, const char *name);

/** Run a shell command (from the repository root), capture its stdout and stderr into @p out
 *  (@p cap bytes, zero-terminated) and return its exit status (-1 when it did not exit). */
int moe_test_run(const char *cmd, char *out, size_t cap);

/** 1 when the program @p path (e.g. "bin/moe-train") has been built; else 0, after printing
 *  that the test that needs it is skipped. */
int moe_test_have_program(const char *path);

/** Resume reproduces the loss curve bit for bit, through bin/moe-train: train @p flags for
 *  @p steps steps (the reference); start the same run towards a far step count with
 *  `--save DIR --save-interval 2` and interrupt it with @p sig once it is past half of
 *  @p steps (SIGKILL: a real kill -9 once a checkpoint at or after half exists; SIGTERM:
 *  with --exit-signal-handler, which must save and exit 0); resume it with --load DIR up to
 *  @p steps; every resumed step's loss in the metrics file must equal the reference's
 *  character for character (17 significant digits: the same double). @p flags must fix
 *  --lr-decay-iters, so that --train-iters does not move the LR schedule.
 *  @return 1 on success, else 0 with the reason in @p why */
struct moe_trainer;
struct moe_step_stats;
/** One training step that must succeed (ck_assert); returns its loss. */
double moe_test_step(struct moe_trainer *t);

int moe_test_resume_after_signal(const char *flags, int steps, int sig, char *why, size_t cap);

struct moe_comm;
/** A trainer from @p flags (plus `--device cuda` when @p gpu, else cpu) over @p world (NULL:
 *  one process), with no data download; any failure fails the test. */
struct moe_trainer *moe_test_trainer(const char *flags, struct moe_comm *world, int gpu);

/** A folding and its one-process reference on the same global batch (2 micro-batches of
 *  2 sequences per data-parallel rank): @p dist over @p world at TP @p tp (with
 *  `--sequence-parallel` when @p sp) and EP @p ep, with @p dist_flags; @p ref in one
 *  process. Both get @p base and @p common. @return 0, making nothing, when the world's
 *  size is not a multiple of @p tp and @p ep (the folding does not fit), else 1.
 *
 *  On GPU ranks (@p gpu) the pair is also checked to route every token alike: under TP the
 *  row-parallel GEMMs' partial sums are added in bf16 by the collective, while one process
 *  rounds once, so the router's input differs in its last bits and a token whose top-k
 *  logits are nearly tied can pick another expert; its expert gradients are then not
 *  comparable. The step's global expert loads (moe_model::load_counts, summed over the
 *  ranks by the trainer) are compared, and while they differ the pair is rebuilt with the
 *  next `--seed` (up to 8; every rank sees the same sums, so all decide alike). The
 *  first step's gradients are computed for that check: the caller's
 *  moe_trainer_gradients() recomputes them, bit for bit. */
int moe_test_folding(struct moe_comm *world, const char *base, int tp, int sp, int ep,
                     const char *common,
                     const char *dist_flags, int gpu, struct moe_trainer **dist,
                     struct moe_trainer **ref);

/** A distributed trainer's model against the single-process reference's, tensor by tensor
 *  (by name): each tensor's gradient is this rank's shard of the reference's (element j
 *  against element moe_tensor_global_index(j) of the whole tensor) within a relative L2 error
 *  of @p tol, and its fp32 master weights (moe_trainer_master_to_host(): gathered under the
 *  distributed optimizer, so every rank of @p dist must call this) are that slice exactly.
 *  @return the number of tensors that differ; @p worst and @p worst_name receive the largest
 *  gradient error and its tensor */
long long moe_test_compare_shards(struct moe_trainer *dist, struct moe_trainer *ref, double tol,
                                  double *worst, const char **worst_name);

/** After one moe_trainer_gradients() of each: 1 when @p dist routes every token as @p ref
 *  does (the same global expert loads: half their L1 distance is the assignments that
 *  moved; on GPU ranks bf16 partial sums under TP or ETP can tip a near-tied token to
 *  another expert, and then the expert gradients are not comparable); else says so on rank
 *  0 of @p world, naming @p what and @p seed, fails the test at the 8th seed, and returns
 *  0: the caller rebuilds its runs with the next `--seed` (every rank sees the same global
 *  loads, so all decide alike). @return 1 or 0 */
int moe_test_routes_alike(struct moe_comm *world, const struct moe_trainer *dist,
                          const struct moe_trainer *ref, int seed, const char *what);

/** The first step of a folding against one process: moe_trainer_gradients() of both
 *  into @p sd and @p sr, the loss error relative to the reference's into @p loss_err, and
 *  moe_test_compare_shards() at @p tol. @return the number of gradient tensors outside the
 *  bound, summed over the ranks of @p dist's world (so every rank sees the same count) */
long long moe_test_first_step(struct moe_trainer *dist, struct moe_trainer *ref, double tol,
                              double *loss_err, struct moe_step_stats *sd,
                              struct moe_step_stats *sr, double *worst, const char **worst_name);

/** Like moe_test_compare_shards(), with a bound for each buffer: the gradients within a
 *  relative L2 error of @p grad_tol (a negative bound skips them: e.g. under the distributed
 *  optimizer, where a rank holds only its shard of the reduced gradient), the master weights
 *  within @p param_tol (0: exactly). @return the number of (tensor, buffer) pairs that differ */
long long moe_test_compare_state(struct moe_trainer *dist, struct moe_trainer *ref,
                                 double grad_tol, double param_tol, double *worst,
                                 const char **worst_name);

/** The whole fp32 master weights of @p t on the host (moe_trainer_master_to_host(); a
 *  collective under the distributed optimizer). @return a malloc'd array the caller frees */
moe_real *moe_test_master(struct moe_trainer *t);

/** Adversarial routings for moe_test_budget_protocol(): every token's first choice is
 *  expert 0 in every layer, or a hot expert that changes with the layer and the step. */
enum { MOE_TEST_ROUTE_ONE_EXPERT = 0, MOE_TEST_ROUTE_ALTERNATING = 1 };

/** The static-budget overflow protocol (chapter 06) on one backend (@p gpu): trainers from
 *  @p flags (which must make the MoE layers sync-free: our grouped kernel, the sigmoid
 *  router with its expert bias, dropless, one rank) with a small budget (factor 0.5) and an
 *  ample one (1.0), the routing forced through the expert bias (@p route). Each of 3 steps:
 *  the ample run never overflows; the small one raises MOE_STEP_OVERFLOW on its first step
 *  (the test fails if not), grows, re-runs, and then gives exactly the ample run's loss,
 *  gradients and expert loads (bit for bit); both then take the optimizer step. */
void moe_test_budget_protocol(const char *flags, int gpu, int route);
/** Random permuted-row offsets of @p P ranks over @p E experts, as the fused dispatcher's
 *  device plan receives them (chapter 06): @p all_off [P, E+1], each rank's running sums of
 *  0..8 rows per expert (some empty; with @p hot, every rank's rows on expert 0 only, so
 *  rank 0 receives everything). @p seed advances. */
void moe_test_random_offsets(int *all_off, int P, int E, int hot, unsigned *seed);

/** How often the op table's host-blocking entries were called (moe_test_count_syncs). The
 *  scalars' and the optimizer's own (chapter 06) are to_host, read_act, synchronize and
 *  wait_to_host; from_host (the batch upload) and permute_index (the MoE layer's host
 *  offsets) are counted to be reported. */
typedef struct moe_test_sync_counts {
    long long to_host, read_act, synchronize, timer_end_ms; /**< each entry's calls */
    long long wait_to_host;  /**< the step boundary's wait */
    long long from_host;     /**< host → device copies (the batch's tokens) */
    long long permute_index; /**< the MoE layer's host offsets (its own sync) */
} moe_test_sync_counts;

/** Make @p t run on a copy of its op table whose host-blocking entries count their calls
 *  into @p counts (which the caller zeroes when it wants). One trainer at a time. */
void moe_test_count_syncs(struct moe_trainer *t, moe_test_sync_counts *counts);

/** Add to @p s a test case @p name of the @p n tests @p tests, each with @p timeout seconds.
 *  @return the test case */
TCase *moe_test_tcase(Suite *s, const char *name, double timeout, const TTest *const *tests,
                      int n);

/** A suite @p name of one test case tagged @p chapter (e.g. "ch02": make check-ch02 runs
 *  it) holding the @p n tests @p tests, 60 s each. @return the suite */
Suite *moe_test_chapter_suite(const char *name, const char *chapter, const TTest *const *tests,
                              int n);

#endif
