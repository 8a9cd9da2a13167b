/**
 * @file step_flags.h
 * @brief Bits of the step-flags word: events a training step raises on the device.
 *
 * A sync-free step cannot stop to ask the host what to do when something goes wrong inside it
 * (a static MoE buffer overflows, the loss is not finite). Instead the kernel that sees the
 * event ORs a bit into one device int, moe_model::step_flags. Kernels later in the same step
 * may read the word (the optimizer skips its update while a bit is set), and the host reads it
 * once per step, at the step boundary, together with the loss, and decides: re-run the step
 * eagerly with grown buffers, or stop the run with a message. The word is zeroed at the start
 * of every step.
 */
#ifndef MOE_STEP_FLAGS_H
#define MOE_STEP_FLAGS_H

/** A static MoE buffer (rows per expert / per rank) was too small: results of the step are
 *  incomplete, and the step must be re-run with grown buffers. */
#define MOE_STEP_OVERFLOW 1
/** The loss or the gradient norm is not finite: the update must not be applied. */
#define MOE_STEP_NONFINITE 2

#endif
