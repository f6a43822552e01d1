/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 *
 * On-disk contract and the load outcome table: docs/design.md
 * ("On-disk contract"), compatible with vLLM's FS offload tier.
 *
 * Plain C11 (gnu11) + POSIX/Linux, no Python: a whole batch runs without the
 * GIL and the C test programs under tests/c/ call it directly.
 *
 * This file decides what happens to a block (open, record, verify, retry,
 * condemn, publish); the bytes move through the I/O engine (io_engine.h):
 * large pieces, io_uring where the kernel gives it (uring.h), the CRC of each
 * piece computed while the next ones are in flight, and for loads private
 * memory + the fused copy + CRC into the caller's buffer, in the commit
 * sections of the job state (job_state.h). A load is open, fgetxattr, the
 * reads, close; what a failure needs to prove itself (fstat, a re-read) only
 * on the failure path.
 */
#define _GNU_SOURCE
#include "fs_io.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h> /* rename */
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "crc32c.h"
#include "io_engine.h"
#include "job_state.h"

/* KVTIER_CRC_COPY: 0/false/no/off turns the fused copy off (loads then
 * checksum each piece with the active backend and copy it). Read once. */
static pthread_once_t crc_copy_once = PTHREAD_ONCE_INIT;
static int crc_copy_mode;

static void crc_copy_read_env(void)
{
    const char *c = getenv("KVTIER_CRC_COPY"); /* unset, empty or unknown: on */
    crc_copy_mode = !(c != NULL && (!strcasecmp(c, "0") || !strcasecmp(c, "false") || !strcasecmp(c, "no") ||
                                    !strcasecmp(c, "off")));
}

/* The fused copy + CRC moves checksummed loads into the caller's buffer:
 * not turned off, a fused kernel for this CPU, and the active CRC32C backend
 * is the best CPU one (not forced to another, not DSA). */
static int crc_copy_enabled(void)
{
    pthread_once(&crc_copy_once, crc_copy_read_env);
    return crc_copy_mode && kvt_crc32c_copy_best()->available != NULL &&
           kvt_crc32c_active() == kvt_crc32c_best_cpu();
}

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static void put_be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

static void set_fail(kvt_batch_result *res, int err, size_t index, int checksum_failed)
{
    res->err = err ? err : EIO;
    res->index = index;
    res->checksum_failed = checksum_failed;
}

/* mkdir -p of the directory part of `path`. Returns 0 or -1 with errno. */
static int make_parents(const char *path)
{
    size_t n = strlen(path);
    char *p = malloc(n + 1);
    if (!p) {
        errno = ENOMEM;
        return -1;
    }
    memcpy(p, path, n + 1);
    char *slash = strrchr(p, '/');
    if (!slash || slash == p) {
        free(p);
        return 0;
    }
    *slash = '\0';
    /* Fast path: the parent usually exists except for its last component(s). */
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            free(p);
            errno = e;
            return -1;
        }
        *s = '/';
    }
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
        int e = errno;
        free(p);
        errno = e;
        return -1;
    }
    free(p);
    return 0;
}

/* ------------------------------------------------------------------ */
/* EINTR-safe wrappers                                                 */
/* ------------------------------------------------------------------ */

/* A signal handler installed without SA_RESTART (Python installs its own that
 * way) makes a slow call on NFS/FUSE fail with EINTR before it did anything:
 * retry open, the xattr calls and rename. */
static int open_r(const char *path, int flags, mode_t mode)
{
    int fd;
    do
        fd = open(path, flags, mode);
    while (fd < 0 && errno == EINTR);
    return fd;
}

static int fsetxattr_r(int fd, const char *name, const void *val, size_t n)
{
    int r;
    do
        r = fsetxattr(fd, name, val, n, 0);
    while (r != 0 && errno == EINTR);
    return r;
}

static ssize_t fgetxattr_r(int fd, const char *name, void *val, size_t n)
{
    ssize_t r;
    do
        r = fgetxattr(fd, name, val, n);
    while (r < 0 && errno == EINTR);
    return r;
}

static int rename_r(const char *from, const char *to)
{
    int r;
    do
        r = rename(from, to);
    while (r != 0 && errno == EINTR);
    return r;
}

/* close(2) is never retried: on Linux the descriptor is released even when
 * close returns EINTR (close(2) NOTES), and a retry could close a descriptor
 * another thread just got. EINTR therefore counts as success. Returns 0 or
 * -1 with errno (EIO, ENOSPC, EDQUOT: deferred write errors of NFS/FUSE). */
static int close_r(int fd)
{
    if (close(fd) == 0 || errno == EINTR)
        return 0;
    return -1;
}

/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

/* fsync the directory holding `path` (makes a rename durable).
 * Returns 0 or an errno value; EINVAL (directory fsync not supported, e.g.
 * some FUSE filesystems) counts as done. */
static int fsync_parent(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash)
        dir = strdup(".");
    else if (slash == path)
        dir = strdup("/");
    else
        dir = strndup(path, (size_t)(slash - path));
    if (!dir)
        return ENOMEM;
    int fd = open_r(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    free(dir);
    if (fd < 0)
        return errno;
    int err = 0, r;
    do
        r = fsync(fd);
    while (r != 0 && errno == EINTR);
    if (r != 0 && errno != EINVAL)
        err = errno;
    close_r(fd);
    return err;
}

/* Create the temp of a store: O_CREAT|O_EXCL, missing parents made on
 * ENOENT; with `want_direct` O_DIRECT at open, and where the filesystem
 * refuses it (EINVAL; ramfs creates the file first) buffered. Returns the fd
 * (*direct = O_DIRECT is on) or -1 with errno. */
static int open_tmp(const char *tmp, int want_direct, int *direct)
{
    const int fl = O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC;
    for (int made_parents = 0;;) {
        int fd = open_r(tmp, fl | (want_direct ? O_DIRECT : 0), 0644);
        if (fd >= 0) {
            *direct = want_direct;
            return fd;
        }
        if (want_direct && errno == EINVAL) {
            unlink(tmp); /* our own random name: created by the refused open, or absent */
            want_direct = 0;
            continue;
        }
        if (errno != ENOENT || made_parents || make_parents(tmp) != 0)
            return -1;
        made_parents = 1;
    }
}

/* Store one block. Returns 0, or an errno value (the temp is removed). */
static int store_one(const char *tmp, const char *dest, const uint8_t *buf, size_t len, int use_o_direct,
                     int checksum, int durable, kvt_job_state *js)
{
    struct stat st;
    if (!kvt_job_live(js))
        return ETIMEDOUT; /* expired before this block began: nothing created */
    if (stat(dest, &st) == 0)
        return 0; /* already stored (by us or a peer): nothing to do */

    /* O_DIRECT at open (no fcntl) when the buffer and length meet the page
     * alignment, which every filesystem's O_DIRECT accepts. */
    int direct = 0;
    int fd = open_tmp(tmp, use_o_direct && len > 0 && len % 4096 == 0 && ((uintptr_t)buf & 4095u) == 0, &direct);
    if (fd < 0)
        return errno;

    uint32_t crc = 0;
    int err = kvt_engine_write(fd, buf, len, &direct, checksum, &crc);
    if (!err && checksum) {
        uint8_t rec[KVT_XATTR_LEN];
        put_be32(rec, crc);
        if (fsetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec) != 0)
            err = errno;
    }
    if (!err && durable) { /* data before the name */
        int r;
        do
            r = fdatasync(fd);
        while (r != 0 && errno == EINTR);
        if (r != 0)
            err = errno;
    }
    /* The temp's identity, to tell our published file from a peer's later. */
    struct stat mine = {0};
    if (!err && durable && fstat(fd, &mine) != 0)
        err = errno;
    if (close_r(fd) != 0 && !err)
        err = errno;
    /* Publish only while the job is live (job_state.h): an expired store
     * unlinks its temp below instead. */
    if (!err && !kvt_job_commit_begin(js))
        err = ETIMEDOUT;
    else if (!err) {
        if (rename_r(tmp, dest) != 0)
            err = errno;
        kvt_job_commit_end(js);
    }
    if (err) {
        unlink(tmp);
        return err;
    }
    if (durable && (err = fsync_parent(dest)) != 0) {
        /* Published but not durable: a failed store leaves nothing. Only our
         * own file, though: a peer that renamed its block onto dest after our
         * rename (its stat(dest) ran before it) keeps its block. */
        if (stat(dest, &st) == 0 && st.st_ino == mine.st_ino && st.st_dev == mine.st_dev)
            unlink(dest);
    }
    return err;
}

int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths, const void *const *bufs,
                    const size_t *lens, size_t n, int use_o_direct, int checksum, int durable,
                    kvt_job_state *js, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    res->retried = 0;
    for (size_t i = 0; i < n; i++) {
        int e = store_one(tmp_paths[i], dest_paths[i], (const uint8_t *)bufs[i], lens[i], use_o_direct, checksum,
                          durable, js);
        if (e) {
            set_fail(res, e, i, 0);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Load                                                                */
/* ------------------------------------------------------------------ */

/* Process-wide checksum counters (kvt_checksum_stats). */
static _Atomic uint64_t stat_retries, stat_condemned;

void kvt_checksum_stats(uint64_t *retries, uint64_t *condemned)
{
    *retries = atomic_load(&stat_retries);
    *condemned = atomic_load(&stat_condemned);
}

/* See fs_io.h. */
void kvt_crc_copy_info(kvt_crc_copy_stats *out)
{
    kvt_engine_stats st;
    kvt_engine_info(&st);
    out->kernel = kvt_crc32c_copy_best()->name;
    out->enabled = crc_copy_enabled();
    out->blocks = st.fused_blocks;
    out->bytes = st.fused_bytes;
}

/* 1 if the open file's xattr record is a well-formed CRC32C that matches all
 * `size` bytes of the file (read through a scratch buffer, so any size works).
 * Used only on the wrong-size error path, to tell a caller's block-size
 * mismatch (intact block: keep it) from a truncated or grown file (remove). */
static int whole_file_verifies(int fd, uint64_t size)
{
    uint8_t rec[KVT_XATTR_BUF];
    uint32_t want;
    ssize_t r = fgetxattr(fd, KVT_XATTR_NAME, rec, sizeof rec);
    if (kvt_xattr_parse(rec, (long)r, r < 0 ? errno : 0, &want) != KVT_REC_OK)
        return 0;
    uint8_t *buf = malloc(KVT_ENGINE_CHUNK);
    if (!buf)
        return 0;
    uint32_t crc = 0;
    uint64_t off = 0;
    int direct = 1; /* the fd may be O_DIRECT: an EINVAL on this buffer drops it */
    while (off < size) {
        size_t n = size - off < KVT_ENGINE_CHUNK ? (size_t)(size - off) : KVT_ENGINE_CHUNK;
        ssize_t got = kvt_read_full(fd, buf, n, off, &direct);
        if (got != (ssize_t)n)
            break;
        crc = kvt_crc32c(crc, buf, n);
        off += n;
    }
    free(buf);
    return off == size && crc == want;
}

/* Remove `path` only if it is still the file open as `fd`: a peer that
 * republished a good block under the same name meanwhile keeps it. */
static void unlink_if_same(const char *path, int fd)
{
    struct stat a, b;
    if (fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev)
        unlink(path);
}

/* Open a block for reading. O_DIRECT at open (no fcntl) when asked and the
 * length is a multiple of the page: the engine reads O_DIRECT into its
 * page-aligned private memory. A filesystem refusing O_DIRECT at open
 * (EINVAL) is read buffered; one refusing it at the first read is handled by
 * the engine. O_NOFOLLOW: a block is never a symlink (ELOOP, kept: nothing
 * outside the cache is read or removed). O_NONBLOCK: a FIFO or device at a
 * block path must not block the batch; a regular file ignores it. */
static int open_block(const char *src, int want_direct, int *direct)
{
    const int fl = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    *direct = 0;
    if (want_direct) {
        int fd = open_r(src, fl | O_DIRECT, 0);
        if (fd >= 0 || errno != EINVAL) {
            *direct = fd >= 0;
            return fd;
        }
    }
    return open_r(src, fl, 0);
}

/* The second look at a block whose record or read was not what a good block
 * gives (a failure path: the common path never stats). Returns 0 when the
 * open file is a regular file of exactly `len` bytes; EISDIR / EINVAL for a
 * directory / other non-regular file (kept: not ours to judge); EIO for a
 * regular file of another size, with *remove = 1 unless its own record
 * proves its bytes intact (then the caller asked for another block size: a
 * layout mismatch, the block is kept); or fstat's errno. */
static int check_block_file(int fd, size_t len, int checksum, int *remove)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return errno;
    if (!S_ISREG(st.st_mode))
        return S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
    if ((uint64_t)st.st_size != (uint64_t)len) {
        *remove = !(checksum && whole_file_verifies(fd, (uint64_t)st.st_size));
        return EIO; /* truncated, empty or longer: corrupt */
    }
    return 0;
}

/* Read the record (with `checksum`) and the data of an open block. Returns 0
 * with *mismatch = 1 for a CRC mismatch or malformed record, 0 with
 * *mismatch = 0 when good (or legacy), or an errno value (*remove = 1 when
 * the file proved corrupt). A re-read (`reread`) is buffered and
 * checksummed by the active backend. */
static int read_verify(int fd, uint8_t *buf, size_t len, int *direct, int checksum, int reread, kvt_job_state *js,
                       int *mismatch, int *remove)
{
    *mismatch = 0;
    /* Record first: a legacy block (ENODATA) needs no CRC at all. */
    int have_rec = 0;
    uint32_t want = 0;
    if (checksum) {
        uint8_t rec[KVT_XATTR_BUF];
        ssize_t r = fgetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec);
        int xerr = r < 0 ? errno : 0;
        switch (kvt_xattr_parse(rec, (long)r, xerr, &want)) {
        case KVT_REC_OK:
            have_rec = 1;
            break;
        case KVT_REC_ABSENT: /* ENODATA: legacy block stored without checksum, accept */
            break;
        case KVT_REC_MALFORMED: { /* wrong length, or longer than the buffer (ERANGE) */
            int e = check_block_file(fd, len, checksum, remove); /* a wrong size says EIO first */
            if (e)
                return e;
            *mismatch = 1;
            return 0;
        }
        default: { /* EOPNOTSUPP, EIO, ...: not the block's fault, keep */
            int e = check_block_file(fd, len, checksum, remove);
            return e ? e : xerr;
        }
        }
    }
    if (reread && *direct && kvt_set_direct(fd, 0) == 0)
        *direct = 0; /* the re-read comes from the device through the page cache, buffered */

    int err;
    if (!have_rec && js == NULL) {
        /* Nothing to verify, no deadline: straight into buf (one read), as
         * vLLM does; the size is checked with one fstat. */
        err = check_block_file(fd, len, checksum, remove);
        if (err)
            return err;
        ssize_t r = kvt_read_full(fd, buf, len, 0, direct);
        if (r >= 0 && (size_t)r == len)
            return 0;
        err = r < 0 ? errno : EIO;
        if (r >= 0)
            *remove = 1; /* shrank after fstat: short read */
        return err;
    }
    int move = !have_rec ? (crc_copy_enabled() ? KVT_MOVE_NT : KVT_MOVE_COPY)
                         : (!reread && crc_copy_enabled()) ? KVT_MOVE_FUSED : KVT_MOVE_CRC_COPY;
    uint32_t got = 0;
    err = kvt_engine_read(fd, buf, len, direct, move, js, &got);
    if (err == KVT_READ_SHORT || err == KVT_READ_LONG) {
        /* The second observation: a file of another size (or a non-file) says
         * so; a regular file of the right size that read otherwise changed
         * under us: corrupt. */
        int e = check_block_file(fd, len, checksum, remove);
        if (e)
            return e;
        *remove = 1;
        return EIO;
    }
    if (err != 0) {
        if (err != ETIMEDOUT && err != ENOMEM) {
            int e = check_block_file(fd, len, 0, remove); /* EISDIR for a directory ... */
            if (e == EISDIR || e == EINVAL)
                return e;
            *remove = 0; /* a read error is the filesystem's, not the block's */
        }
        return err;
    }
    if (have_rec && got != want)
        *mismatch = 1;
    return 0;
}

/* Load one block. Returns 0, or an errno value with *checksum_failed set for
 * a CRC mismatch / malformed record. A first mismatch is retried once (the
 * page cache dropped, record and data re-read) to tell a transient glitch
 * from a bad block; a second condemns it. Removes the file when condemned
 * or of the wrong size (the table in design.md). *retried = 1 if re-read.
 * The common path is open, fgetxattr, the reads, close (plus an fstat when
 * there is neither a record to verify nor a job state). */
static int load_one(const char *src, uint8_t *buf, size_t len, int use_o_direct, int checksum, kvt_job_state *js,
                    int *checksum_failed, int *retried)
{
    *checksum_failed = 0;
    *retried = 0;
    if (!kvt_job_live(js))
        return ETIMEDOUT; /* expired before this block began */
    int direct;
    int fd = open_block(src, use_o_direct && len > 0 && len % 4096 == 0, &direct);
    if (fd < 0)
        return errno;

    int err = 0;
    int remove = 0;
    for (int attempt = 0;; attempt++) {
        int mismatch = 0;
        err = read_verify(fd, buf, len, &direct, checksum, attempt > 0, js, &mismatch, &remove);
        if (err || !mismatch)
            break;
        atomic_fetch_add(&stat_retries, attempt == 0);
        if (attempt == 1) {
            atomic_fetch_add(&stat_condemned, 1);
            *checksum_failed = 1;
            err = EBADMSG;
            remove = 1;
            break;
        }
        *retried = 1;
        posix_fadvise(fd, 0, (off_t)len, POSIX_FADV_DONTNEED); /* re-read from the device */
    }

    if (remove)
        unlink_if_same(src, fd);
    close_r(fd); /* read-only: nothing deferred to report */
    return err;
}

int kvt_batch_load(const char *const *src_paths, void *const *bufs, const size_t *lens, size_t n, int use_o_direct,
                   int checksum, kvt_job_state *js, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    res->retried = 0;
    for (size_t i = 0; i < n; i++) {
        int cf = 0, retried = 0;
        int e = load_one(src_paths[i], (uint8_t *)bufs[i], lens[i], use_o_direct, checksum, js, &cf, &retried);
        res->retried += (size_t)retried;
        if (e) {
            set_fail(res, e, i, cf);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Lookup                                                              */
/* ------------------------------------------------------------------ */

void kvt_batch_lookup(const char *const *paths, size_t n, uint8_t *out)
{
    struct stat st;
    for (size_t i = 0; i < n; i++)
        out[i] = stat(paths[i], &st) == 0;
}
