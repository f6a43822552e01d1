/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 * On-disk contract and error table: docs/design.md ("On-disk contract").
 * Plain C11 + POSIX, no Python: the whole batch runs without the GIL.
 */
#ifndef KVTIER_BLOCK_H
#define KVTIER_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "job_state.h"
#include "policy.h"  /* error policy, counters */
#include "records.h" /* the xattr records, identity */

/* Outcome of a batch. On failure: err = errno value (EBADMSG, EIO, ENOENT...),
 * index = index of the failing block (== number of blocks that succeeded),
 * checksum_failed = 1 only for a CRC mismatch or malformed xattr record
 * (never for EBADMSG returned by the filesystem itself). */
typedef struct kvt_batch_result {
    int err;              /* 0 on success */
    size_t index;         /* failing block; n on success */
    int checksum_failed;
    size_t retried;       /* loads: blocks re-read after a first checksum (or identity)
                             mismatch, on failure too (the failing block included) */
    int op;               /* KVT_OP_* of the failing call (policy.h) */
    int condemned;        /* KVT_CAUSE_* when the failing block was condemned (removed) */
    unsigned long long size_seen; /* condemned KVT_CAUSE_SIZE or size_kept: the file's size (bytes) */
    unsigned long long size_expected; /* loads: the block size asked for (bytes) */
    int size_kept;        /* KVT_SIZE_KEPT_*: a file of another size, kept (policy.h) */
    kvt_counts counts;    /* this batch's policy counters (policy.h), on failure too */
} kvt_batch_result;

/* Store: for each i, skip if dest_paths[i] is a regular file of lens[i]
 * bytes (with `durable`, fsync it and its directory first); a directory
 * there fails the block (EISDIR); anything else there (symlink, FIFO, a file
 * of another size) is replaced. Else create tmp_paths[i] (O_CREAT|O_EXCL,
 * parents created), write lens[i] bytes of bufs[i] (O_DIRECT when
 * use_o_direct and the buffer address and length are multiples of 4096),
 * with `checksum` (KVT_CHECK_*) set the CRC xattr and the identity xattr
 * (policy.h) on the open fd, close, rename onto dest. Any failure removes
 * the temp. With `durable` the temp is fdatasync'ed before the rename and the
 * parent directory fsync'ed after it, so a published block survives power
 * loss; a failed directory fsync fails the store but never removes the
 * published block (another job may have reported it stored). Load: open
 * (O_DIRECT when use_o_direct and lens[i] is a multiple of 4096), read; the
 * file must hold exactly lens[i] bytes; with `checksum` verify the CRC and,
 * when present, the identity record (KVT_CHECK_STRICT: a block without CRC
 * record is ENODATA, kept). What is retried, kept or condemned: the error
 * policy (policy.h, docs/design.md "Error policy"). Checksummed loads and
 * loads under a job state go through private memory (engine.h).
 * Both stop at the first failing block.
 * With a job state `js` (job_state.h; NULL: none): a block begins only while
 * it is LIVE; a load reads into a private per-thread buffer and copies into
 * bufs[i] only inside commit sections (LIVE -> COMMITTING -> LIVE, per
 * piece); a store renames inside one. A job no longer LIVE stops the batch
 * with ETIMEDOUT at that block (a store's temp removed, no byte of a load
 * written after the state left LIVE); index = blocks fully done.
 * `landing` (loads, KVT_LAND_*): where a load's bytes land. KVT_LAND_BOUNCE,
 * as above. KVT_LAND_DIRECT: an O_DIRECT block into a page-aligned buffer,
 * and an unchecksummed buffered block, are read straight into bufs[i]
 * (checksummed there: one CRC pass, no copy), the whole read inside one
 * commit section, so a job expired meanwhile is reported only once the read
 * returned (JobState.expire waits for a load's section): for filesystems
 * whose I/O the kernel bounds (a local disk, tmpfs), never for one where a
 * read can hang (FUSE, NFS ...: the tier chooses, kvtier/_tier/landing.py). A
 * re-read after a mismatch and a checksummed buffered block go through the
 * private buffer in both (buffered: measured cheaper, docs/block_io.md).
 * Returns 0 on success, -1 on failure with *res filled. */
enum { KVT_LAND_BOUNCE = 0, KVT_LAND_DIRECT = 1 };
int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths,
                    const void *const *bufs, const size_t *lens, size_t n,
                    int use_o_direct, int checksum, int durable, kvt_job_state *js,
                    kvt_batch_result *res);
int kvt_batch_load(const char *const *src_paths, void *const *bufs,
                   const size_t *lens, size_t n, int use_o_direct, int checksum,
                   kvt_job_state *js, int landing, kvt_batch_result *res);
/* Process-wide counters since load: checksum mismatches retried (re-read
 * once) and blocks condemned (mismatch again: EBADMSG, removed). */
void kvt_checksum_stats(uint64_t *retries, uint64_t *condemned);

/* out[i] = 1 if paths[i] is a regular file (lstat: a symlink is not) of
 * block_size bytes (any size when block_size == 0), else 0. */
void kvt_batch_lookup(const char *const *paths, size_t n, uint64_t block_size, uint8_t *out);

#endif
