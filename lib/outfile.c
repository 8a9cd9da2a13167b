/* Output files that cannot destroy data: see outfile.h. */
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

moe_status moe_outfile_check(const char *path, const char *flag, const char *const *inputs,
                             int n_inputs, moe_outfile_mode mode, moe_error *err) {
    struct stat out;
    if (stat(path, &out) != 0)
        return MOE_OK; /* nothing there yet: neither an input nor an existing file */
    for (int i = 0; i < n_inputs; i++) {
        struct stat in;
        /* same device and inode: the same file, however the two paths are spelled */
        if (inputs[i] && stat(inputs[i], &in) == 0 && in.st_dev == out.st_dev &&
            in.st_ino == out.st_ino)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "--%s '%s' is an input of this run ('%s'): writing there would "
                                 "destroy it; choose another path",
                                 flag, path, inputs[i]);
    }
    if (mode == MOE_OUTFILE_NEW && S_ISREG(out.st_mode))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--%s '%s' already exists: choose another path, or pass --overwrite "
                             "to replace it",
                             flag, path);
    return MOE_OK;
}

moe_status moe_outfile_open(int *fd, const char *path, const char *flag, moe_outfile_mode mode,
                            moe_error *err) {
    int how = O_WRONLY | O_CREAT | O_CLOEXEC;
    struct stat st;
    const int special = stat(path, &st) == 0 && !S_ISREG(st.st_mode); /* /dev/null, a FIFO */
    if (mode == MOE_OUTFILE_APPEND)
        how |= O_APPEND;
    else if (mode == MOE_OUTFILE_OVERWRITE)
        how |= O_TRUNC;
    else if (!special)
        how |= O_EXCL; /* also refuses a file that appears between a check and this open */
    *fd = open(path, how, 0644);
    if (*fd >= 0)
        return MOE_OK;
    if (errno == EEXIST)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--%s '%s' already exists: choose another path, or pass --overwrite "
                             "to replace it",
                             flag, path);
    return moe_error_set(err, MOE_ERR_IO,
                         "cannot open '%s' for writing: %s (fix the path given to --%s, or "
                         "create its directory)",
                         path, strerror(errno), flag);
}

moe_status moe_outfile_write(int fd, const void *buf, size_t n, const char *path,
                             const char *flag, moe_error *err) {
    /* where the record begins (records are only ever added at the end), to cut a partial
     * record off again; -1 for what cannot seek (a pipe) */
    const off_t start = lseek(fd, 0, SEEK_END);
    const char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, p + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            const int e = w < 0 ? errno : ENOSPC; /* write(2) returning 0: nothing fits */
            if (done > 0 && start >= 0 && ftruncate(fd, start) == 0)
                (void)lseek(fd, start, SEEK_SET);
            return moe_error_set(err, MOE_ERR_IO,
                                 "writing '%s' (--%s) failed: %s; the run stops so that no "
                                 "result is lost silently (free space, or choose another path)",
                                 path, flag, strerror(e));
        }
        done += (size_t)w;
    }
    return MOE_OK;
}
