/**
 * @file atomic_file.h
 * @brief Write a file so that a crash leaves either the old file or the complete new one.
 *
 * The classic recipe: write the new content to a temporary file in the *same directory*,
 * fsync it (the bytes are on disk), rename it over the final name (rename within one file
 * system is atomic: a reader sees the old name or the new file, never half of it), then
 * fsync the directory (the rename itself is on disk). A process killed at any point leaves
 * at most a stray `*.tmp.<pid>` file, never a truncated final file.
 *
 * Checkpoint shards and the `latest` pointer are written this way (checkpoint.h). Every
 * output file of a checkpoint is opened by moe_atomic_open(), the one place that decides
 * where an output file may go.
 */
#ifndef MOE_ATOMIC_FILE_H
#define MOE_ATOMIC_FILE_H

#include <stdio.h>

#include "error.h"

/** A file being written: the stream to write to and the names it moves between. */
typedef struct moe_atomic_file {
    FILE *f;           /**< write here (the temporary file) */
    char path[1024];   /**< the final name */
    char tmp[1100];    /**< the temporary name: path + ".tmp." + pid */
} moe_atomic_file;

/**
 * @brief Open a temporary file next to @p path for writing.
 * @param af   receives the open file
 * @param path the final name (its directory must exist)
 * @param err  receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_IO naming the path and the system's reason
 */
moe_status moe_atomic_open(moe_atomic_file *af, const char *path, moe_error *err);

/**
 * @brief Finish: flush, fsync, close, rename over the final name, fsync the directory.
 *        On failure (a write error such as ENOSPC or EIO seen now or earlier) the
 *        temporary file is removed and the final name keeps its old content.
 * @param af  the open file (closed afterwards in every case)
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_IO
 */
moe_status moe_atomic_commit(moe_atomic_file *af, moe_error *err);

/** @brief Give up: close and remove the temporary file; the final name is untouched.
 *  @param af the open file (may already be closed) */
void moe_atomic_discard(moe_atomic_file *af);

/**
 * @brief fsync the directory @p dir, so that names created or renamed in it survive a
 *        power loss.
 * @param dir directory  @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_IO
 */
moe_status moe_fsync_dir(const char *dir, moe_error *err);

#endif /* MOE_ATOMIC_FILE_H */
