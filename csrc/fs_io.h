/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 * On-disk contract and error table: docs/design.md ("On-disk contract").
 * Plain C11 + POSIX, no Python: the whole batch runs without the GIL.
 */
#ifndef KVTIER_FS_IO_H
#define KVTIER_FS_IO_H

#include <stddef.h>
#include <stdint.h>

#include "job_state.h"

#define KVT_XATTR_NAME "user.vllm.kv_crc32c"
#define KVT_XATTR_LEN 4

/* Bytes per read/write call; the CRC of each chunk is computed right after it
 * is read (or right before it is written) while it is in the CPU cache, or,
 * for checksummed buffered loads, folded into the copy out of the per-thread
 * bounce buffer of this size (fs_io.c "Fused copy").
 * A multiple of every O_DIRECT alignment in use (<= 4096). */
#ifndef KVT_IO_CHUNK
#define KVT_IO_CHUNK (256u * 1024u)
#endif

/* Buffered loads the fused copy does not take (no kernel for this CPU,
 * KVTIER_CRC_COPY=0, a reused destination) of at least this many bytes have
 * their CRC overlapped with the copy out of the page cache by a helper thread
 * (fs_io.c "CRC hook"; KVTIER_CRC_HELPER=0 turns it off); smaller ones are
 * checksummed inline, where the hand-off would cost more than it hides. */
/* Per-thread private buffer (page aligned): loads under a job state read
 * into it (O_DIRECT pieces of up to this size; buffered ones KVT_IO_CHUNK at
 * a time) and copy into the caller's buffer in commit sections. */
#ifndef KVT_PRIV_BYTES
#define KVT_PRIV_BYTES (2u * 1024u * 1024u)
#endif

#ifndef KVT_CRC_HELPER_MIN
#define KVT_CRC_HELPER_MIN (512u * 1024u)
#endif

/* A sleeping helper is woken only when at least this many bytes are left to
 * load in the batch: waking it costs the caller ~8 us on a VM (measured:
 * docs/block_io.md), about the CRC of 512 KiB. */
#ifndef KVT_CRC_HELPER_WAKE_MIN
#define KVT_CRC_HELPER_WAKE_MIN (2u * 1024u * 1024u)
#endif

/* How long the helper thread polls for the next piece or block before it
 * sleeps (ns; KVTIER_CRC_HELPER_POLL_US overrides): waking a sleeping thread
 * costs its waker ~8 us and itself 7 us - 1 ms on a VM (docs/block_io.md),
 * as much as the copy of a 1 MiB block. */
#ifndef KVT_CRC_HELPER_POLL_NS
#define KVT_CRC_HELPER_POLL_NS 1000000u
#endif

/* A caller whose helper is more than this many bytes behind its reads (not
 * awake yet, or descheduled) checksums the rest of the block itself, while
 * it is still in the CPU cache. */
#define KVT_CRC_HELPER_LAG (3u * KVT_IO_CHUNK)

/* The helper found itself, or a caller found it, descheduled for this long
 * (ns; a 64 KiB piece takes ~1 us; a quiet 2-vCPU VM shows gaps up to ~70 us,
 * a CPU-bound neighbour ~1-5 ms): the host has no idle core for it, and
 * loads checksum inline for KVT_CRC_HELPER_COOL_NS, doubled while it recurs
 * within a minute (up to 64x). */
#define KVT_CRC_HELPER_LATE_NS 250000u
#define KVT_CRC_HELPER_COOL_NS 1000000000u

/* O_DIRECT memory and offset alignment assumed when the kernel does not
 * report one (statx STATX_DIOALIGN, Linux >= 6.1): the page size, which is a
 * multiple of every logical block size in use. */
#define KVT_DIO_FALLBACK_ALIGN 4096u

/* Outcome of a batch. On failure: err = errno value (EBADMSG, EIO, ENOENT...),
 * index = index of the failing block (== number of blocks that succeeded),
 * checksum_failed = 1 only for a CRC mismatch or malformed xattr record
 * (never for EBADMSG returned by the filesystem itself). */
typedef struct kvt_batch_result {
    int err;              /* 0 on success */
    size_t index;         /* failing block; n on success */
    int checksum_failed;
    size_t retried;       /* loads: blocks re-read after a first checksum mismatch,
                             on failure too (the failing block included) */
} kvt_batch_result;

/* Store: for each i, skip if dest_paths[i] exists; else create tmp_paths[i]
 * (O_CREAT|O_EXCL, parents created), write lens[i] bytes of bufs[i] (O_DIRECT
 * when use_o_direct and the buffer/length meet the filesystem's alignment),
 * with `checksum` set the xattr on the open fd, close, rename onto dest.
 * Any failure removes the temp. With `durable` the temp is
 * fdatasync'ed before the rename and the parent directory fsync'ed after it,
 * so a published block survives power loss; a failure there removes the
 * temp, or the just-renamed destination if it is still our file (same
 * st_dev/st_ino as the temp: a peer's block renamed onto it meanwhile stays).
 * open, the xattr calls, rename, fsync and every read/write retry EINTR;
 * close returning EINTR counts as success (Linux releases the fd). Load: open, size must equal lens[i] (else EIO
 * and removed), read, with `checksum` verify (design.md table).
 * Both stop at the first failing block.
 * With a job state `js` (job_state.h; NULL: none): a block begins only while
 * it is LIVE; a load reads into a private per-thread buffer and copies into
 * bufs[i] only inside commit sections (LIVE -> COMMITTING -> LIVE, per
 * piece); a store renames inside one. A job no longer LIVE stops the batch
 * with ETIMEDOUT at that block (a store's temp removed, no byte of a load
 * written after the state left LIVE); index = blocks fully done.
 * Returns 0 on success, -1 on failure with *res filled. */
int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths,
                    const void *const *bufs, const size_t *lens, size_t n,
                    int use_o_direct, int checksum, int durable, kvt_job_state *js,
                    kvt_batch_result *res);
int kvt_batch_load(const char *const *src_paths, void *const *bufs,
                   const size_t *lens, size_t n, int use_o_direct, int checksum,
                   kvt_job_state *js, kvt_batch_result *res);
/* Process-wide counters since load: checksum mismatches retried (re-read
 * once) and blocks condemned (mismatch again: EBADMSG, removed). */
void kvt_checksum_stats(uint64_t *retries, uint64_t *condemned);

/* The CRC helper thread of buffered loads (fs_io.c "CRC hook"). */
typedef struct kvt_crc_helper_stats {
    int enabled;      /* KVTIER_CRC_HELPER, or auto: >= 2 CPUs in the affinity mask */
    int running;      /* the thread has been started */
    uint64_t poll_ns; /* poll window before it sleeps (ns) */
    uint64_t blocks;  /* blocks offered to it (the caller may have taken them back) */
    uint64_t bytes;   /* bytes it checksummed */
    uint64_t late;    /* back-offs (helper_back_off): descheduled, preempted, slow */
} kvt_crc_helper_stats;
void kvt_crc_helper_info(kvt_crc_helper_stats *out);

/* The fused copy path of buffered loads (fs_io.c "Fused copy"). */
typedef struct kvt_crc_copy_stats {
    const char *kernel; /* kvt_crc32c_copy_best()->name */
    int enabled;        /* KVTIER_CRC_COPY not off, a fused kernel (not "generic"), and the
                           active CRC32C backend is the best CPU one (not forced, not DSA) */
    uint64_t blocks;    /* checksummed buffered loads that went through it */
    uint64_t bytes;     /* bytes copied and checksummed by it */
    uint64_t reused;    /* checksummed buffered loads left to the regular path because their
                           destination was loaded into recently (likely cache-hot) */
} kvt_crc_copy_stats;
void kvt_crc_copy_info(kvt_crc_copy_stats *out);
/* Record a buffered load into [buf, buf + len). For a `checksummed` one,
 * return 1 if it should take the regular path because a buffered load wrote
 * an overlapping range within the last KVT_COPY_REUSE_BYTES (32 MiB) of
 * buffered loads and the last KVT_COPY_RING (256) loads (counted in
 * `reused`); 0 otherwise, always 0 while the path is off. kvt_batch_load
 * calls it; the Python fallback through kvtier._C. */
int kvt_crc_copy_dest_reused(const void *buf, size_t len, int checksummed);

/* The xattr record parser of the load path, a pure function
 * (fuzzed by tests/fuzz/fuzz_xattr_record.c). `r` is what
 * fgetxattr(fd, KVT_XATTR_NAME, rec, KVT_XATTR_BUF) returned and `err` the
 * errno when r < 0. Returns KVT_REC_OK with *crc = the big-endian 4-byte
 * value; KVT_REC_ABSENT (ENODATA: a legacy block stored without checksum);
 * KVT_REC_MALFORMED (length != 4, or ERANGE: longer than the buffer): a
 * checksum failure; KVT_REC_ERROR (any other errno: the filesystem's fault,
 * the block is kept). Reads at most min(r, KVT_XATTR_BUF) bytes of rec. */
#define KVT_XATTR_BUF 16
enum { KVT_REC_OK = 0, KVT_REC_ABSENT = 1, KVT_REC_MALFORMED = 2, KVT_REC_ERROR = 3 };
int kvt_xattr_parse(const void *rec, long r, int err, uint32_t *crc);

/* out[i] = 1 if paths[i] exists (stat succeeds), else 0. */
void kvt_batch_lookup(const char *const *paths, size_t n, uint8_t *out);

#endif
