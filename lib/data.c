/* Finding, verifying, loading and batching the training text: see data.h.
 *
 * Finding the file is deliberately explicit: each place in the search order is
 * tried in turn and what happened there is written down, so that when nothing
 * is found the error can show the user every place looked at and why each one
 * failed, instead of a bare "file not found".
 */
#include "data.h"
#include "log.h"

#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rng.h"
#include "sha256.h"

/* posix_spawn passes the environment explicitly; POSIX defines this variable
 * but no header is required to declare it. */
extern char **environ;

/* The default places, relative to the working directory. */
#define DATA_DIR "data"
#define LOCAL_PATH DATA_DIR "/" MOE_DATA_DEFAULT_NAME
#define SHARED_PATH "../shared/data/" MOE_DATA_DEFAULT_NAME

/* Environment variable that turns the download off (the tests set it, as
 * does anyone on a machine that must not touch the network). */
#define NO_DOWNLOAD_ENV "MOE_NO_DOWNLOAD"

/* RNG stream of the batch offsets: split + this, so the data stream never
 * collides with the streams used to initialise parameters. */
#define BATCH_STREAM_BASE 0xDA7A0000ull

/* ------------------------------------------------------------------ finding */

/* Is @p path a readable regular file? Returns 1 if so; otherwise 0 with a
 * short reason ("not found", "is a directory", ...) in @p why. */
static int probe_file(const char *path, char *why, size_t why_cap) {
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(why, why_cap, "%s", errno == ENOENT ? "not found" : strerror(errno));
        return 0;
    }
    if (S_ISDIR(st.st_mode)) {
        snprintf(why, why_cap, "is a directory, not a file");
        return 0;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, why_cap, "is not a regular file");
        return 0;
    }
    if (access(path, R_OK) != 0) {
        snprintf(why, why_cap, "not readable: %s", strerror(errno));
        return 0;
    }
    return 1;
}

/* Copy the found path into the caller's buffer. */
static moe_status set_out(char *out, size_t cap, const char *path, moe_error *err) {
    size_t len = strlen(path);
    if (len + 1 > cap)
        return moe_error_set(err, MOE_ERR_IO,
                             "data path '%s' is %zu characters long, more than the %zu this "
                             "program can hold; move the file to a shorter path (--data-path)",
                             path, len, cap - 1);
    memcpy(out, path, len + 1);
    return MOE_OK;
}

/* 1 if the environment variable @p name is set to something other than "" or "0". */
static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

/* 1 if the program @p tool is on PATH. `command -v` is the POSIX way to ask
 * the shell; the name is one of our fixed strings, never user input. */
static int have_tool(const char *tool) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", tool);
    int rc = system(cmd);
    return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

/* Run argv[0] (searched on PATH) with arguments argv, without a shell (so no
 * path needs quoting), and wait for it. Returns its exit status, or -1 if it
 * could not be started or did not exit normally. */
static int run_program(char *const argv[]) {
    pid_t pid;
    if (posix_spawnp(&pid, argv[0], NULL, NULL, argv, environ) != 0)
        return -1;
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR)
            return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/*
 * Download the default file with @p tool ("curl" or "wget") into
 * data/tinyshakespeare.txt, which must not be used unless its sha256 matches.
 *
 * The file is downloaded to a temporary name first, checked, and only then
 * renamed to its final name. rename() within one directory is atomic, so the
 * final name never holds a partial or wrong file -- not if the program is
 * killed mid-download, and not when several ranks of a distributed job
 * download at once (each writes its own temporary, named by pid, and the last
 * rename wins with identical content). On any failure the temporary is
 * deleted.
 *
 * Returns MOE_OK; MOE_ERR_DATA (with @p err set) if the file did not match
 * the checksum; otherwise MOE_ERR_IO with the reason in @p why.
 */
static moe_status fetch_verified(const char *tool, char *why, size_t why_cap, moe_error *err) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", LOCAL_PATH, (long)getpid());
    char url[] = MOE_DATA_DEFAULT_URL; /* argv strings must be writable (char *const[]) */
    /* Both tools get a hard time limit, so a machine without a network fails
     * within a minute instead of hanging; wget's -t 1 stops its default of 20
     * retries, which would multiply that limit. */
    char *curl_argv[] = {"curl", "-fsSL", "--max-time", "60", "-o", tmp, url, NULL};
    char *wget_argv[] = {"wget", "-q", "-T", "60", "-t", "1", "-O", tmp, url, NULL};
    moe_log_info("%s not found locally; downloading %s with %s (at most 60 s)...",
            MOE_DATA_DEFAULT_NAME, MOE_DATA_DEFAULT_URL, tool);
    fflush(stderr);
    int rc = run_program(strcmp(tool, "curl") == 0 ? curl_argv : wget_argv);
    if (rc != 0) {
        unlink(tmp);
        if (rc < 0)
            snprintf(why, why_cap, "download with %s could not be started", tool);
        else
            snprintf(why, why_cap, "download with %s failed (exit status %d; no network?)", tool,
                     rc);
        return MOE_ERR_IO;
    }

    /* Never use a file we cannot vouch for: check it before giving it its name. */
    char hex[MOE_SHA256_HEX_LEN];
    moe_error sub;
    if (moe_sha256_file(tmp, hex, &sub) != MOE_OK) {
        unlink(tmp);
        snprintf(why, why_cap, "downloaded, but could not be re-read: %.200s", sub.msg);
        return MOE_ERR_IO;
    }
    if (strcmp(hex, MOE_DATA_DEFAULT_SHA256) != 0) {
        unlink(tmp);
        return moe_error_set(err, MOE_ERR_DATA,
                             "downloaded %s from %s, but its sha256 is %s, not the expected %s; "
                             "the file was deleted. Download it yourself from a source you trust "
                             "and pass it with --data-path (or set %s)",
                             MOE_DATA_DEFAULT_NAME, MOE_DATA_DEFAULT_URL, hex,
                             MOE_DATA_DEFAULT_SHA256, MOE_DATA_ENV);
    }
    if (rename(tmp, LOCAL_PATH) != 0) {
        snprintf(why, why_cap, "downloaded, but could not rename %s to %s: %s", tmp, LOCAL_PATH,
                 strerror(errno));
        unlink(tmp);
        return MOE_ERR_IO;
    }
    moe_log_info("saved %s (sha256 verified)", LOCAL_PATH);
    return MOE_OK;
}

/*
 * Step 5 of the search order: download the default file into data/, unless
 * MOE_NO_DOWNLOAD is set or neither curl nor wget is installed.
 *
 * Returns MOE_OK with the path in @p out; MOE_ERR_DATA (with @p err set) if
 * the download did not match the checksum; otherwise MOE_ERR_IO with the
 * reason in @p why, for the caller's list of places looked at.
 */
static moe_status try_download(char *out, size_t cap, char *why, size_t why_cap, moe_error *err) {
    if (env_flag(NO_DOWNLOAD_ENV)) {
        snprintf(why, why_cap, "skipped: %s is set", NO_DOWNLOAD_ENV);
        return MOE_ERR_IO;
    }
    const char *tool = have_tool("curl") ? "curl" : have_tool("wget") ? "wget" : NULL;
    if (!tool) {
        snprintf(why, why_cap, "skipped: neither curl nor wget is installed");
        return MOE_ERR_IO;
    }
    int made_dir = mkdir(DATA_DIR, 0777) == 0;
    if (!made_dir && errno != EEXIST) {
        snprintf(why, why_cap, "could not create %s/: %s", DATA_DIR, strerror(errno));
        return MOE_ERR_IO;
    }
    moe_status s = fetch_verified(tool, why, why_cap, err);
    if (s != MOE_OK) {
        if (made_dir)
            rmdir(DATA_DIR); /* a failed attempt leaves no trace behind */
        return s;
    }
    return set_out(out, cap, LOCAL_PATH, err);
}

moe_status moe_data_find(char *out, size_t cap, const char *flag_path, moe_error *err) {
    MOE_ASSERT(out != NULL && cap > 0);
    out[0] = '\0';
    char why[128]; /* probe_file's reasons are short: "not found", a strerror */

    /* 1. --data-path: the user named a file, so a missing one is an error,
     *    never a reason to quietly train on something else. */
    if (flag_path && *flag_path) {
        if (probe_file(flag_path, why, sizeof why))
            return set_out(out, cap, flag_path, err);
        return moe_error_set(err, MOE_ERR_IO,
                             "--data-path %s: %s. Pass an existing text file to --data-path, "
                             "or leave the flag out to search %s, %s and %s",
                             flag_path, why, MOE_DATA_ENV, LOCAL_PATH, SHARED_PATH);
    }

    /* 2. $MOE_DATA_PATH. A set-but-wrong variable is only a warning (the
     *    search goes on), but it is listed in the error if nothing is found. */
    char env_why[512];
    const char *env = getenv(MOE_DATA_ENV);
    if (env && *env) {
        if (probe_file(env, why, sizeof why))
            return set_out(out, cap, env, err);
        moe_log_warn("%s=%s: %s; looking elsewhere", MOE_DATA_ENV, env, why);
        snprintf(env_why, sizeof env_why, "%.300s: %s", env, why);
    } else {
        snprintf(env_why, sizeof env_why, "not set");
    }

    /* 3.-4. The default places, relative to the working directory. */
    char local_why[128], shared_why[128];
    if (probe_file(LOCAL_PATH, local_why, sizeof local_why))
        return set_out(out, cap, LOCAL_PATH, err);
    if (probe_file(SHARED_PATH, shared_why, sizeof shared_why))
        return set_out(out, cap, SHARED_PATH, err);

    /* 5. Download, as the last resort. */
    char dl_why[512];
    moe_status s = try_download(out, cap, dl_why, sizeof dl_why, err);
    if (s != MOE_ERR_IO)
        return s; /* found, or a checksum mismatch (already described in err) */

    /* 6. Nothing: say where we looked and how to fix it. */
    char cwd[512];
    if (!getcwd(cwd, sizeof cwd))
        snprintf(cwd, sizeof cwd, "(unknown)");
    return moe_error_set(err, MOE_ERR_IO,
                         "could not find the training text %s. Looked at:\n"
                         "  1. --data-path: not given\n"
                         "  2. $%s: %s\n"
                         "  3. %s: %s\n"
                         "  4. %s: %s\n"
                         "  5. download from %s: %s\n"
                         "(paths 3-4 are relative to the working directory %.200s)\n"
                         "Fix: pass --data-path FILE, or set %s=FILE, or copy the file to %s",
                         MOE_DATA_DEFAULT_NAME, MOE_DATA_ENV, env_why, LOCAL_PATH, local_why,
                         SHARED_PATH, shared_why, MOE_DATA_DEFAULT_URL, dl_why, cwd, MOE_DATA_ENV,
                         LOCAL_PATH);
}

/* ------------------------------------------------------------------ loading */

/* Read a whole file into a fresh buffer (*buf, freed by the caller). */
static moe_status read_file(const char *path, unsigned char **buf, size_t *n, moe_error *err) {
    *buf = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "cannot open data file %s: %s", path,
                             strerror(errno));
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return moe_error_set(err, MOE_ERR_IO, "cannot determine the size of data file %s: %s",
                             path, strerror(errno));
    }
    /* +1 so that an empty file still gets a non-NULL buffer. */
    unsigned char *data = malloc((size_t)size + 1);
    if (!data) {
        fclose(f);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory reading %ld bytes of %s", size,
                             path);
    }
    size_t got = fread(data, 1, (size_t)size, f);
    int failed = ferror(f);
    fclose(f);
    if (failed || got != (size_t)size) {
        free(data);
        return moe_error_set(err, MOE_ERR_IO, "read only %zu of %ld bytes of data file %s", got,
                             size, path);
    }
    *buf = data;
    *n = (size_t)size;
    return MOE_OK;
}

moe_status moe_dataset_load(moe_dataset *ds, const char *flag_path, moe_tokenizer_type type,
                            moe_error *err) {
    MOE_ASSERT(ds != NULL);
    memset(ds, 0, sizeof *ds);
    MOE_TRY(moe_data_find(ds->path, sizeof ds->path, flag_path, err));

    unsigned char *text;
    size_t n;
    MOE_TRY(read_file(ds->path, &text, &n, err));
    if (n == 0) {
        free(text);
        return moe_error_set(err, MOE_ERR_DATA,
                             "data file %s is empty; pass a non-empty text file with --data-path",
                             ds->path);
    }

    /* The vocabulary comes from the whole text (train and val), as nanoGPT's
     * prepare.py does, so every byte of the file can be encoded. */
    moe_status s = moe_tokenizer_build(&ds->tok, type, text, n, err);
    if (s == MOE_OK) {
        ds->tokens = malloc(n * sizeof *ds->tokens);
        if (!ds->tokens)
            s = moe_error_set(err, MOE_ERR_NOMEM, "out of memory for %zu tokens of %s", n,
                              ds->path);
    }
    if (s == MOE_OK)
        s = moe_tokenizer_encode(&ds->tok, text, n, ds->tokens, err);
    free(text);
    if (s != MOE_OK) {
        moe_dataset_free(ds);
        return s;
    }
    ds->n_tokens = n;

    /* The first 90% of the tokens train, the rest validate. int(n * 0.9) is
     * the very expression nanoGPT uses, so the splits match it token for
     * token (1,115,394 tokens of tinyshakespeare -> 1,003,854 train). */
    ds->n_train = (size_t)((double)n * 0.9);
    if (ds->n_train == 0 || ds->n_train == n) {
        s = moe_error_set(err, MOE_ERR_DATA,
                          "data file %s has only %zu tokens: too small to split 90/10 into "
                          "non-empty train and validation parts; use a larger file (--data-path)",
                          ds->path, n);
        moe_dataset_free(ds);
        return s;
    }
    return MOE_OK;
}

moe_status moe_dataset_check_seq_len(const moe_dataset *ds, int seq_len, moe_error *err) {
    MOE_ASSERT(ds != NULL && ds->n_train <= ds->n_tokens);
    /* A sequence of seq_len inputs needs seq_len + 1 tokens (the targets are
     * shifted by one), in the smaller of the two splits. */
    size_t n_val = ds->n_tokens - ds->n_train;
    size_t smallest = ds->n_train < n_val ? ds->n_train : n_val;
    const char *which = ds->n_train < n_val ? "train" : "validation";
    size_t max_len = smallest > 0 ? smallest - 1 : 0;
    if (max_len > (size_t)INT32_MAX)
        max_len = (size_t)INT32_MAX;
    if (max_len < 1)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "the %s split of %s has only %zu tokens, too few for any "
                             "--seq-length (at least 2 are needed); use a larger data file",
                             which, ds->path, smallest);
    if (seq_len < 1 || (size_t)seq_len > max_len)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--seq-length %d is out of range: it must be between 1 and %zu, "
                             "because the %s split of %s has %zu tokens and a sequence needs "
                             "--seq-length + 1 of them",
                             seq_len, max_len, which, ds->path, smallest);
    return MOE_OK;
}

void moe_dataset_free(moe_dataset *ds) {
    if (!ds)
        return;
    free(ds->tokens);
    memset(ds, 0, sizeof *ds);
}

/* ------------------------------------------------------------------ batches */

void moe_dataset_batch(const moe_dataset *ds, moe_split split, int batch, int seq_len,
                       uint64_t seed, uint64_t batch_index, int *inputs, int *targets) {
    MOE_ASSERT(ds != NULL && ds->tokens != NULL && inputs != NULL && targets != NULL);
    MOE_ASSERT(split == MOE_SPLIT_TRAIN || split == MOE_SPLIT_VAL);
    MOE_ASSERT(batch >= 1 && seq_len >= 1);

    /* The split's tokens are [base, base + n_split) of the whole text. */
    size_t base = split == MOE_SPLIT_TRAIN ? 0 : ds->n_train;
    size_t n_split = split == MOE_SPLIT_TRAIN ? ds->n_train : ds->n_tokens - ds->n_train;
    /* Callers check this once with moe_dataset_check_seq_len (a user error);
     * reaching here without it is a bug. */
    MOE_ASSERT((size_t)seq_len + 1 <= n_split);

    /* A sequence may start at any of range = n_split - seq_len offsets:
     * 0 .. n_split - seq_len - 1 keeps its last target, at offset + seq_len,
     * inside the split -- so validation batches never see training tokens. */
    size_t range = n_split - (size_t)seq_len;
    uint64_t stream = (uint64_t)split + BATCH_STREAM_BASE;
    for (int b = 0; b < batch; b++) {
        double u = moe_rng_uniform(seed, stream, batch_index * (uint64_t)batch + (uint64_t)b);
        size_t off = (size_t)floor(u * (double)range);
        if (off >= range) /* u < 1, so this cannot happen; but never read out of bounds */
            off = range - 1;
        const int *src = ds->tokens + base + off;
        int *in = inputs + (size_t)b * (size_t)seq_len;
        int *tg = targets + (size_t)b * (size_t)seq_len;
        memcpy(in, src, (size_t)seq_len * sizeof *in);
        memcpy(tg, src + 1, (size_t)seq_len * sizeof *tg); /* the next token of each input */
    }
}

/* ------------------------------------------------------------------ checksums */

moe_status moe_sha256_file(const char *path, char hex[65], moe_error *err) {
    MOE_ASSERT(path != NULL && hex != NULL);
    hex[0] = '\0';
    FILE *f = fopen(path, "rb");
    if (!f)
        return moe_error_set(err, MOE_ERR_IO, "cannot open %s to compute its sha256: %s", path,
                             strerror(errno));
    /* Stream the file through the hash in chunks: any size, constant memory. */
    moe_sha256_ctx ctx;
    moe_sha256_init(&ctx);
    unsigned char chunk[1 << 14];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0)
        moe_sha256_update(&ctx, chunk, got);
    int failed = ferror(f);
    fclose(f);
    uint8_t digest[MOE_SHA256_DIGEST_LEN];
    moe_sha256_final(&ctx, digest);
    if (failed)
        return moe_error_set(err, MOE_ERR_IO, "error reading %s to compute its sha256", path);
    moe_sha256_hex(digest, hex);
    return MOE_OK;
}
