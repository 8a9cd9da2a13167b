/* Atomic file writes (temporary file, fsync, rename, fsync the directory): see atomic_file.h. */
#include "atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

moe_status moe_atomic_open(moe_atomic_file *af, const char *path, moe_error *err) {
    memset(af, 0, sizeof *af);
    if (strlen(path) >= sizeof af->path)
        return moe_error_set(err, MOE_ERR_IO, "path '%s' is too long (at most %zu characters)",
                             path, sizeof af->path - 1);
    snprintf(af->path, sizeof af->path, "%s", path);
    /* the pid keeps two writers of the same name (two jobs saving into one directory)
     * from writing into one temporary file */
    snprintf(af->tmp, sizeof af->tmp, "%s.tmp.%ld", path, (long)getpid());
    af->f = fopen(af->tmp, "wb");
    if (!af->f)
        return moe_error_set(err, MOE_ERR_IO, "cannot create '%s': %s (check that the directory "
                             "exists and is writable)", af->tmp, strerror(errno));
    return MOE_OK;
}

void moe_atomic_discard(moe_atomic_file *af) {
    if (af->f)
        fclose(af->f);
    af->f = NULL;
    if (af->tmp[0])
        unlink(af->tmp);
}

/* The directory part of a path ("." when there is none). */
static void dir_of(const char *path, char *out, size_t cap) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(out, cap, ".");
    else if (slash == path)
        snprintf(out, cap, "/");
    else
        snprintf(out, cap, "%.*s", (int)(slash - path), path);
}

moe_status moe_fsync_dir(const char *dir, moe_error *err) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return moe_error_set(err, MOE_ERR_IO, "cannot open directory '%s': %s", dir,
                             strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* some file systems cannot fsync a directory (EINVAL); the rename is then as durable
     * as they make it, which is all we can ask */
    if (rc != 0 && e != EINVAL)
        return moe_error_set(err, MOE_ERR_IO, "cannot sync directory '%s': %s", dir, strerror(e));
    return MOE_OK;
}

moe_status moe_atomic_commit(moe_atomic_file *af, moe_error *err) {
    /* ferror catches a write that failed earlier (fwrite's result may have been ignored) */
    int failed = ferror(af->f) || fflush(af->f) != 0 || fsync(fileno(af->f)) != 0;
    int e = errno;
    failed |= fclose(af->f) != 0;
    af->f = NULL;
    if (failed) {
        moe_atomic_discard(af);
        return moe_error_set(err, MOE_ERR_IO, "writing '%s' failed: %s (is the disk full?); "
                             "the previous file is kept", af->path, strerror(e ? e : EIO));
    }
    if (rename(af->tmp, af->path) != 0) {
        e = errno;
        moe_atomic_discard(af);
        return moe_error_set(err, MOE_ERR_IO, "cannot rename '%s' to '%s': %s", af->tmp,
                             af->path, strerror(e));
    }
    char dir[1024];
    dir_of(af->path, dir, sizeof dir);
    return moe_fsync_dir(dir, err);
}
