/**
 * @file checkpoint.h
 * @brief Checkpoint and resume a training run (Megatron's --save, --load, --save-interval).
 *
 * A checkpoint is a directory per saved step under the --save directory:
 *
 *     DIR/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
 *     DIR/iter_0000200/rank_00000.moeckpt       one file per rank (checkpoint_file.h)
 *     DIR/iter_0000200/rank_00001.moeckpt
 *
 * What it holds: the fp32 master weights (the bf16 compute copy is derived from them), both
 * AdamW moments, the step (which is also the LR-schedule position, the AdamW bias
 * correction and the data position: batches and weights come from the counter-based RNG,
 * so a run's whole random state is its seed and its step), the aux-loss-free expert bias,
 * and every flag as text. Each tensor is stored once: by the first of the ranks holding the
 * same shard (its replicas), under its name and shard, so a checkpoint can be loaded into
 * another folding: every tensor is reassembled from its shards and sliced again for the
 * loading run's layout (EP2 -> EP1, EP1 -> EP4, and the same for the moments).
 *
 * A save is atomic: every rank writes its file atomically (temporary file, fsync, rename),
 * the ranks agree that all succeeded, and only then does rank 0 move the `latest` pointer
 * (atomically too) and delete checkpoints beyond the last --keep-last. A crash at any moment
 * leaves `latest` naming a complete checkpoint. A load reads and verifies every file (every
 * checksum, the step and file count of each file, the model-shape flags) before it changes
 * anything; a failure leaves the trainer as it was and is a named error on every rank.
 */
#ifndef MOE_CHECKPOINT_H
#define MOE_CHECKPOINT_H

#include "error.h"
#include "trainer.h"

/** The name of the pointer file in a checkpoint directory (Megatron's). */
#define MOE_CKPT_LATEST "latest_checkpointed_iteration.txt"

/**
 * @brief Save the trainer's state at its current step into @p dir (created if missing).
 *        Collective: every rank of the trainer calls it.
 * @param t trainer  @param dir checkpoint directory (--save)
 * @param keep_last checkpoints to keep (0 = all): older ones are deleted once this one is
 *        complete
 * @param err receives the reason on failure (the same failure on every rank)
 * @return ::MOE_OK, ::MOE_ERR_IO (the previous checkpoint is then still the latest) or
 *         ::MOE_ERR_NOMEM
 */
moe_status moe_checkpoint_save(moe_trainer *t, const char *dir, int keep_last, moe_error *err);

/**
 * @brief Resume from the latest checkpoint in @p dir: weights, moments, step and expert
 *        bias, resharded to this trainer's layout. Collective.
 *
 * Flags that shape the model (layers, sizes, heads, experts, MoE layers, shared expert,
 * tokenizer, expert bias) must match the saved run: a difference is ::MOE_ERR_CONFIG
 * naming the flag. A different training setting (learning rate, batch sizes, seed, router
 * coefficients, ...) is allowed with a warning, since the run then no longer reproduces an
 * uninterrupted one. How the run is executed may change freely: --train-iters, the device,
 * the expert-parallel size, the dispatcher and expert backend, logging and output.
 *
 * @param t trainer (freshly created)  @param dir checkpoint directory (--load)
 * @param fresh_ok 1 when a directory without a checkpoint means "start from step 0" (the
 *        --load directory is also the --save directory: the first run of a job)
 * @param loaded receives 1 when a checkpoint was loaded, 0 when the run starts fresh
 * @param err receives the reason on failure: ::MOE_ERR_IO (no checkpoint, a missing shard
 *        file), ::MOE_ERR_DATA (corrupt, truncated, of another format or version, files of
 *        different checkpoints), ::MOE_ERR_CONFIG (a model-shape mismatch)
 * @return ::MOE_OK or the error's code; on failure nothing of the trainer has changed
 */
moe_status moe_checkpoint_load(moe_trainer *t, const char *dir, int fresh_ok, int *loaded,
                               moe_error *err);

#endif /* MOE_CHECKPOINT_H */
