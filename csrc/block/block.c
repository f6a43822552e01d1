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
 * condemn, publish); the bytes move through the I/O engine (engine.h):
 * large pieces, io_uring where the kernel gives it (uring.h), the CRC of each
 * piece computed while the next ones are in flight, and for bounce loads
 * private memory + the fused copy + CRC into the caller's buffer, in the
 * commit sections of the job state (job_state.h); a direct-landing load is
 * one read into the caller's buffer, then one CRC pass over it. A load is open, fgetxattr, the
 * reads, close; what a failure needs to prove itself (fstat, a re-read) only
 * on the failure path.
 */
#define _GNU_SOURCE
#include "block.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "engine.h"
#include "job_state.h"
#include "records.h"
#include "sys.h"

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static void set_fail(kvt_batch_result *res, int err, size_t index, int checksum_failed)
{
    res->err = err ? err : EIO;
    res->index = index;
    res->checksum_failed = checksum_failed;
}

/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

/* Create the temp of a store: O_CREAT|O_EXCL, missing parents made on
 * ENOENT; with `want_direct` O_DIRECT at open, and where the filesystem
 * refuses it (EINVAL; ramfs creates the file first) buffered. Returns the fd
 * (*direct = O_DIRECT is on) or -1 with errno. */
static int open_tmp(const char *tmp, int want_direct, int *direct)
{
    const int fl = O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC;
    for (int tries = 0;;) {
        int fd = kvt_open_r(tmp, fl | (want_direct ? O_DIRECT : 0), 0644);
        if (fd >= 0) {
            *direct = want_direct;
            return fd;
        }
        if (want_direct && errno == EINVAL) {
            unlink(tmp); /* our own random name: created by the refused open, or absent */
            want_direct = 0;
            continue;
        }
        /* ENOENT: make the parents and open again; ENOENT once they were made,
         * or from a parent's mkdir (a shared filesystem's name cache not showing
         * a directory just made, here or by another node): again after a pause
         * (policy.h) */
        if (errno != ENOENT || tries > KVT_RETRY_ENOENT_STORE || (kvt_make_parents(tmp) != 0 && errno != ENOENT))
            return -1;
        if (tries > 0) {
            struct timespec ts = {0, (long)(1000000L << tries)};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
                ;
        }
        tries++;
    }
}

/* fsync an existing block and its directory (a durable store of a block
 * already there, maybe not durable yet: another job's still syncing, or one
 * stored without durable). Returns 0 or an errno value with *op. */
static int sync_existing(const char *dest, int *op)
{
    *op = KVT_OP_OPEN;
    int fd = kvt_open_r(dest, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0)
        return errno;
    *op = KVT_OP_SYNC;
    int err = kvt_fsync_r(fd, 0) != 0 ? errno : 0;
    kvt_close_r(fd);
    if (!err && (err = kvt_fsync_parent(dest)) == 0)
        kvt_count(KVT_C_DURABLE_EXISTING);
    return err;
}

/* Whether the block file at `dest` has no CRC record (ENODATA for
 * user.vllm.kv_crc32c, and its identity record absent or without CRC): a
 * load reads it unverified, or in strict mode never (P17). Any other answer
 * (a record, EOPNOTSUPP, EIO) says no: the block is left as it is. */
static int lacks_crc_record(const char *dest)
{
    uint8_t rec[KVT_XATTR_BUF];
    if (kvt_lgetxattr_r(dest, KVT_ID_XATTR_NAME, rec, sizeof rec) == KVT_ID_REC_LEN)
        return 0;
    return kvt_lgetxattr_r(dest, KVT_XATTR_NAME, rec, sizeof rec) < 0 && errno == ENODATA;
}

/* The records of a checksummed store, set on the open temp once the CRC is
 * known: vLLM's record, and kvtier's identity record carrying the same CRC
 * (what a load reads: one xattr). 0, or an errno value. */
static int store_set_records(int fd, const char *dest, size_t len, uint32_t crc)
{
    uint8_t idrec[KVT_ID_REC_LEN];
    kvt_block_identity(dest, len, idrec);
    kvt_put_be32(idrec + KVT_ID_LEN, crc);
    if (kvt_fsetxattr_r(fd, KVT_XATTR_NAME, idrec + KVT_ID_LEN, KVT_XATTR_LEN) != 0 ||
        kvt_fsetxattr_r(fd, KVT_ID_XATTR_NAME, idrec, sizeof idrec) != 0)
        return errno ? errno : EIO;
    return 0;
}

/* One try at storing one block. Returns 0, or an errno value with *op (the
 * temp is removed; a published block never is), or KVT_STORE_LATE: published,
 * but the job expired during the rename (job_state.h). *unaligned: 1 when its
 * temp was opened buffered because of the buffer's address (store_one counts
 * the block once, when stored). */
#define KVT_STORE_LATE (-1)
static int store_try(const char *tmp, const char *dest, const uint8_t *buf, size_t len, int use_o_direct,
                     int checksum, int durable, kvt_job_state *js, int *op, int *unaligned)
{
    struct stat st;
    *op = KVT_OP_NONE;
    if (!kvt_job_live(js))
        return ETIMEDOUT; /* expired before this block began: nothing created */
    if (kvt_lstat_r(dest, &st) == 0) {
        int keep = S_ISREG(st.st_mode) && (uint64_t)st.st_size == (uint64_t)len; /* stored (by us or a peer) */
        if (keep && checksum && lacks_crc_record(dest))
            keep = 0; /* unverifiable (strict: a miss for ever): replaced by the verified copy of buf */
        if (keep) {
            int err = durable ? sync_existing(dest, op) : 0;
            if (!err)
                kvt_count(KVT_C_EXISTING);
            if (err != ENOENT || *op != KVT_OP_OPEN)
                return err;
            /* gone since the lstat (a peer, a condemnation): stored anew below */
        } else if (S_ISDIR(st.st_mode)) { /* not ours to remove; never "stored" */
            *op = KVT_OP_RENAME;
            return EISDIR;
        } else {
            kvt_count(KVT_C_REPLACED); /* symlink, FIFO, file of another size, no CRC record: the rename replaces it */
        }
    }

    /* O_DIRECT at open (no fcntl) when the length is a multiple of the page
     * (every filesystem's O_DIRECT accepts that) and so is the caller's buffer
     * address: every store writes straight from it (engine.h), so an
     * unaligned one is written buffered, and counted. */
    int direct = 0, want_direct = use_o_direct && len > 0 && len % 4096 == 0;
    *op = KVT_OP_OPEN;
    int odd = want_direct && ((uintptr_t)buf & 4095u) != 0; /* the O_DIRECT asked for is not used */
    int fd = open_tmp(tmp, want_direct && !odd, &direct);
    if (fd < 0)
        return errno;
    *unaligned = odd;

    uint32_t crc = 0;
    *op = KVT_OP_WRITE;
    int err = kvt_engine_write(fd, buf, len, &direct, checksum, &crc);
    if (!err && checksum && (err = store_set_records(fd, dest, len, crc)) != 0)
        *op = KVT_OP_SETXATTR;
    if (!err && durable) { /* data before the name */
        *op = KVT_OP_SYNC;
        if (kvt_fsync_r(fd, 1) != 0)
            err = errno;
    }
    if (kvt_close_r(fd) != 0 && !err) {
        err = errno;
        *op = KVT_OP_CLOSE;
    }
    /* Publish only while the job is live (job_state.h): an expired store
     * unlinks its temp below instead. */
    if (!err && !kvt_job_commit_begin(js)) {
        err = ETIMEDOUT;
        *op = KVT_OP_NONE;
    } else if (!err) {
        *op = KVT_OP_RENAME;
        if (kvt_rename_r(tmp, dest) != 0)
            err = errno;
        if (!kvt_job_commit_end(js) && !err)
            return KVT_STORE_LATE;
    }
    if (err) {
        unlink(tmp);
        return err;
    }
    /* Published. A failed directory fsync fails the store (not known durable)
     * but leaves the block: a good block, which another durable job may have
     * found, synced and reported stored. */
    if (durable && (err = kvt_fsync_parent(dest)) != 0)
        *op = KVT_OP_SYNC;
    return err;
}

/* Store one block under the error policy: EAGAIN/ESTALE retried from the
 * start (policy.h). Returns 0 or an errno value with *op. */
static int store_one(const char *tmp, const char *dest, const uint8_t *buf, size_t len, int use_o_direct,
                     int checksum, int durable, kvt_job_state *js, int *op)
{
    for (int attempt = 0;; attempt++) {
        int unaligned = 0;
        int err = store_try(tmp, dest, buf, len, use_o_direct, checksum, durable, js, op, &unaligned);
        if (err == 0 && unaligned)
            kvt_count(KVT_C_BUFFERED_UNALIGNED); /* once per block stored buffered for its address */
        if (err == 0 || !kvt_policy_retry(err, attempt))
            return err;
    }
}

static void batch_begin(kvt_batch_result *res, size_t n)
{
    memset(res, 0, sizeof *res);
    res->index = n;
    kvt_tl_counts = &res->counts;
}

static int batch_end(kvt_batch_result *res)
{
    kvt_tl_counts = NULL;
    kvt_policy_add_totals(&res->counts);
    return res->err ? -1 : 0;
}

int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths, const void *const *bufs,
                    const size_t *lens, size_t n, int use_o_direct, int checksum, int durable,
                    kvt_job_state *js, kvt_batch_result *res)
{
    batch_begin(res, n);
    for (size_t i = 0; i < n; i++) {
        int op = KVT_OP_NONE;
        int e = store_one(tmp_paths[i], dest_paths[i], (const uint8_t *)bufs[i], lens[i], use_o_direct, checksum,
                          durable, js, &op);
        if (e == KVT_STORE_LATE) { /* block i published; the job expired meanwhile */
            set_fail(res, ETIMEDOUT, i + 1, 0);
            break;
        }
        if (e) {
            set_fail(res, e, i, 0);
            res->op = op;
            break;
        }
        /* counted in the word (a store's JobState.blocks_done): the watchdog names
         * the block in flight, paths[count]; expired meanwhile, the next block stops */
        kvt_job_block_done(js);
    }
    return batch_end(res);
}

/* ------------------------------------------------------------------ */
/* Load                                                                */
/* ------------------------------------------------------------------ */

/* Process-wide checksum counters: sums of the policy counters. */
void kvt_checksum_stats(uint64_t *retries, uint64_t *condemned)
{
    kvt_counts t;
    kvt_policy_totals(&t);
    *retries = t.v[KVT_C_REREAD_CHECKSUM] + t.v[KVT_C_REREAD_IDENTITY];
    *condemned = t.v[KVT_C_CONDEMNED_CHECKSUM] + t.v[KVT_C_CONDEMNED_IDENTITY];
}

/* Whether one of the open file's CRC records matches all `size` bytes of the
 * file (read through a scratch buffer, so any size works): 1 yes, 0 no (no
 * record, a malformed one, a mismatch), -1 unknown (an error, or the file
 * changed size while read: transient, the file is kept). Used only on the
 * wrong-size path, to tell a caller's block-size mismatch (intact block: keep
 * it) from a truncated or grown file (remove). */
static int whole_file_verifies(int fd, uint64_t size)
{
    uint8_t rec[KVT_XATTR_BUF];
    uint32_t want[2];
    int n_want = 0, unknown = 0;
    /* The CRC its identity record carries (12 bytes; the identity is of its
     * own size, not the caller's: not compared), and its CRC record: either
     * verifying all its bytes proves them intact (a damaged identity record
     * alone is no proof against them, P11). Asked with checksums off too: a
     * block of another block size that carries a record is never removed for
     * its size (issue #24). No xattrs on the filesystem (EOPNOTSUPP): no
     * record. */
    ssize_t r = kvt_fgetxattr_r(fd, KVT_ID_XATTR_NAME, rec, sizeof rec);
    if (r == KVT_ID_REC_LEN)
        want[n_want++] = kvt_get_be32(rec + KVT_ID_LEN);
    else if (r < 0 && errno != ENODATA && errno != ERANGE && errno != EOPNOTSUPP)
        unknown = 1;
    r = kvt_fgetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec);
    int xerr = r < 0 ? errno : 0;
    switch (kvt_xattr_parse(rec, (long)r, xerr, &want[n_want])) {
    case KVT_REC_OK:
        n_want++;
        break;
    case KVT_REC_ERROR:
        unknown |= xerr != EOPNOTSUPP;
        break;
    default:
        break;
    }
    if (n_want == 0)
        return unknown ? -1 : 0;
    uint8_t *buf = malloc(KVT_ENGINE_CHUNK);
    if (!buf)
        return -1;
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
    if (off != size)
        return -1;
    if (crc == want[0] || (n_want > 1 && crc == want[1]))
        return 1;
    return unknown ? -1 : 0;
}

/* Remove `path` only if it is still the file open as `fd`: a peer that
 * republished a good block under the same name meanwhile keeps it. */
static void unlink_if_same(const char *path, int fd)
{
    struct stat a, b;
    if (kvt_fstat_r(fd, &a) == 0 && kvt_lstat_r(path, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev)
        unlink(path);
}

/* The directory every path of a load batch lies under, opened once (O_PATH):
 * each block is then opened relative to it, so the kernel walks the shared
 * components (the tier's root and rank directory, at least) once per batch
 * instead of once per block (docs/block_io.md "Small blocks"). fd = -1: each
 * path is opened whole. */
typedef struct load_dir {
    int fd;
    size_t skip; /* the shared prefix, up to and including its last '/' */
} load_dir;

/* A batch of fewer blocks opens whole paths: the directory's open and close
 * cost about what the shorter walks save over this many blocks. */
#define KVT_BATCH_DIR_MIN 16

/* The batch's directory: the longest prefix of every path that ends in '/'
 * (not "/" alone), opened O_PATH | O_DIRECTORY. Symlinks in it are followed
 * as a whole path's open follows them; a name under it is opened with
 * O_NOFOLLOW, as a whole path's last component is; a path equal to the prefix (nothing after the '/')
 * is opened whole. A directory that does not open (gone, EACCES, EINTR ...)
 * leaves every path to be opened whole, each with its own error. */
static load_dir batch_dir(const char *const *paths, size_t n)
{
    load_dir d = {-1, 0};
    if (n < KVT_BATCH_DIR_MIN)
        return d;
    const char *first = paths[0];
    const char *slash = strrchr(first, '/');
    if (slash == NULL)
        return d;
    size_t len = (size_t)(slash - first) + 1;
    for (size_t i = 1; i < n && len > 1; i++) {
        size_t k = 0;
        while (k < len && paths[i][k] == first[k])
            k++;
        while (k > 0 && first[k - 1] != '/')
            k--;
        len = k;
    }
    if (len <= 1)
        return d; /* nothing shared but "/" (or nothing) */
    char *dir = strndup(first, len);
    if (dir == NULL)
        return d;
    d.fd = kvt_open_r(dir, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
    free(dir);
    d.skip = d.fd >= 0 ? len : 0;
    return d;
}

/* Open a block for reading. O_DIRECT at open (no fcntl) when asked and the
 * length is a multiple of the page: the engine reads O_DIRECT into its
 * page-aligned private memory. A filesystem refusing O_DIRECT at open
 * (EINVAL) is read buffered; one refusing it at the first read is handled by
 * the engine. O_NOFOLLOW: a block is never a symlink (ELOOP, kept: nothing
 * outside the cache is read or removed). O_NONBLOCK: a FIFO or device at a
 * block path must not block the batch; a regular file ignores it. */
static int open_block(const load_dir *dir, const char *src, int want_direct, int *direct)
{
    const int fl = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    int at = -1;
    if (dir->fd >= 0 && src[dir->skip] != '\0') { /* under the batch's directory (batch_dir) */
        at = dir->fd;
        src += dir->skip;
    }
    *direct = 0;
    if (want_direct) {
        int fd = at >= 0 ? kvt_openat_r(at, src, fl | O_DIRECT) : kvt_open_r(src, fl | O_DIRECT, 0);
        if (fd >= 0 || errno != EINVAL) {
            *direct = fd >= 0;
            return fd;
        }
    }
    return at >= 0 ? kvt_openat_r(at, src, fl) : kvt_open_r(src, fl, 0);
}

/* What one open of a block saw (load_try), and what the previous open saw. */
enum { LT_OK = 0, LT_SHORT, LT_SIZE };
typedef struct load_look {
    int seen;  /* LT_SHORT / LT_SIZE: the previous open of this block saw it */
    int kind;  /* LT_SHORT / LT_SIZE: this open saw it first (unconfirmed) */
    int cause; /* KVT_CAUSE_*: condemned */
    int op;    /* KVT_OP_* of the failing call */
    int unverified; /* this open read the block without a CRC record: counted once loaded */
    unsigned long long size; /* the file's size when it was not the block size */
    int size_kept; /* KVT_SIZE_KEPT_*: a file of another size on two opens, kept */
} load_look;

/* A wrong size / short read: noted, the block is reopened (load_one). A wrong
 * size seen on two opens is judged by check_block_file (condemned unless a
 * record verifies the file); a short read of a file whose fstat says the
 * block size never condemns: the size is right, the bytes on disk may well
 * be (a transient fault of the filesystem, issue #24): reopened, then a miss
 * (EIO, kept). Returns EIO. */
static int sighting(load_look *lk, int kind)
{
    lk->op = KVT_OP_VERIFY;
    lk->kind = kind;
    return EIO;
}

/* The second look at a block whose record or read was not what a good block
 * gives (a failure path: the common path never stats). Returns 0 when the
 * open file is a regular file of exactly `len` bytes; EISDIR / EINVAL for a
 * directory / other non-regular file (kept: not ours to judge); EIO for a
 * regular file of another size (a sighting: condemned on the second open
 * unless its own record proves its bytes intact, a layout mismatch, or an
 * error keeps that from being known); or fstat's errno. */
static int check_block_file(int fd, size_t len, int checksum, load_look *lk)
{
    struct stat st;
    lk->op = KVT_OP_STAT;
    if (kvt_fstat_r(fd, &st) != 0)
        return errno;
    if (!S_ISREG(st.st_mode))
        return S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
    if ((uint64_t)st.st_size != (uint64_t)len) {
        lk->size = (unsigned long long)st.st_size; /* the error message says it */
        if (lk->seen != LT_SIZE)
            return sighting(lk, LT_SIZE);
        lk->op = KVT_OP_VERIFY;
        (void)checksum; /* with checksums off too: a record that verifies the file keeps it (P8) */
        int v = whole_file_verifies(fd, (uint64_t)st.st_size);
        if (v == 0)
            lk->cause = KVT_CAUSE_SIZE;
        else
            lk->size_kept = v == 1 ? KVT_SIZE_KEPT_INTACT : KVT_SIZE_KEPT_UNSURE;
        return EIO;
    }
    return 0;
}

/* A record that proves the block bad (`cause`: KVT_CAUSE_IDENTITY /
 * KVT_CAUSE_CHECKSUM) once the file itself is a regular file of `len` bytes
 * (a wrong size says EIO first): 0 with *mismatch, or check_block_file's
 * errno. */
static int record_mismatch(int fd, size_t len, int checksum, load_look *lk, int cause, int *mismatch)
{
    int e = check_block_file(fd, len, checksum, lk);
    if (e)
        return e;
    *mismatch = cause;
    return 0;
}

/* A getxattr error that is the filesystem's (EOPNOTSUPP, EIO ...), not the
 * block's: the miss is `xerr` (kept), unless the file itself says otherwise. */
static int record_error(int fd, size_t len, int checksum, load_look *lk, int xerr)
{
    int e = check_block_file(fd, len, checksum, lk);
    lk->op = e ? lk->op : KVT_OP_GETXATTR;
    return e ? e : xerr;
}

/* Whether the open file's user.vllm.kv_crc32c is well formed and equals
 * `crc` (the CRC of the bytes just read): asked when the CRC its identity
 * record carries differs, so that a damaged identity record alone (its CRC
 * bytes flipped) is not taken for damaged data (P10, issue #24): data that
 * changed match neither record. */
static int vllm_record_is(int fd, uint32_t crc)
{
    uint8_t rec[KVT_XATTR_BUF];
    uint32_t v;
    ssize_t r = kvt_fgetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec);
    return kvt_xattr_parse(rec, (long)r, r < 0 ? errno : 0, &v) == KVT_REC_OK && v == crc;
}

/* Read the records (with `checksum`) and the data of an open block. Returns
 * 0 with *mismatch = KVT_CAUSE_CHECKSUM (CRC mismatch or malformed record) /
 * KVT_CAUSE_IDENTITY (a well-formed identity record not `id`'s), 0 with
 * *mismatch = 0 when
 * good (or without CRC record: counted; a miss, ENODATA, in strict mode), or
 * an errno value (lk: the call, a sighting, a condemnation). A re-read
 * (`reread`) is buffered and checksummed by the active backend. */
static int read_verify(int fd, uint8_t *buf, size_t len, int *direct, int checksum, const uint8_t *id, int reread,
                       kvt_job_state *js, int landing, int *mismatch, load_look *lk)
{
    *mismatch = 0;
    /* Records first: a block without CRC record needs no CRC at all. The
     * identity record first: written by kvtier it carries the CRC too (one
     * xattr per load); user.vllm.kv_crc32c only without it (stored by vLLM)
     * or with a damaged one (P11), and when the CRC it carries differs from
     * the bytes (P10). */
    int have_rec = 0, from_id = 0;
    uint32_t want = 0;
    if (checksum) {
        uint8_t rec[KVT_XATTR_BUF];
        ssize_t r = kvt_fgetxattr_r(fd, KVT_ID_XATTR_NAME, rec, sizeof rec);
        int xerr = r < 0 ? errno : 0;
        switch (kvt_id_parse(rec, (long)r, xerr, id, &want)) {
        case KVT_ID_CRC:
            have_rec = from_id = 1;
            break;
        case KVT_ID_ABSENT:
        case KVT_ID_DAMAGED: /* the record itself damaged (P11): judged by user.vllm.kv_crc32c */
            break;
        case KVT_ID_MISMATCH: /* a well-formed record of another block's name or layout */
            return record_mismatch(fd, len, checksum, lk, KVT_CAUSE_IDENTITY, mismatch);
        default: /* EOPNOTSUPP, EIO, ...: not the block's fault, keep */
            return record_error(fd, len, checksum, lk, xerr);
        }
        if (!have_rec) {
            r = kvt_fgetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec);
            xerr = r < 0 ? errno : 0;
            switch (kvt_xattr_parse(rec, (long)r, xerr, &want)) {
            case KVT_REC_OK:
                have_rec = 1;
                break;
            case KVT_REC_ABSENT: /* ENODATA: stored without checksum (vLLM, a copy without xattrs) */
                if (checksum == KVT_CHECK_STRICT) {
                    int e = check_block_file(fd, len, checksum, lk); /* a wrong size says EIO first */
                    if (e)
                        return e;
                    kvt_count(KVT_C_UNVERIFIED_MISS);
                    lk->op = KVT_OP_GETXATTR;
                    return ENODATA; /* a miss, kept */
                }
                lk->unverified = 1; /* counted by load_one once the block is loaded */
                break;
            case KVT_REC_MALFORMED: /* wrong length, or longer than the buffer (ERANGE) */
                return record_mismatch(fd, len, checksum, lk, KVT_CAUSE_CHECKSUM, mismatch);
            default: /* EOPNOTSUPP, EIO, ...: not the block's fault, keep */
                return record_error(fd, len, checksum, lk, xerr);
            }
        }
    }
    if (reread && *direct && kvt_set_direct(fd, 0) == 0)
        *direct = 0; /* the re-read comes from the device through the page cache, buffered */

    int err;
    lk->op = KVT_OP_READ;
    int fits = !*direct || ((uintptr_t)buf & 4095u) == 0; /* buf fit for the read as it is */
    if (landing == KVT_LAND_DIRECT && !reread && fits && (*direct || !have_rec)) {
        /* The direct landing (block.h): straight into buf, inside one commit
         * section around the read; the size checked first (one fstat), the
         * CRC taken over buf. */
        err = check_block_file(fd, len, checksum, lk);
        if (err)
            return err;
        if (!kvt_job_commit_begin(js)) {
            lk->op = KVT_OP_NONE;
            return ETIMEDOUT; /* expired: not a byte of this block enters buf */
        }
        lk->op = KVT_OP_READ;
        uint32_t got = 0;
        err = kvt_engine_read_into(fd, buf, len, direct, have_rec, &got);
        if (!kvt_job_commit_end(js) && !err) {
            lk->op = KVT_OP_NONE;
            return ETIMEDOUT; /* the section was expired (not a load's way): not counted */
        }
        if (err == KVT_READ_SHORT)
            return sighting(lk, LT_SHORT); /* shrank after fstat (P7 next open), or a short read */
        if (err)
            return err; /* a read error is the filesystem's, not the block's */
        if (have_rec && got != want && !(from_id && vllm_record_is(fd, got)))
            *mismatch = KVT_CAUSE_CHECKSUM;
        return 0;
    }
    if (!have_rec && js == NULL && fits) {
        /* Nothing to verify, no deadline, and buf fit for the read (buffered,
         * or page aligned under O_DIRECT; else through the engine's private
         * slots below): straight into buf (one read), as vLLM does; the size
         * is checked with one fstat. */
        err = check_block_file(fd, len, checksum, lk);
        if (err)
            return err;
        lk->op = KVT_OP_READ;
        ssize_t r = kvt_read_full(fd, buf, len, 0, direct);
        if (r >= 0 && (size_t)r == len)
            return 0;
        if (r < 0)
            return errno;
        return sighting(lk, LT_SHORT); /* shrank after fstat (P7 next open), or a short read */
    }
    int move = !have_rec ? (kvt_engine_crc_copy() ? KVT_MOVE_NT : KVT_MOVE_COPY)
                         : (!reread && kvt_engine_crc_copy()) ? KVT_MOVE_FUSED : KVT_MOVE_CRC_COPY;
    uint32_t got = 0;
    err = kvt_engine_read(fd, buf, len, direct, move, js, &got);
    if (err == KVT_READ_SHORT || err == KVT_READ_LONG) {
        /* The second observation: a file of another size (or a non-file) says
         * so; a regular file of the right size that read otherwise: a short
         * read (condemned when the next open sees it again). */
        int e = check_block_file(fd, len, checksum, lk);
        if (e)
            return e;
        return sighting(lk, LT_SHORT);
    }
    if (err != 0) {
        if (err != ETIMEDOUT && err != ENOMEM) {
            load_look tmp = *lk;
            int e = check_block_file(fd, len, 0, &tmp); /* EISDIR for a directory ... */
            if (e == EISDIR || e == EINVAL) {
                lk->op = tmp.op;
                return e;
            }
        }
        lk->op = err == ETIMEDOUT ? KVT_OP_NONE : KVT_OP_READ;
        return err; /* a read error is the filesystem's, not the block's */
    }
    if (have_rec && got != want && !(from_id && vllm_record_is(fd, got)))
        *mismatch = KVT_CAUSE_CHECKSUM;
    return 0;
}

/* One open of a block: records, data (a first CRC or identity mismatch re-read
 * once, the page cache dropped), the failure path's fstat. Returns 0 or an
 * errno value with lk filled (lk->kind: a first short read / wrong size,
 * lk->cause: condemned, the file removed). */
static int load_try(const load_dir *dir, const char *src, uint8_t *buf, size_t len, int use_o_direct, int checksum,
                    const uint8_t *id, kvt_job_state *js, int landing, load_look *lk, int *retried)
{
    lk->kind = LT_OK;
    lk->cause = KVT_CAUSE_NONE;
    lk->op = KVT_OP_OPEN;
    lk->unverified = 0;
    lk->size_kept = KVT_SIZE_KEPT_NONE;
    if (!kvt_job_live(js)) {
        lk->op = KVT_OP_NONE;
        return ETIMEDOUT; /* expired before this block began */
    }
    int direct;
    int fd = open_block(dir, src, use_o_direct && len > 0 && len % 4096 == 0, &direct);
    if (fd < 0)
        return errno;

    int err = 0;
    for (int attempt = 0;; attempt++) {
        int mismatch = 0;
        err = read_verify(fd, buf, len, &direct, checksum, id, attempt > 0, js, landing, &mismatch, lk);
        if (err || !mismatch)
            break;
        if (attempt == 1) {
            lk->cause = mismatch;
            lk->op = KVT_OP_VERIFY;
            err = EBADMSG;
            break;
        }
        kvt_count(mismatch == KVT_CAUSE_IDENTITY ? KVT_C_REREAD_IDENTITY : KVT_C_REREAD_CHECKSUM);
        *retried = 1;
        posix_fadvise(fd, 0, (off_t)len, POSIX_FADV_DONTNEED); /* re-read from the device */
    }

    if (lk->cause) {
        static const int condemned[] = {0, KVT_C_CONDEMNED_CHECKSUM, KVT_C_CONDEMNED_IDENTITY,
                                        KVT_C_CONDEMNED_SIZE, KVT_C_CONDEMNED_SHORT};
        kvt_count(condemned[lk->cause]);
        unlink_if_same(src, fd);
    }
    kvt_close_r(fd); /* read-only: an error here (after a good read too) changes nothing */
    return err;
}

/* Load one block under the error policy (policy.h, docs/design.md "Error
 * policy"): a short read or wrong size reopens the block (up to three opens);
 * a wrong size on two opens condemns it unless a record verifies the file, a
 * short read never does (P6: a miss after the third); EAGAIN/ESTALE are
 * retried from the open. Returns 0, or
 * an errno value with *op, and *cause when condemned (*size: a file's size
 * other than len; *size_kept: KVT_SIZE_KEPT_* when such a file was kept,
 * EIO). *retried = 1 if re-read after a mismatch. The common path is open, fgetxattr (with checksums: the
 * identity record, which carries the CRC), the reads, close. */
static int load_one(const load_dir *dir, const char *src, uint8_t *buf, size_t len, int use_o_direct, int checksum,
                    kvt_job_state *js, int landing, int *op, int *cause, int *retried, unsigned long long *size,
                    int *size_kept)
{
    *retried = 0;
    uint8_t id[KVT_ID_LEN] = {0};
    if (checksum)
        kvt_block_identity(src, len, id);
    load_look lk = {LT_OK, LT_OK, KVT_CAUSE_NONE, KVT_OP_NONE, 0, 0, KVT_SIZE_KEPT_NONE};
    int err = 0;
    for (int transient = 0, sightings = 0;;) {
        err = load_try(dir, src, buf, len, use_o_direct, checksum, id, js, landing, &lk, retried);
        if (err == 0 || lk.cause)
            break;
        if (lk.kind != LT_OK) { /* a first short read / wrong size: reopen and look again */
            if (sightings++ >= 2) { /* short on three opens, or short / wrong size in turn: a miss, kept */
                if (lk.kind == LT_SIZE)
                    lk.size_kept = KVT_SIZE_KEPT_UNSURE;
                break;
            }
            kvt_count(lk.kind == LT_SHORT ? KVT_C_REREAD_SHORT : KVT_C_RESTAT_SIZE);
            lk.seen = lk.kind;
            continue;
        }
        if (!kvt_policy_retry(err, transient++))
            break;
    }
    if (err == 0 && lk.unverified)
        kvt_count(KVT_C_UNVERIFIED); /* once per block loaded, however often it was opened */
    *op = lk.op;
    *cause = lk.cause;
    *size = lk.size;
    *size_kept = err == EIO && !lk.cause ? lk.size_kept : KVT_SIZE_KEPT_NONE;
    return err;
}

int kvt_batch_load(const char *const *src_paths, void *const *bufs, const size_t *lens, size_t n, int use_o_direct,
                   int checksum, kvt_job_state *js, int landing, kvt_batch_result *res)
{
    batch_begin(res, n);
    load_dir dir = batch_dir(src_paths, n);
    for (size_t i = 0; i < n; i++) {
        int op = KVT_OP_NONE, cause = 0, retried = 0, size_kept = 0;
        unsigned long long size = 0;
        int e = load_one(&dir, src_paths[i], (uint8_t *)bufs[i], lens[i], use_o_direct, checksum, js, landing, &op, &cause,
                         &retried, &size, &size_kept);
        res->retried += (size_t)retried;
        if (!e && !kvt_job_block_done(js)) {
            e = ETIMEDOUT; /* whole and verified, but the job expired first: not counted */
            op = KVT_OP_NONE;
        }
        if (e) {
            set_fail(res, e, i, cause == KVT_CAUSE_CHECKSUM || cause == KVT_CAUSE_IDENTITY);
            res->op = op;
            res->condemned = cause;
            res->size_seen = size;
            res->size_expected = (unsigned long long)lens[i];
            res->size_kept = size_kept;
            break;
        }
    }
    if (dir.fd >= 0)
        close(dir.fd);
    return batch_end(res);
}

/* ------------------------------------------------------------------ */
/* Lookup                                                              */
/* ------------------------------------------------------------------ */

void kvt_batch_lookup(const char *const *paths, size_t n, uint64_t block_size, uint8_t *out)
{
    struct stat st;
    for (size_t i = 0; i < n; i++)
        out[i] = kvt_lstat_r(paths[i], &st) == 0 && S_ISREG(st.st_mode) &&
                 (block_size == 0 || (uint64_t)st.st_size == block_size);
}
