/**
 * @file bench.h
 * @brief What the benchmark programs share: the median of repeated timings, the header
 *        line every result table starts with, and the MoE layer shapes they measure.
 */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

/**
 * @brief The median of @p n timings (sorts @p v in place; the mean of the two middle
 *        values when @p n is even).
 * @param v timings  @param n how many (>= 1)
 * @return the median
 */
double moe_median(double *v, int n);

/**
 * @brief Print the first line of a benchmark table:
 *        "<title> | <device> | <UTC date> | commit <hash>" (see provenance.h).
 * @param title what is measured  @param device where (a device name, or "2 ranks x …")
 */
void moe_bench_header(const char *title, const char *device);

/** An environment variable as it was before moe_bench_env_set(), to put back. */
typedef struct moe_bench_env {
    const char *name; /**< the variable */
    int was_set;      /**< 1: it had a value (@ref value), 0: it was unset */
    char value[64];   /**< its former value (longer values are refused) */
} moe_bench_env;

/**
 * @brief Give an environment switch (MOE_FLASH_SM90, MOE_FP8_FUSED, ...) a value for one
 *        measurement or test, remembering the old one for moe_bench_env_restore().
 * @param name the variable  @param value its value for now
 * @return what to restore; a former value longer than 63 characters aborts with a message
 */
moe_bench_env moe_bench_env_set(const char *name, const char *value);

/**
 * @brief Put back what moe_bench_env_set() replaced: the former value, or unset.
 * @param e what moe_bench_env_set() returned
 */
void moe_bench_env_restore(const moe_bench_env *e);

/**
 * @brief Parse a benchmark flag's comma list of positive integers ("1024,4096,16384").
 * @param s the list  @param out receives the values  @param cap room in @p out
 * @return how many values (>= 1), or -1 for an empty list, a value that is not an integer
 *         in 1 .. 2^24, anything else between the commas, or more than @p cap values
 */
int moe_bench_parse_ints(const char *s, int *out, int cap);

/** One MoE layer shape: tokens, hidden size, expert width, experts, top-k. */
typedef struct moe_bench_shape {
    const char *name; /**< qwen3, mixtral, qwen3-235b, dsv2-lite, sweepR, small or preset */
    int T;            /**< tokens */
    int H;            /**< hidden size */
    int F;            /**< expert intermediate size */
    int E;            /**< experts */
    int k;            /**< top-k */
} moe_bench_shape;

/**
 * @brief The benchmark layer shapes — Qwen3-30B-A3B (T=16384, H=2048, F=768, E=128,
 *        k=8), Mixtral-8x7B (T=8192, H=4096, F=14336, E=8, k=2), Qwen3-235B-A22B
 *        (T=8192, H=4096, F=1536, E=128, k=8), DeepSeek-V2-Lite (T=16384, H=2048,
 *        F=1408, E=64, k=6), the sweep "sweepR" of R = 64 .. 8192 rows per expert at
 *        H=4096, F=1536, k=8 (T=8192, E=T·k/R, at most 256 experts: T shrinks below
 *        R = 256) — "small", a CPU-sized one (T=2048, H=256, F=256, E=16, k=4), and
 *        "preset", the GPU preset's MoE layer (T=8192, H=384, F=768, E=8, k=2).
 * @param n receives how many
 * @return the table
 */
const moe_bench_shape *moe_bench_shapes(int *n);

/**
 * @brief Whether a `--shape` choice selects @p name: "all", the name itself, "models"
 *        (the four model shapes), "sweep" (the sweep), "big" (both, not small or
 *        preset), or "auto" (qwen3
 *        and mixtral on a GPU, small on the CPU).
 * @param want the flag's value  @param name a shape's name  @param on_gpu 1 on a GPU
 * @return 1 when selected
 */
int moe_bench_shape_wanted(const char *want, const char *name, int on_gpu);

#endif /* MOE_BENCH_H */
