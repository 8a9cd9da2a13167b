/**
 * @file error.h
 * @brief Error values at the library boundary.
 *
 * Every public function that can fail for a reason the user can fix (a bad
 * flag, a missing file, a corrupt checkpoint) returns a ::moe_status and fills
 * a ::moe_error whose message names the flag or file and says how to fix it.
 * Programs print the message and exit non-zero; nothing in the library calls
 * exit() for a user error.
 *
 * Programming errors inside the library (a violated invariant) are different:
 * they abort through MOE_ASSERT with file and line, because no caller can
 * recover from them.
 */
#ifndef MOE_ERROR_H
#define MOE_ERROR_H

#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" { /* CUDA files (kernels/fp8_gemm.cu) set named errors too */
#endif

/** Status codes. 0 is success; every failure has its own code so tests can
 *  check that the *right* error was reported, not just "some" error. */
typedef enum moe_status {
    MOE_OK = 0,           /**< success */
    MOE_ERR_CONFIG = 1,   /**< an invalid or inconsistent configuration value */
    MOE_ERR_FLAG = 2,     /**< an unknown flag or a value that does not parse */
    MOE_ERR_IO = 3,       /**< a file could not be found, read or written */
    MOE_ERR_DATA = 4,     /**< a file was read but its content is wrong */
    MOE_ERR_NOMEM = 5,    /**< an allocation failed */
    MOE_ERR_BACKEND = 6,  /**< the requested backend is not available */
    MOE_ERR_HELP = 7,     /**< not an error: --help was given, help was printed */
    MOE_ERR_NONFINITE = 8 /**< a loss or gradient norm became NaN or infinite */
} moe_status;

/** Maximum length of an error message, including the terminating zero. */
#define MOE_ERROR_MSG_LEN 1024

/** An error value: a status and a message for a human. */
typedef struct moe_error {
    moe_status code;               /**< what kind of failure */
    char msg[MOE_ERROR_MSG_LEN];   /**< what failed and how to fix it */
} moe_error;

/**
 * @brief Record an error and return its code (so `return moe_error_set(...)` reads well).
 * @param err   where to record it; may be NULL (the message is then dropped)
 * @param code  the status to record (not ::MOE_OK)
 * @param fmt   printf-style message: name the flag/file and the fix
 * @return @p code
 */
moe_status moe_error_set(moe_error *err, moe_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/** @brief Reset @p err to ::MOE_OK with an empty message. @param err may be NULL */
void moe_error_clear(moe_error *err);

/** @brief A short name for a status code ("configuration error", "I/O error", …).
 *  @param code the status
 *  @return a static string */
const char *moe_status_name(moe_status code);

/** Abort with file and line when an internal invariant is violated. Not for user errors. */
#define MOE_ASSERT(cond)                                                             \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "moe.c internal error at %s:%d: %s\n", __FILE__, __LINE__, \
                    #cond);                                                          \
            abort();                                                                 \
        }                                                                            \
    } while (0)

/** Abort with file and line when @p st, the status of a call whose arguments were checked
 *  beforehand (at start-up), is not ::MOE_OK, printing "@p who: " and the message in
 *  @p err first: such a failure is a bug or a broken device, never a user error. */
#define MOE_REQUIRE_OK(st, err, who)                                                     \
    do {                                                                                 \
        const moe_status moe_st_ = (st);                                                 \
        if (moe_st_ != MOE_OK)                                                           \
            fprintf(stderr, "%s: %s\n", (who), (err)->msg);                              \
        MOE_ASSERT(moe_st_ == MOE_OK);                                                   \
    } while (0)

/**
 * @brief End the process with a named out-of-memory message (never returns).
 *
 * For the few buffers allocated while a training step runs (scratch that grows with the
 * routing: the dispatchers' rows and maps, the CPU router's and matmul's scratch). Their
 * sizes are part of the memory estimate checked before the model is built (memory.h), so
 * this only happens when the machine's free memory shrinks during the run; no error value
 * can travel back through the op table from there, so the message names the buffer, the
 * size and the flags to reduce, and the process exits 1 (under mpirun, the job ends).
 * @param what the buffer  @param bytes the size that failed  @param file caller's file
 * @param line caller's line
 */
void moe_fatal_oom(const char *what, size_t bytes, const char *file, int line)
#if defined(__GNUC__)
    __attribute__((noreturn))
#endif
    ;

/** moe_fatal_oom() when @p p is NULL: `MOE_CHECK_ALLOC(buf, bytes, "the router's scratch");` */
#define MOE_CHECK_ALLOC(p, bytes, what)                            \
    do {                                                           \
        if (!(p))                                                  \
            moe_fatal_oom((what), (size_t)(bytes), __FILE__, __LINE__); \
    } while (0)

/** Propagate a failing status to the caller: `MOE_TRY(moe_foo(..., err));` */
#define MOE_TRY(expr)                     \
    do {                                  \
        moe_status moe_try_s_ = (expr);   \
        if (moe_try_s_ != MOE_OK)         \
            return moe_try_s_;            \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif /* MOE_ERROR_H */
