/**
 * @file metrics.h
 * @brief A JSON-lines metrics writer: one JSON object per line, one line per event.
 *
 * JSON lines are trivial to append to, survive a crash (every complete line is
 * valid), and load with one line of pandas: `pd.read_json(path, lines=True)`.
 *
 * Lines are whole, even after a kill: a record is built in memory and handed to the
 * kernel by moe_metrics_end() as one write(2) (outfile.h). A process killed before that
 * call has written nothing of the record, and one killed after it has written all of it
 * (the kernel finishes a write to a regular file that it has begun). A write that fails
 * half-way (the disk is full) is cut off again and reported, so the file never ends in
 * half a line, and the run stops instead of losing its results silently.
 *
 * Usage:
 * @code
 *   moe_metrics_begin(m, "train");           // {"event":"train"
 *   moe_metrics_int(m, "step", 10);          // ,"step":10
 *   moe_metrics_num(m, "loss", 2.31);        // ,"loss":2.31
 *   moe_metrics_end(m);                      // }\n  (flushed)
 * @endcode
 */
#ifndef MOE_METRICS_H
#define MOE_METRICS_H

#include <stdio.h>

#include "error.h"
#include "outfile.h"

/** An open metrics file (opaque). */
typedef struct moe_metrics moe_metrics;

/**
 * @brief Open @p path for writing.
 * @param out   receives the writer
 * @param path  file to write; its directory must exist
 * @param mode  ::MOE_OUTFILE_NEW (refuse an existing file), ::MOE_OUTFILE_OVERWRITE or
 *              ::MOE_OUTFILE_APPEND (a resumed run)
 * @param err   receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_CONFIG when the file exists and @p mode is new, or
 *         ::MOE_ERR_IO naming the path
 */
moe_status moe_metrics_open(moe_metrics **out, const char *path, moe_outfile_mode mode,
                            moe_error *err);

/** @brief Write @p s to @p f as a JSON string literal (quotes and escapes).
 *  @param f stream  @param s text */
void moe_json_write_string(FILE *f, const char *s);

/** @brief Start a record with field "event": @p event. @param m writer (NULL: no-op) @param event record kind */
void moe_metrics_begin(moe_metrics *m, const char *event);
/** @brief Add a numeric field, with the digits that read back as the same double (non-finite values are written as null). @param m writer @param key name @param value number */
void moe_metrics_num(moe_metrics *m, const char *key, double value);
/** @brief Add an integer field. @param m writer @param key name @param value integer */
void moe_metrics_int(moe_metrics *m, const char *key, long long value);
/** @brief Add a string field (escaped). @param m writer @param key name @param value text */
void moe_metrics_str(moe_metrics *m, const char *key, const char *value);
/** @brief Add an array of integers. @param m writer @param key name @param v values @param n count */
void moe_metrics_int_array(moe_metrics *m, const char *key, const long long *v, int n);
/**
 * @brief Finish the record and write it, newline included, with one write(2).
 * @param m writer (NULL: no-op)  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_IO (the disk is full, an I/O error: nothing of the record
 *         stays in the file) or ::MOE_ERR_NOMEM
 */
moe_status moe_metrics_end(moe_metrics *m, moe_error *err);
/** @brief Close the file and free the writer. @param m writer (NULL: no-op) */
void moe_metrics_close(moe_metrics *m);

#endif /* MOE_METRICS_H */
