/* Tests of the tokenizers, SHA-256, the data-file search order, loading and batching.
 *
 * None of these tests touches the network: every test that could reach the
 * download step sets MOE_NO_DOWNLOAD=1 first. Tests that change the working
 * directory or the environment restore both in a checked fixture, because
 * under CK_FORK=no (the sanitizer run) all tests share one process.
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data.h"
#include "helpers.h"
#include "rng.h"
#include "sha256.h"
#include "tokenizer.h"

/* Facts about the default dataset (nanoGPT's shakespeare_char prints the same). */
#define SHAKESPEARE_BYTES 1115394
#define SHAKESPEARE_TRAIN 1003854
#define SHAKESPEARE_VOCAB 65

/* ---------------------------------------------------------------- fixture */

/* What the fixture saves and restores around every test. */
static char g_saved_cwd[4096];
static char *g_saved_data_env;   /* strdup of $MOE_DATA_PATH, or NULL if unset */
static char *g_saved_nodl_env;   /* strdup of $MOE_NO_DOWNLOAD, or NULL if unset */
static char *g_saved_path_env;   /* strdup of $PATH (the download test changes it) */

static char *dup_env(const char *name) {
    const char *v = getenv(name);
    return v ? strdup(v) : NULL;
}

static void restore_env(const char *name, const char *value) {
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

static void setup(void) {
    ck_assert_ptr_nonnull(getcwd(g_saved_cwd, sizeof g_saved_cwd));
    g_saved_data_env = dup_env(MOE_DATA_ENV);
    g_saved_nodl_env = dup_env("MOE_NO_DOWNLOAD");
    g_saved_path_env = dup_env("PATH");
    /* Every test starts hermetic: no download, no inherited data path. */
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    unsetenv(MOE_DATA_ENV);
}

static void teardown(void) {
    if (chdir(g_saved_cwd) != 0)
        perror("teardown: chdir");
    restore_env(MOE_DATA_ENV, g_saved_data_env);
    restore_env("MOE_NO_DOWNLOAD", g_saved_nodl_env);
    restore_env("PATH", g_saved_path_env);
    unsetenv("FAKE_CURL_SRC");
    free(g_saved_data_env);
    free(g_saved_nodl_env);
    free(g_saved_path_env);
    g_saved_data_env = g_saved_nodl_env = g_saved_path_env = NULL;
}

/* ---------------------------------------------------------------- helpers */

/* Write @p n bytes to @p path (creating or truncating it). */
static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "cannot create %s: %s", path, strerror(errno));
    ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

/* Read the default dataset (found by the normal search order from the repo
 * root) into a fresh buffer. */
static unsigned char *read_shakespeare(size_t *n) {
    char path[4096];
    moe_error err;
    moe_status s = moe_data_find(path, sizeof path, NULL, &err);
    ck_assert_msg(s == MOE_OK, "the tests need %s: %s", MOE_DATA_DEFAULT_NAME, err.msg);
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    unsigned char *buf = malloc(2 * SHAKESPEARE_BYTES);
    ck_assert_ptr_nonnull(buf);
    *n = fread(buf, 1, 2 * SHAKESPEARE_BYTES, f);
    fclose(f);
    return buf;
}

/* A scratch directory tree for the search-order tests:
 *   <root>/work/                        the working directory of the test
 *   <root>/work/data/tinyshakespeare.txt   (created on request)
 *   <root>/shared/data/tinyshakespeare.txt (created on request; ../shared from work/)
 * Paths are built from moe_test_tmp_path, so they are unique to this process. */
typedef struct scratch {
    char root[1024], work[1200], local[1400], shared_dir[1200], shared[1400];
} scratch;

static void scratch_make(scratch *sc, const char *name, int with_local, int with_shared) {
    moe_test_tmp_path(sc->root, sizeof sc->root, name);
    snprintf(sc->work, sizeof sc->work, "%s/work", sc->root);
    snprintf(sc->local, sizeof sc->local, "%s/work/data/" MOE_DATA_DEFAULT_NAME, sc->root);
    snprintf(sc->shared_dir, sizeof sc->shared_dir, "%s/shared", sc->root);
    snprintf(sc->shared, sizeof sc->shared, "%s/shared/data/" MOE_DATA_DEFAULT_NAME, sc->root);
    char dir[1400];
    ck_assert_int_eq(mkdir(sc->root, 0700), 0);
    ck_assert_int_eq(mkdir(sc->work, 0700), 0);
    snprintf(dir, sizeof dir, "%s/work/data", sc->root);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    ck_assert_int_eq(mkdir(sc->shared_dir, 0700), 0);
    snprintf(dir, sizeof dir, "%s/shared/data", sc->root);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    if (with_local)
        write_file(sc->local, "local\n", 6);
    if (with_shared)
        write_file(sc->shared, "shared\n", 7);
}

/* Remove what scratch_make created (and nothing else). */
static void scratch_remove(scratch *sc) {
    char dir[1400];
    unlink(sc->local);
    unlink(sc->shared);
    snprintf(dir, sizeof dir, "%s/work/data", sc->root);
    rmdir(dir);
    snprintf(dir, sizeof dir, "%s/shared/data", sc->root);
    rmdir(dir);
    rmdir(sc->work);
    rmdir(sc->shared_dir);
    rmdir(sc->root);
}

/* A synthetic dataset whose token i is i, so a batch shows exactly where in
 * the text each sequence was taken from. */
static void synthetic_dataset(moe_dataset *ds, size_t n_tokens, size_t n_train) {
    memset(ds, 0, sizeof *ds);
    snprintf(ds->path, sizeof ds->path, "synthetic");
    ds->tokens = malloc(n_tokens * sizeof *ds->tokens);
    ck_assert_ptr_nonnull(ds->tokens);
    for (size_t i = 0; i < n_tokens; i++)
        ds->tokens[i] = (int)i;
    ds->n_tokens = n_tokens;
    ds->n_train = n_train;
}

/* ---------------------------------------------------------------- tokenizers */

START_TEST(test_tokenizer_char_shakespeare) {
    size_t n;
    unsigned char *text = read_shakespeare(&n);
    ck_assert_uint_eq(n, SHAKESPEARE_BYTES);
    moe_tokenizer tok;
    moe_error err;
    ck_assert_int_eq(moe_tokenizer_build(&tok, MOE_TOKENIZER_CHAR, text, n, &err), MOE_OK);
    ck_assert_int_eq(tok.vocab_size, SHAKESPEARE_VOCAB);
    /* Sorted, as nanoGPT's sorted(set(text)): '\n' first, 'z' last. */
    ck_assert_int_eq(tok.id_to_byte[0], '\n');
    ck_assert_int_eq(tok.id_to_byte[1], ' ');
    ck_assert_int_eq(tok.id_to_byte[SHAKESPEARE_VOCAB - 1], 'z');
    for (int i = 1; i < tok.vocab_size; i++)
        ck_assert_int_lt(tok.id_to_byte[i - 1], tok.id_to_byte[i]);
    for (int i = 0; i < tok.vocab_size; i++)
        ck_assert_int_eq(tok.byte_to_id[tok.id_to_byte[i]], i);

    int *ids = malloc(n * sizeof *ids);
    unsigned char *back = malloc(n);
    ck_assert_ptr_nonnull(ids);
    ck_assert_ptr_nonnull(back);
    ck_assert_int_eq(moe_tokenizer_encode(&tok, text, n, ids, &err), MOE_OK);
    for (size_t i = 0; i < n; i++)
        ck_assert(ids[i] >= 0 && ids[i] < SHAKESPEARE_VOCAB);
    moe_tokenizer_decode(&tok, ids, n, back);
    ck_assert_int_eq(memcmp(text, back, n), 0);
    free(back);
    free(ids);
    free(text);
}
END_TEST

START_TEST(test_tokenizer_byte_roundtrip) {
    /* Every byte value, including 0 and 0xff, several times and out of order. */
    enum { N = 1024 };
    unsigned char text[N], back[N];
    int ids[N];
    for (int i = 0; i < N; i++)
        text[i] = (unsigned char)((i * 167 + 13) & 0xff);
    moe_tokenizer tok;
    moe_error err;
    ck_assert_int_eq(moe_tokenizer_build(&tok, MOE_TOKENIZER_BYTE, text, N, &err), MOE_OK);
    ck_assert_int_eq(tok.vocab_size, 256);
    ck_assert_int_eq(moe_tokenizer_encode(&tok, text, N, ids, &err), MOE_OK);
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(ids[i], text[i]); /* the identity map */
    memset(back, 0, sizeof back);
    moe_tokenizer_decode(&tok, ids, N, back);
    ck_assert_int_eq(memcmp(text, back, N), 0);
    /* The byte tokenizer needs no text at all. */
    ck_assert_int_eq(moe_tokenizer_build(&tok, MOE_TOKENIZER_BYTE, NULL, 0, &err), MOE_OK);
    ck_assert_int_eq(tok.vocab_size, 256);
}
END_TEST

START_TEST(test_tokenizer_char_small) {
    const unsigned char *text = (const unsigned char *)"hello";
    moe_tokenizer tok;
    moe_error err;
    ck_assert_int_eq(moe_tokenizer_build(&tok, MOE_TOKENIZER_CHAR, text, 5, &err), MOE_OK);
    ck_assert_int_eq(tok.vocab_size, 4); /* e h l o */
    ck_assert_int_eq(tok.byte_to_id['e'], 0);
    ck_assert_int_eq(tok.byte_to_id['h'], 1);
    ck_assert_int_eq(tok.byte_to_id['l'], 2);
    ck_assert_int_eq(tok.byte_to_id['o'], 3);
    ck_assert_int_eq(tok.byte_to_id['x'], -1);

    /* A byte outside the vocabulary is a data error that names it. */
    int ids[4];
    moe_error_clear(&err);
    ck_assert_int_eq(moe_tokenizer_encode(&tok, (const unsigned char *)"help", 4, ids, &err),
                     MOE_ERR_DATA);
    ck_assert_int_eq(err.code, MOE_ERR_DATA);
    ck_assert_ptr_nonnull(strstr(err.msg, "'p'"));
    ck_assert_ptr_nonnull(strstr(err.msg, "offset 3"));
    ck_assert_ptr_nonnull(strstr(err.msg, "--tokenizer-type byte"));

    /* Out-of-range ids decode as '?', not as a crash. */
    int bad[3] = {-1, 1, 4};
    unsigned char out[3];
    moe_tokenizer_decode(&tok, bad, 3, out);
    ck_assert_int_eq(out[0], '?');
    ck_assert_int_eq(out[1], 'h');
    ck_assert_int_eq(out[2], '?');

    /* An empty text has no characters to build a vocabulary from. */
    ck_assert_int_eq(moe_tokenizer_build(&tok, MOE_TOKENIZER_CHAR, text, 0, &err), MOE_ERR_DATA);
}
END_TEST

START_TEST(test_tokenizer_parse_type) {
    moe_tokenizer_type t = MOE_TOKENIZER_BYTE;
    moe_error err;
    ck_assert_int_eq(moe_tokenizer_parse_type("char", &t, &err), MOE_OK);
    ck_assert_int_eq(t, MOE_TOKENIZER_CHAR);
    ck_assert_int_eq(moe_tokenizer_parse_type("byte", &t, &err), MOE_OK);
    ck_assert_int_eq(t, MOE_TOKENIZER_BYTE);

    const char *bad[] = {"bpe", "", "Char", "chars"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moe_error_clear(&err);
        ck_assert_int_eq(moe_tokenizer_parse_type(bad[i], &t, &err), MOE_ERR_FLAG);
        ck_assert_int_eq(err.code, MOE_ERR_FLAG);
        ck_assert_ptr_nonnull(strstr(err.msg, "--tokenizer-type"));
        ck_assert_ptr_nonnull(strstr(err.msg, "char"));
        ck_assert_ptr_nonnull(strstr(err.msg, "byte"));
    }
    ck_assert_int_eq(moe_tokenizer_parse_type(NULL, &t, &err), MOE_ERR_FLAG);
}
END_TEST

/* ---------------------------------------------------------------- sha256 */

static void sha_hex(const void *data, size_t n, char hex[MOE_SHA256_HEX_LEN]) {
    uint8_t d[MOE_SHA256_DIGEST_LEN];
    moe_sha256_bytes(data, n, d);
    moe_sha256_hex(d, hex);
}

START_TEST(test_sha256_fips_vectors) {
    /* FIPS 180-4 examples (NIST "SHA256.pdf", "SHA2_Additional.pdf"). */
    char hex[MOE_SHA256_HEX_LEN];
    sha_hex("", 0, hex);
    ck_assert_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    sha_hex("abc", 3, hex);
    ck_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const char *two_block = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    sha_hex(two_block, strlen(two_block), hex);
    ck_assert_str_eq(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");

    /* One million 'a', streamed in uneven pieces so that updates straddle the
     * 64-byte block boundaries in every possible way. */
    enum { MILLION = 1000000 };
    char *a = malloc(MILLION);
    ck_assert_ptr_nonnull(a);
    memset(a, 'a', MILLION);
    moe_sha256_ctx ctx;
    moe_sha256_init(&ctx);
    size_t done = 0, piece = 1;
    while (done < MILLION) {
        size_t take = piece < MILLION - done ? piece : MILLION - done;
        moe_sha256_update(&ctx, a + done, take);
        done += take;
        piece = piece % 97 + 1;
    }
    uint8_t d[MOE_SHA256_DIGEST_LEN];
    moe_sha256_final(&ctx, d);
    moe_sha256_hex(d, hex);
    ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    /* ... and in one piece. */
    sha_hex(a, MILLION, hex);
    ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(a);
}
END_TEST

START_TEST(test_sha256_padding_boundaries) {
    /* Lengths around the padding edge cases (55: length fits in this block;
     * 56..63: padding spills into a second block; 64: a full block), hashed
     * in one piece and byte by byte, must agree. Known value: 64 x 'a'. */
    unsigned char buf[130];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (unsigned char)('a');
    char one[MOE_SHA256_HEX_LEN], many[MOE_SHA256_HEX_LEN];
    for (size_t n = 50; n <= sizeof buf; n++) {
        sha_hex(buf, n, one);
        moe_sha256_ctx ctx;
        moe_sha256_init(&ctx);
        for (size_t i = 0; i < n; i++)
            moe_sha256_update(&ctx, buf + i, 1);
        moe_sha256_update(&ctx, NULL, 0); /* an empty update changes nothing */
        uint8_t d[MOE_SHA256_DIGEST_LEN];
        moe_sha256_final(&ctx, d);
        moe_sha256_hex(d, many);
        ck_assert_str_eq(one, many);
    }
    sha_hex(buf, 64, one);
    ck_assert_str_eq(one, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}
END_TEST

START_TEST(test_sha256_file_shakespeare) {
    char path[4096], hex[65];
    moe_error err;
    ck_assert_int_eq(moe_data_find(path, sizeof path, NULL, &err), MOE_OK);
    ck_assert_int_eq(moe_sha256_file(path, hex, &err), MOE_OK);
    ck_assert_str_eq(hex, MOE_DATA_DEFAULT_SHA256);

    /* A file that is not there is an I/O error naming it. */
    char missing[512];
    moe_test_tmp_path(missing, sizeof missing, "no_such_file_for_sha");
    unlink(missing);
    moe_error_clear(&err);
    ck_assert_int_eq(moe_sha256_file(missing, hex, &err), MOE_ERR_IO);
    ck_assert_ptr_nonnull(strstr(err.msg, missing));
}
END_TEST

/* ---------------------------------------------------------------- search order */

START_TEST(test_find_order) {
    scratch sc;
    scratch_make(&sc, "find_order", 1, 1);
    char flag_file[512], env_file[512], out[4096];
    moe_test_tmp_path(flag_file, sizeof flag_file, "find_order_flag.txt");
    moe_test_tmp_path(env_file, sizeof env_file, "find_order_env.txt");
    write_file(flag_file, "flag\n", 5);
    write_file(env_file, "env\n", 4);
    ck_assert_int_eq(chdir(sc.work), 0);
    moe_error err;

    /* 1. the flag beats everything */
    setenv(MOE_DATA_ENV, env_file, 1);
    ck_assert_int_eq(moe_data_find(out, sizeof out, flag_file, &err), MOE_OK);
    ck_assert_str_eq(out, flag_file);
    /* 2. the environment beats data/ (an empty flag counts as not given) */
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    ck_assert_str_eq(out, env_file);
    ck_assert_int_eq(moe_data_find(out, sizeof out, "", &err), MOE_OK);
    ck_assert_str_eq(out, env_file);
    /* 3. data/ beats ../shared/data/ */
    unsetenv(MOE_DATA_ENV);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    ck_assert_str_eq(out, "data/" MOE_DATA_DEFAULT_NAME);
    /* 4. ../shared/data/ when data/ has nothing */
    unlink(sc.local);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    ck_assert_str_eq(out, "../shared/data/" MOE_DATA_DEFAULT_NAME);
    /* A set-but-wrong MOE_DATA_PATH does not stop the search. */
    setenv(MOE_DATA_ENV, "/nonexistent/moe_no_such_file.txt", 1);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    ck_assert_str_eq(out, "../shared/data/" MOE_DATA_DEFAULT_NAME);
    /* A buffer too small for the path is an error, not an overflow. */
    char tiny[8];
    ck_assert_int_eq(moe_data_find(tiny, sizeof tiny, flag_file, &err), MOE_ERR_IO);

    ck_assert_int_eq(chdir(g_saved_cwd), 0);
    unlink(flag_file);
    unlink(env_file);
    scratch_remove(&sc);
}
END_TEST

START_TEST(test_find_missing_flag) {
    /* Even with every fallback available, a missing --data-path is an error. */
    scratch sc;
    scratch_make(&sc, "missing_flag", 1, 1);
    ck_assert_int_eq(chdir(sc.work), 0);
    setenv(MOE_DATA_ENV, sc.local, 1);
    char out[4096];
    moe_error err;
    moe_error_clear(&err);
    const char *missing = "/nonexistent/moe_missing_data.txt";
    ck_assert_int_eq(moe_data_find(out, sizeof out, missing, &err), MOE_ERR_IO);
    ck_assert_int_eq(err.code, MOE_ERR_IO);
    ck_assert_ptr_nonnull(strstr(err.msg, "--data-path"));
    ck_assert_ptr_nonnull(strstr(err.msg, missing));
    /* A directory is not a data file either. */
    ck_assert_int_eq(moe_data_find(out, sizeof out, sc.work, &err), MOE_ERR_IO);
    ck_assert_ptr_nonnull(strstr(err.msg, "directory"));
    /* Loading goes through the same search. */
    moe_dataset ds;
    ck_assert_int_eq(moe_dataset_load(&ds, missing, MOE_TOKENIZER_CHAR, &err), MOE_ERR_IO);
    ck_assert_ptr_null(ds.tokens);
    ck_assert_int_eq(chdir(g_saved_cwd), 0);
    scratch_remove(&sc);
}
END_TEST

START_TEST(test_find_nothing) {
    /* Nothing anywhere, download disabled: the error lists every place. */
    scratch sc;
    scratch_make(&sc, "find_nothing", 0, 0);
    ck_assert_int_eq(chdir(sc.work), 0);
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    setenv(MOE_DATA_ENV, "/nonexistent/moe_env_data.txt", 1);
    char out[4096];
    moe_error err;
    moe_error_clear(&err);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_ERR_IO);
    ck_assert_int_eq(err.code, MOE_ERR_IO);
    const char *expected[] = {"--data-path",
                              "MOE_DATA_PATH",
                              "/nonexistent/moe_env_data.txt",
                              "data/" MOE_DATA_DEFAULT_NAME,
                              "../shared/data/" MOE_DATA_DEFAULT_NAME,
                              "download",
                              "MOE_NO_DOWNLOAD",
                              "Fix:"};
    for (size_t i = 0; i < sizeof expected / sizeof expected[0]; i++)
        ck_assert_msg(strstr(err.msg, expected[i]) != NULL, "'%s' missing from: %s", expected[i],
                      err.msg);
    ck_assert_ptr_nonnull(strchr(err.msg, '\n')); /* one place per line */
    /* No download means no file appeared in data/. */
    ck_assert_int_ne(access("data/" MOE_DATA_DEFAULT_NAME, F_OK), 0);
    ck_assert_int_eq(chdir(g_saved_cwd), 0);
    scratch_remove(&sc);
}
END_TEST

START_TEST(test_find_download) {
    /* The download step, without a network: a fake `curl` first on PATH
     * "downloads" by copying $FAKE_CURL_SRC to its -o argument (or fails with
     * curl's exit code 22 when that is unset). Checks that a good file is
     * verified and renamed into data/, and that a wrong one is rejected and
     * deleted, leaving no temporary behind either way. */
    char real[4096];
    moe_error err;
    ck_assert_int_eq(moe_data_find(real, sizeof real, NULL, &err), MOE_OK);
    char real_abs[PATH_MAX];
    ck_assert_ptr_nonnull(realpath(real, real_abs));

    scratch sc;
    scratch_make(&sc, "download", 0, 0);
    char bin[1400], curl[1500], junk[1500], path_env[8192];
    snprintf(bin, sizeof bin, "%s/bin", sc.root);
    snprintf(curl, sizeof curl, "%s/curl", bin);
    snprintf(junk, sizeof junk, "%s/junk.txt", sc.root);
    ck_assert_int_eq(mkdir(bin, 0700), 0);
    const char *script = "#!/bin/sh\n"
                         "while [ $# -gt 0 ]; do\n"
                         "  if [ \"$1\" = -o ]; then out=\"$2\"; shift; fi; shift\n"
                         "done\n"
                         "[ -n \"$FAKE_CURL_SRC\" ] || exit 22\n"
                         "exec cp \"$FAKE_CURL_SRC\" \"$out\"\n";
    write_file(curl, script, strlen(script));
    ck_assert_int_eq(chmod(curl, 0700), 0);
    write_file(junk, "not shakespeare\n", 16);
    snprintf(path_env, sizeof path_env, "%s:%s", bin,
             g_saved_path_env ? g_saved_path_env : "/usr/bin:/bin");
    setenv("PATH", path_env, 1);
    unsetenv("MOE_NO_DOWNLOAD");
    ck_assert_int_eq(chdir(sc.work), 0);
    char out[4096];

    /* 1. the download fails (no network): an I/O error that says so */
    unsetenv("FAKE_CURL_SRC");
    moe_error_clear(&err);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_ERR_IO);
    ck_assert_ptr_nonnull(strstr(err.msg, "curl failed"));
    /* ... that leaves no trace: the data/ it had to create is gone again */
    ck_assert_int_eq(rmdir("data"), 0); /* (scratch_make made data/; remove it first) */
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_ERR_IO);
    ck_assert_int_ne(access("data", F_OK), 0);
    /* 2. a file with the wrong checksum: a data error, and the file is gone */
    setenv("FAKE_CURL_SRC", junk, 1);
    moe_error_clear(&err);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_ERR_DATA);
    ck_assert_ptr_nonnull(strstr(err.msg, MOE_DATA_DEFAULT_SHA256));
    ck_assert_int_ne(access("data/" MOE_DATA_DEFAULT_NAME, F_OK), 0);
    /* 3. the right file: verified, renamed into data/, and found there next time */
    setenv("FAKE_CURL_SRC", real_abs, 1);
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    ck_assert_str_eq(out, "data/" MOE_DATA_DEFAULT_NAME);
    char hex[65];
    ck_assert_int_eq(moe_sha256_file(out, hex, &err), MOE_OK);
    ck_assert_str_eq(hex, MOE_DATA_DEFAULT_SHA256);
    unsetenv("FAKE_CURL_SRC"); /* a second download would now fail */
    ck_assert_int_eq(moe_data_find(out, sizeof out, NULL, &err), MOE_OK);
    /* No temporary left behind in data/: remove the one expected file, then
     * rmdir (in scratch_remove) succeeds only if the directory is empty. */
    ck_assert_int_eq(chdir(g_saved_cwd), 0);
    ck_assert_int_eq(unlink(sc.local), 0);
    char data_dir[1400];
    snprintf(data_dir, sizeof data_dir, "%s/work/data", sc.root);
    ck_assert_int_eq(rmdir(data_dir), 0);
    unlink(curl);
    unlink(junk);
    rmdir(bin);
    scratch_remove(&sc);
}
END_TEST

/* ---------------------------------------------------------------- loading */

START_TEST(test_load_shakespeare) {
    moe_dataset ds;
    moe_error err;
    moe_status s = moe_dataset_load(&ds, NULL, MOE_TOKENIZER_CHAR, &err);
    ck_assert_msg(s == MOE_OK, "%s", err.msg);
    ck_assert_uint_eq(ds.n_tokens, SHAKESPEARE_BYTES);
    ck_assert_uint_eq(ds.n_train, SHAKESPEARE_TRAIN);
    ck_assert_int_eq(ds.tok.vocab_size, SHAKESPEARE_VOCAB);
    ck_assert(ds.path[0] != '\0');
    /* The text starts "First Citizen:". */
    unsigned char head[14];
    moe_tokenizer_decode(&ds.tok, ds.tokens, sizeof head, head);
    ck_assert_int_eq(memcmp(head, "First Citizen:", sizeof head), 0);
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 256, &err), MOE_OK);
    moe_dataset_free(&ds);
    ck_assert_ptr_null(ds.tokens);
    ck_assert_uint_eq(ds.n_tokens, 0);

    /* The byte tokenizer reads the same file as 256 symbols, same split. */
    s = moe_dataset_load(&ds, NULL, MOE_TOKENIZER_BYTE, &err);
    ck_assert_msg(s == MOE_OK, "%s", err.msg);
    ck_assert_int_eq(ds.tok.vocab_size, 256);
    ck_assert_uint_eq(ds.n_train, SHAKESPEARE_TRAIN);
    ck_assert_int_eq(ds.tokens[0], 'F');
    moe_dataset_free(&ds);
    moe_dataset_free(&ds); /* freeing twice is harmless */
}
END_TEST

START_TEST(test_load_small_files) {
    char path[512];
    moe_test_tmp_path(path, sizeof path, "small_data.txt");
    moe_dataset ds;
    moe_error err;

    write_file(path, "", 0); /* empty */
    moe_error_clear(&err);
    ck_assert_int_eq(moe_dataset_load(&ds, path, MOE_TOKENIZER_CHAR, &err), MOE_ERR_DATA);
    ck_assert_ptr_nonnull(strstr(err.msg, "empty"));
    ck_assert_ptr_null(ds.tokens);

    write_file(path, "x", 1); /* one token cannot make two splits */
    ck_assert_int_eq(moe_dataset_load(&ds, path, MOE_TOKENIZER_BYTE, &err), MOE_ERR_DATA);
    ck_assert_ptr_null(ds.tokens);

    write_file(path, "abcdefghij", 10); /* the smallest sensible case: 9 + 1 */
    ck_assert_int_eq(moe_dataset_load(&ds, path, MOE_TOKENIZER_CHAR, &err), MOE_OK);
    ck_assert_uint_eq(ds.n_tokens, 10);
    ck_assert_uint_eq(ds.n_train, 9);
    ck_assert_str_eq(ds.path, path);
    /* ... but its 1-token validation split fits no sequence at all. */
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 1, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "--seq-length"));
    moe_dataset_free(&ds);
    unlink(path);
}
END_TEST

START_TEST(test_check_seq_len) {
    moe_dataset ds;
    synthetic_dataset(&ds, 100, 90); /* val has 10 tokens: sequences of at most 9 */
    moe_error err;
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 1, &err), MOE_OK);
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 9, &err), MOE_OK);
    moe_error_clear(&err);
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 10, &err), MOE_ERR_CONFIG);
    ck_assert_int_eq(err.code, MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "--seq-length"));
    ck_assert_ptr_nonnull(strstr(err.msg, " 9")); /* says the maximum */
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 0, &err), MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, -5, &err), MOE_ERR_CONFIG);
    moe_dataset_free(&ds);
}
END_TEST

/* ---------------------------------------------------------------- batches */

START_TEST(test_batch_deterministic) {
    moe_dataset ds;
    moe_error err;
    moe_status s = moe_dataset_load(&ds, NULL, MOE_TOKENIZER_CHAR, &err);
    ck_assert_msg(s == MOE_OK, "%s", err.msg);
    enum { B = 4, T = 64 };
    int in1[B * T], tg1[B * T], in2[B * T], tg2[B * T];

    /* Same (seed, split, index): same batch. */
    moe_dataset_batch(&ds, MOE_SPLIT_TRAIN, B, T, 1337, 7, in1, tg1);
    moe_dataset_batch(&ds, MOE_SPLIT_TRAIN, B, T, 1337, 7, in2, tg2);
    ck_assert_int_eq(memcmp(in1, in2, sizeof in1), 0);
    ck_assert_int_eq(memcmp(tg1, tg2, sizeof tg1), 0);
    /* Another index, another seed, or the other split: another batch. */
    moe_dataset_batch(&ds, MOE_SPLIT_TRAIN, B, T, 1337, 8, in2, tg2);
    ck_assert_int_ne(memcmp(in1, in2, sizeof in1), 0);
    moe_dataset_batch(&ds, MOE_SPLIT_TRAIN, B, T, 1338, 7, in2, tg2);
    ck_assert_int_ne(memcmp(in1, in2, sizeof in1), 0);
    moe_dataset_batch(&ds, MOE_SPLIT_VAL, B, T, 1337, 7, in2, tg2);
    ck_assert_int_ne(memcmp(in1, in2, sizeof in1), 0);
    /* The sequences within one batch differ from each other. */
    ck_assert_int_ne(memcmp(in1, in1 + T, T * sizeof *in1), 0);

    /* Targets are the inputs shifted by one token, and all are valid ids. */
    for (int b = 0; b < B; b++) {
        for (int t = 0; t + 1 < T; t++)
            ck_assert_int_eq(tg1[b * T + t], in1[b * T + t + 1]);
        for (int t = 0; t < T; t++)
            ck_assert(in1[b * T + t] >= 0 && in1[b * T + t] < SHAKESPEARE_VOCAB);
    }
    moe_dataset_free(&ds);
}
END_TEST

START_TEST(test_batch_offsets) {
    /* With token i == i, inputs reveal the offsets. A small split makes every
     * offset likely, so an off-by-one at either end would show. */
    moe_dataset ds;
    synthetic_dataset(&ds, 200, 180); /* train [0,180), val [180,200) */
    enum { B = 8, T = 4 };
    int in[B * T], tg[B * T];
    const uint64_t seed = 42;
    int seen_val[20 - T] = {0};
    size_t min_train = SIZE_MAX, max_train = 0;
    for (uint64_t idx = 0; idx < 500; idx++) {
        for (int split = 0; split < 2; split++) {
            size_t base = split ? 180 : 0, n_split = split ? 20 : 180;
            moe_dataset_batch(&ds, (moe_split)split, B, T, seed, idx, in, tg);
            for (int b = 0; b < B; b++) {
                /* the offset follows the documented formula exactly */
                double u = moe_rng_uniform(seed, (uint64_t)split + 0xDA7A0000u,
                                           idx * B + (uint64_t)b);
                size_t off = (size_t)(u * (double)(n_split - T));
                ck_assert_int_eq(in[b * T], (int)(base + off));
                for (int t = 0; t < T; t++) {
                    int x = in[b * T + t], y = tg[b * T + t];
                    ck_assert_int_eq(x, (int)(base + off) + t); /* contiguous */
                    ck_assert_int_eq(y, x + 1);                 /* next token */
                    /* inputs and targets stay inside the split */
                    ck_assert((size_t)x >= base && (size_t)y < base + n_split);
                }
                if (split)
                    seen_val[off]++;
                else {
                    min_train = off < min_train ? off : min_train;
                    max_train = off > max_train ? off : max_train;
                }
            }
        }
    }
    /* Every possible val offset 0..15 occurs, and train reaches both ends. */
    for (int o = 0; o < 20 - T; o++)
        ck_assert_msg(seen_val[o] > 0, "val offset %d never drawn", o);
    ck_assert_uint_eq(min_train, 0);
    ck_assert_uint_eq(max_train, 180 - T - 1);
    moe_dataset_free(&ds);
}
END_TEST

START_TEST(test_batch_longest_sequence) {
    /* At the maximum seq_len the only offset is 0: the whole split. */
    moe_dataset ds;
    synthetic_dataset(&ds, 100, 90);
    moe_error err;
    ck_assert_int_eq(moe_dataset_check_seq_len(&ds, 9, &err), MOE_OK);
    int in[2 * 9], tg[2 * 9];
    moe_dataset_batch(&ds, MOE_SPLIT_VAL, 2, 9, 3, 0, in, tg);
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 9; t++) {
            ck_assert_int_eq(in[b * 9 + t], 90 + t);
            ck_assert_int_eq(tg[b * 9 + t], 91 + t);
        }
    moe_dataset_free(&ds);
}
END_TEST

Suite *suite_data(void) {
    Suite *s = suite_create("data");

    TCase *tok = tcase_create("tokenizer");
    tcase_add_checked_fixture(tok, setup, teardown);
    tcase_add_test(tok, test_tokenizer_char_shakespeare);
    tcase_add_test(tok, test_tokenizer_byte_roundtrip);
    tcase_add_test(tok, test_tokenizer_char_small);
    tcase_add_test(tok, test_tokenizer_parse_type);
    suite_add_tcase(s, tok);

    TCase *sha = tcase_create("sha256");
    tcase_add_checked_fixture(sha, setup, teardown);
    tcase_add_test(sha, test_sha256_fips_vectors);
    tcase_add_test(sha, test_sha256_padding_boundaries);
    tcase_add_test(sha, test_sha256_file_shakespeare);
    suite_add_tcase(s, sha);

    TCase *find = tcase_create("search");
    tcase_add_checked_fixture(find, setup, teardown);
    tcase_add_test(find, test_find_order);
    tcase_add_test(find, test_find_missing_flag);
    tcase_add_test(find, test_find_nothing);
    tcase_add_test(find, test_find_download);
    suite_add_tcase(s, find);

    TCase *load = tcase_create("load");
    tcase_add_checked_fixture(load, setup, teardown);
    tcase_set_timeout(load, 30);
    tcase_add_test(load, test_load_shakespeare);
    tcase_add_test(load, test_load_small_files);
    tcase_add_test(load, test_check_seq_len);
    tcase_add_test(load, test_batch_deterministic);
    tcase_add_test(load, test_batch_offsets);
    tcase_add_test(load, test_batch_longest_sequence);
    suite_add_tcase(s, load);
    return s;
}
