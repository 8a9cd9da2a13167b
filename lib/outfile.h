/**
 * @file outfile.h
 * @brief Output files that cannot destroy data: never an input, never an existing file
 *        unless asked, and every write checked.
 *
 * Three rules for every file a run writes (the metrics file, checkpoints):
 *
 * 1. **Not an input.** A path that names the same file as one of the run's inputs (the same
 *    device and inode, so another spelling, `./x`, a hard link or a symbolic link is caught
 *    too) is refused before anything is opened: `--metrics-file data/tinyshakespeare.txt`
 *    must not truncate the training data.
 * 2. **No silent overwrite.** ::MOE_OUTFILE_NEW refuses a path that exists as a regular file
 *    (atomically: O_EXCL); ::MOE_OUTFILE_OVERWRITE replaces it (a flag such as `--overwrite`
 *    says so); ::MOE_OUTFILE_APPEND adds to its end (a resumed run). Devices such as
 *    /dev/null are not "existing files" and may always be written.
 * 3. **Every write is checked.** moe_outfile_write() writes a whole record with write(2),
 *    retrying short writes and EINTR, and reports ENOSPC, EIO, EPIPE... as an error naming
 *    the file and the flag. A record that could not be written whole is cut off again
 *    (ftruncate to where it began), so a regular file only ever holds whole records.
 */
#ifndef MOE_OUTFILE_H
#define MOE_OUTFILE_H

#include <stddef.h>

#include "error.h"

/** What to do when the output path already exists. */
typedef enum moe_outfile_mode {
    MOE_OUTFILE_NEW = 0,       /**< refuse an existing regular file */
    MOE_OUTFILE_OVERWRITE = 1, /**< truncate it */
    MOE_OUTFILE_APPEND = 2     /**< write after its end (resuming a run) */
} moe_outfile_mode;

/**
 * @brief Check @p path against rules 1 and 2 without opening it.
 * @param path the output path  @param flag the flag that named it ("metrics-file"), for the
 *        message  @param inputs paths the run reads (NULL entries and paths that do not
 *        exist are skipped)  @param n_inputs their count  @param mode ::moe_outfile_mode
 * @param err receives the reason on failure
 * @return ::MOE_OK; ::MOE_ERR_CONFIG when @p path is one of @p inputs, or exists and
 *         @p mode is ::MOE_OUTFILE_NEW
 */
moe_status moe_outfile_check(const char *path, const char *flag, const char *const *inputs,
                             int n_inputs, moe_outfile_mode mode, moe_error *err);

/**
 * @brief Open @p path for writing under @p mode (rule 2 enforced atomically for
 *        ::MOE_OUTFILE_NEW).
 * @param fd receives the file descriptor  @param path the output path
 * @param flag the flag that named it, for the message  @param mode ::moe_outfile_mode
 * @param err receives the reason on failure
 * @return ::MOE_OK; ::MOE_ERR_CONFIG when it exists and @p mode is ::MOE_OUTFILE_NEW;
 *         ::MOE_ERR_IO when it cannot be opened
 */
moe_status moe_outfile_open(int *fd, const char *path, const char *flag, moe_outfile_mode mode,
                            moe_error *err);

/**
 * @brief Write @p n bytes as one record (rule 3).
 * @param fd descriptor from moe_outfile_open()  @param buf bytes  @param n count
 * @param path the file, for the message  @param flag its flag, for the message
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_IO with strerror (ENOSPC: "No space left on device")
 */
moe_status moe_outfile_write(int fd, const void *buf, size_t n, const char *path,
                             const char *flag, moe_error *err);

#endif /* MOE_OUTFILE_H */
