/* The checkpoint file format: see checkpoint_file.h and docs/checkpoint-format.md.
 *
 *   [0, 96)            header: magic, version, tensor count, step, file index and count,
 *                      where the data starts and how long it is, SHA-256 of header + index
 *   [96, 96 + 224·n)   index: one fixed-size entry per tensor (name, dtype, shapes, shard,
 *                      offset, bytes, SHA-256 of the data)
 *   [data_offset, end) data: each tensor at a multiple of 64 bytes from data_offset
 *
 * Integers are little-endian and written byte by byte, so the layout does not depend on
 * the compiler's struct padding. Tensor data is raw, in the host's (little-endian) order. */
#include "checkpoint_file.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic_file.h"

#define HEADER_BYTES 96
#define HEADER_HASHED 64 /* the header bytes before its checksum */
#define ENTRY_BYTES 224
#define ALIGN 64

static uint64_t align_up(uint64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

size_t moe_ckpt_dtype_size(moe_ckpt_dtype dtype) {
    switch (dtype) {
    case MOE_CKPT_F32: return 4;
    case MOE_CKPT_F64: return 8;
    case MOE_CKPT_I64: return 8;
    case MOE_CKPT_U8: return 1;
    }
    return 0;
}

static void encode_entry(unsigned char *p, const moe_ckpt_tensor *t, uint64_t offset) {
    memset(p, 0, ENTRY_BYTES);
    memcpy(p, t->name, strnlen(t->name, MOE_CKPT_NAME_LEN - 1));
    put_u32(p + 128, (uint32_t)t->dtype);
    put_u32(p + 132, (uint32_t)t->ndim);
    for (int d = 0; d < 3; d++)
        put_u64(p + 136 + 8 * d, (uint64_t)(d < t->ndim ? t->global_shape[d] : 0));
    put_u32(p + 160, (uint32_t)t->shard_dim);
    put_u32(p + 164, (uint32_t)t->shard_index);
    put_u32(p + 168, (uint32_t)t->shard_count);
    put_u64(p + 176, offset);
    put_u64(p + 184, t->bytes);
    memcpy(p + 192, t->sha256, MOE_SHA256_DIGEST_LEN);
}

/* Test hook (make test): MOE_TEST_KILL_IN_SAVE=n kills this process with SIGKILL halfway
 * through the data of the n-th file it writes, to prove that a crash during a save leaves
 * the previous checkpoint loadable. */
static int kill_in_this_write(void) {
    static int writes;
    const char *s = getenv("MOE_TEST_KILL_IN_SAVE");
    writes++;
    return s && atoi(s) == writes;
}

moe_status moe_ckpt_file_write(const char *path, const moe_ckpt_file_info *info,
                               moe_ckpt_tensor *t, int n, moe_error *err) {
    const uint64_t data_offset = align_up(HEADER_BYTES + (uint64_t)ENTRY_BYTES * n);
    unsigned char *head = calloc(1, (size_t)data_offset);
    if (!head)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory writing checkpoint '%s'", path);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        moe_sha256_bytes(t[i].data, (size_t)t[i].bytes, t[i].sha256);
        encode_entry(head + HEADER_BYTES + (size_t)ENTRY_BYTES * i, &t[i], off);
        off = align_up(off + t[i].bytes);
    }
    const uint64_t data_bytes = off;
    memcpy(head, MOE_CKPT_MAGIC, 8);
    put_u32(head + 8, MOE_CKPT_VERSION);
    put_u32(head + 12, (uint32_t)n);
    put_u64(head + 16, (uint64_t)info->step);
    put_u32(head + 24, (uint32_t)info->file_index);
    put_u32(head + 28, (uint32_t)info->file_count);
    put_u64(head + 32, data_offset);
    put_u64(head + 40, data_bytes);
    moe_sha256_ctx h;
    moe_sha256_init(&h);
    moe_sha256_update(&h, head, HEADER_HASHED);
    moe_sha256_update(&h, head + HEADER_BYTES, (size_t)ENTRY_BYTES * n);
    moe_sha256_final(&h, head + HEADER_HASHED);

    moe_atomic_file af;
    moe_status s = moe_atomic_open(&af, path, err);
    if (s != MOE_OK) {
        free(head);
        return s;
    }
    const int kill_me = kill_in_this_write();
    static const unsigned char zeros[ALIGN];
    fwrite(head, 1, (size_t)data_offset, af.f);
    free(head);
    off = 0;
    for (int i = 0; i < n; i++) {
        if (kill_me && i >= n / 2) {
            fflush(af.f);
            raise(SIGKILL);
        }
        fwrite(t[i].data, 1, (size_t)t[i].bytes, af.f);
        uint64_t next = align_up(off + t[i].bytes);
        fwrite(zeros, 1, (size_t)(next - off - t[i].bytes), af.f);
        off = next;
    }
    return moe_atomic_commit(&af, err); /* reports any write error above */
}

void moe_ckpt_file_free(moe_ckpt_file *f) {
    free(f->t);
    free(f->buf);
    memset(f, 0, sizeof *f);
}

/* Decode and check entry i; its data must lie inside the data section. */
static moe_status decode_entry(moe_ckpt_file *f, int i, uint64_t data_offset,
                               uint64_t data_bytes, moe_error *err) {
    const unsigned char *p = f->buf + HEADER_BYTES + (size_t)ENTRY_BYTES * i;
    moe_ckpt_tensor *t = &f->t[i];
    if (memchr(p, 0, MOE_CKPT_NAME_LEN) == NULL)
        return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': tensor %d has no valid name",
                             f->path, i);
    memcpy(t->name, p, MOE_CKPT_NAME_LEN);
    t->dtype = (moe_ckpt_dtype)get_u32(p + 128);
    t->ndim = (int)get_u32(p + 132);
    t->shard_dim = (int)get_u32(p + 160);
    t->shard_index = (int)get_u32(p + 164);
    t->shard_count = (int)get_u32(p + 168);
    const uint64_t off = get_u64(p + 176);
    t->bytes = get_u64(p + 184);
    memcpy(t->sha256, p + 192, MOE_SHA256_DIGEST_LEN);
    /* the header checksum already matched, so these only fail for a file written wrongly */
    int ok = moe_ckpt_dtype_size(t->dtype) > 0 && t->ndim >= 1 && t->ndim <= 3 &&
             t->shard_count >= 1 && t->shard_index >= 0 && t->shard_index < t->shard_count &&
             t->shard_dim >= 0 && t->shard_dim < t->ndim;
    uint64_t numel = 1;
    for (int d = 0; ok && d < t->ndim; d++) {
        uint64_t g = get_u64(p + 136 + 8 * d);
        t->global_shape[d] = (int64_t)g;
        ok = g >= 1 && g <= (1ull << 40) && numel <= (1ull << 62) / g;
        numel *= ok ? g : 1;
    }
    ok = ok && t->global_shape[t->shard_dim] % t->shard_count == 0 &&
         t->bytes == numel / (uint64_t)t->shard_count * moe_ckpt_dtype_size(t->dtype) &&
         off <= data_bytes && t->bytes <= data_bytes - off;
    if (!ok)
        return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': the index entry of tensor "
                             "'%s' is inconsistent (shape, shard or extent)", f->path, t->name);
    t->data = f->buf + data_offset + off;
    uint8_t sum[MOE_SHA256_DIGEST_LEN];
    moe_sha256_bytes(t->data, (size_t)t->bytes, sum);
    if (memcmp(sum, t->sha256, sizeof sum) != 0)
        return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': tensor '%s' fails its SHA-256 "
                             "check (the file is corrupt; load an older checkpoint)", f->path,
                             t->name);
    return MOE_OK;
}

/* The tensors lie back to back in index order, each at the next multiple of 64 bytes, and
 * the padding between them is zero: so every byte of the file is checked by something. */
static moe_status check_layout(const moe_ckpt_file *f, uint64_t data_offset,
                               uint64_t data_bytes, moe_error *err) {
    const unsigned char *data = f->buf + data_offset;
    uint64_t end = 0;
    for (int i = 0; i <= f->n; i++) {
        const uint64_t next = i < f->n ? (uint64_t)((const unsigned char *)f->t[i].data - data)
                                       : data_bytes;
        if (next != align_up(end))
            return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': tensor data is not laid "
                                 "out as the format says", f->path);
        for (uint64_t b = end; b < next; b++)
            if (data[b] != 0)
                return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': nonzero padding at "
                                     "byte %llu (the file is corrupt)", f->path,
                                     (unsigned long long)(data_offset + b));
        if (i < f->n)
            end = next + f->t[i].bytes;
    }
    for (uint64_t b = HEADER_BYTES + (uint64_t)ENTRY_BYTES * f->n; b < data_offset; b++)
        if (f->buf[b] != 0)
            return moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': nonzero padding at byte "
                                 "%llu (the file is corrupt)", f->path, (unsigned long long)b);
    return MOE_OK;
}

/* The whole file in memory; *len its size. */
static moe_status slurp(const char *path, unsigned char **out, uint64_t *len, moe_error *err) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return moe_error_set(err, MOE_ERR_IO, "cannot open checkpoint file '%s': %s", path,
                             strerror(errno));
    long size = fseek(fp, 0, SEEK_END) == 0 ? ftell(fp) : -1;
    unsigned char *buf = size >= 0 ? malloc((size_t)size + 1) : NULL;
    int ok = buf && fseek(fp, 0, SEEK_SET) == 0 && fread(buf, 1, (size_t)size, fp) == (size_t)size;
    fclose(fp);
    if (!ok) {
        free(buf);
        if (size >= 0 && !buf)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory reading checkpoint file "
                                 "'%s' (%ld bytes)", path, size);
        return moe_error_set(err, MOE_ERR_IO, "cannot read checkpoint file '%s'", path);
    }
    *out = buf;
    *len = (uint64_t)size;
    return MOE_OK;
}

moe_status moe_ckpt_file_read(moe_ckpt_file *f, const char *path, moe_error *err) {
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    uint64_t len = 0;
    MOE_TRY(slurp(path, &f->buf, &len, err));
    moe_status s = MOE_OK;
    const unsigned char *h = f->buf;
    if (len < 8 || memcmp(h, MOE_CKPT_MAGIC, 8) != 0) {
        s = moe_error_set(err, MOE_ERR_DATA, "'%s' is not a moe.c checkpoint file (wrong magic "
                          "bytes)", path);
    } else if (len < HEADER_BYTES) {
        s = moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s' is truncated: %llu bytes, shorter "
                          "than its header", path, (unsigned long long)len);
    } else if (get_u32(h + 8) != MOE_CKPT_VERSION) {
        s = moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s' has format version %u; this build "
                          "reads version %d", path, get_u32(h + 8), MOE_CKPT_VERSION);
    }
    const uint64_t n = len >= HEADER_BYTES ? get_u32(h + 12) : 0;
    const uint64_t data_offset = len >= HEADER_BYTES ? get_u64(h + 32) : 0;
    const uint64_t data_bytes = len >= HEADER_BYTES ? get_u64(h + 40) : 0;
    if (s == MOE_OK && (data_offset < HEADER_BYTES + ENTRY_BYTES * n || data_offset > len ||
                        data_bytes != len - data_offset))
        s = moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s' is truncated or padded: %llu "
                          "bytes, its header says %llu", path, (unsigned long long)len,
                          (unsigned long long)(data_offset + data_bytes));
    if (s == MOE_OK) {
        uint8_t sum[MOE_SHA256_DIGEST_LEN];
        moe_sha256_ctx c;
        moe_sha256_init(&c);
        moe_sha256_update(&c, h, HEADER_HASHED);
        moe_sha256_update(&c, h + HEADER_BYTES, (size_t)(ENTRY_BYTES * n));
        moe_sha256_final(&c, sum);
        if (memcmp(sum, h + HEADER_HASHED, sizeof sum) != 0)
            s = moe_error_set(err, MOE_ERR_DATA, "checkpoint '%s': the header or tensor index "
                              "fails its SHA-256 check (the file is corrupt)", path);
    }
    if (s == MOE_OK) {
        f->info.step = (int64_t)get_u64(h + 16);
        f->info.file_index = (int)get_u32(h + 24);
        f->info.file_count = (int)get_u32(h + 28);
        f->n = (int)n;
        f->t = calloc(n ? n : 1, sizeof *f->t);
        if (!f->t)
            s = moe_error_set(err, MOE_ERR_NOMEM, "out of memory reading checkpoint '%s'", path);
    }
    for (int i = 0; s == MOE_OK && i < f->n; i++)
        s = decode_entry(f, i, data_offset, data_bytes, err);
    if (s == MOE_OK)
        s = check_layout(f, data_offset, data_bytes, err);
    if (s != MOE_OK)
        moe_ckpt_file_free(f);
    return s;
}
