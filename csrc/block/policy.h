/* kvtier error and verification policy of block I/O: what is retried, what
 * is a miss that keeps the file, what condemns a block (docs/design.md
 * "Error policy", the table; kvtier/fallback.py implements the same rows).
 * Plain C11, no Python.
 *
 * A block is condemned (its file removed) only on proof: a CRC or identity
 * mismatch seen on two reads (the second after dropping the page cache), a
 * size other than the block size on two opens (unless a record verifies the
 * file). A short read of a file whose size is right never condemns (P6).
 * Every other error is a miss that keeps the file, after the retries below.
 */
#ifndef KVT_POLICY_H
#define KVT_POLICY_H

#include <stddef.h>
#include <stdint.h>

/* Checksum modes (the `checksum` argument of kvt_batch_load/store). */
enum { KVT_CHECK_OFF = 0, KVT_CHECK_ON = 1, KVT_CHECK_STRICT = 2 };

/* EAGAIN/EWOULDBLOCK and ESTALE (NFS/FUSE: a handle gone stale, a server
 * busy): the whole block is retried from its open, up to this many times,
 * after 1 ms, 2 ms, 4 ms. EINTR is retried at once, in place, up to
 * KVT_RETRY_EINTR_MAX times in a row (a signal interrupts a call, it does
 * not fail it; only an endless stream ends the retries: a miss, kept). */
#define KVT_RETRY_EINTR_MAX 100
#define KVT_RETRY_TRANSIENT 3
#define KVT_RETRY_BACKOFF_US 1000u

/* A store's temp open that answers ENOENT although its parent directories were
 * just made (a shared filesystem's name cache: a GlusterFS client answers
 * ENOENT for about a second in a directory another client made meanwhile): the
 * parents are made again and the open retried up to this many times, after
 * 2 ms, 4 ms ... 512 ms (about 1 s in all). */
#define KVT_RETRY_ENOENT_STORE 9

/* Per-call counters; names in KVT_COUNT_NAMES, same order (kvtier/_blockio/policy.py
 * COUNT_NAMES mirrors them). */
enum {
    KVT_C_UNVERIFIED = 0,   /* loaded without a CRC record (checksum on) */
    KVT_C_UNVERIFIED_MISS,  /* no CRC record in strict mode: a miss, kept */
    KVT_C_REREAD_CHECKSUM,  /* re-read after a first CRC mismatch */
    KVT_C_REREAD_IDENTITY,  /* re-read after a first identity mismatch */
    KVT_C_REREAD_SHORT,     /* reopened after a first short read */
    KVT_C_RESTAT_SIZE,      /* reopened after a first wrong size */
    KVT_C_CONDEMNED_CHECKSUM,
    KVT_C_CONDEMNED_IDENTITY,
    KVT_C_CONDEMNED_SIZE,
    KVT_C_CONDEMNED_SHORT,
    KVT_C_RETRY_EINTR,
    KVT_C_RETRY_EAGAIN,
    KVT_C_RETRY_ESTALE,
    KVT_C_DURABLE_EXISTING, /* existing block made durable by a durable store */
    KVT_C_REPLACED,         /* store replaced a non-block (symlink, FIFO, wrong size) */
    KVT_C_EXISTING,         /* store skipped: the block was already there (no bytes written) */
    KVT_C_BUFFERED_UNALIGNED, /* store without checksum written buffered: O_DIRECT asked, buffer not page aligned */
    KVT_NCOUNTS
};
#define KVT_COUNT_NAMES                                                                                          \
    {"unverified", "unverified_miss", "reread_checksum", "reread_identity", "reread_short", "restat_size",      \
     "condemned_checksum", "condemned_identity", "condemned_size", "condemned_short", "retry_eintr",             \
     "retry_eagain", "retry_estale", "durable_existing", "replaced", "existing", "buffered_unaligned"}

typedef struct kvt_counts {
    uint64_t v[KVT_NCOUNTS];
} kvt_counts;

/* Operation of a failing call (kvt_batch_result.op; names KVT_OP_NAMES). */
enum {
    KVT_OP_NONE = 0,
    KVT_OP_OPEN,
    KVT_OP_STAT,
    KVT_OP_READ,
    KVT_OP_GETXATTR,
    KVT_OP_VERIFY, /* the block's bytes / size / record judged bad */
    KVT_OP_MKDIR,
    KVT_OP_WRITE,
    KVT_OP_SETXATTR,
    KVT_OP_SYNC,
    KVT_OP_CLOSE,
    KVT_OP_RENAME,
    KVT_NOPS
};
#define KVT_OP_NAMES                                                                                             \
    {"", "open", "stat", "read", "getxattr", "verify", "mkdir", "write", "setxattr", "sync", "close", "rename"}

/* Cause of a condemnation (kvt_batch_result.condemned). */
enum { KVT_CAUSE_NONE = 0, KVT_CAUSE_CHECKSUM, KVT_CAUSE_IDENTITY, KVT_CAUSE_SIZE, KVT_CAUSE_SHORT };
#define KVT_CAUSE_NAMES {"", "checksum", "identity", "size", "short_read"}

/* Why a file of another size than the block size was kept, not condemned
 * (kvt_batch_result.size_kept: the OSError's message says it). */
enum {
    KVT_SIZE_KEPT_NONE = 0,
    KVT_SIZE_KEPT_INTACT, /* its own CRC record verifies all its bytes: another block size asked for (P8) */
    KVT_SIZE_KEPT_UNSURE, /* not confirmed: an error while checking its record (P9), or the size changed
                             between opens */
};

/* The counters of the batch running on this thread (set by kvt_batch_*;
 * NULL outside one): the EINTR wrappers count into it. */
extern __thread kvt_counts *kvt_tl_counts;

static inline void kvt_count(int which)
{
    if (kvt_tl_counts)
        kvt_tl_counts->v[which]++;
}

/* 1 if `err` is retried from the block's open (EAGAIN, EWOULDBLOCK, ESTALE)
 * and `attempt` (0-based) < KVT_RETRY_TRANSIENT: then counts it and sleeps
 * the backoff. 0 otherwise. */
int kvt_policy_retry(int err, int attempt);

/* Process-wide sums of every batch's counters since load. */
void kvt_policy_totals(kvt_counts *out);
void kvt_policy_add_totals(const kvt_counts *c);

#endif
