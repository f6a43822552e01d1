/* The block I/O engine: moves one block's bytes between an open file and the
 * caller's buffer, with the CRC32C computed while the device moves the next
 * piece (io_uring, uring.h), or piece after piece (plain pread/pwrite, sys.h).
 * block.c decides what to do with a block (open, record, verify, retry,
 * publish); this file only moves bytes.
 *
 * O_DIRECT loads go through private per-thread memory: two slots of KVT_SLOT
 * bytes on transparent huge pages. A load reads piece k+1 into one slot while
 * piece k enters the caller's buffer from the other in one move (the fused
 * copy + CRC, csrc/crc32c/copy.c, where it is the verify pass), inside a
 * commit section of the job state (job_state.h). So a corrupt or late block
 * never leaves more in the caller's buffer than the pieces committed while
 * live, and the CRC is computed on private bytes nobody else can write.
 * (The direct landing reads straight into a page-aligned row instead.)
 * Buffered loads go KVT_ENGINE_CHUNK at a time through a cache-resident
 * bounce buffer. Stores write straight from the caller's buffer, O_DIRECT
 * only from a page-aligned one (block.c), one pwrite of the whole block and
 * then one CRC pass over the same bytes, the verified floor's sequence:
 * copying into the slots (fused copy + CRC, the previous store) cost
 * 1.05-1.17x the floor's CPU (docs/block_io.md "O_DIRECT stores").
 *
 * Small blocks stay on the plain calls: a 4 KiB load is one pread of the
 * block and the page past it into the bounce buffer, then one move, so with
 * block.c's open, fgetxattr and close four syscalls per block. Batching them
 * through io_uring was measured slower (the kernel hands every fgetxattr to
 * an io-wq worker): docs/block_io.md "Small blocks". */
#ifndef KVTIER_ENGINE_H
#define KVTIER_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "job_state.h"

#define KVT_SLOT (2u << 20)          /* private slot (one huge page): an O_DIRECT piece at most */
#define KVT_PIECE_MIN (256u << 10)   /* the last load piece, at most */
#define KVT_SLACK 4096u              /* read past the block's end: proves the file ends there */
#define KVT_ENGINE_CHUNK (256u * 1024u) /* buffered piece: stays in L2 for the copy */

/* How each piece moves between private memory and the caller's buffer. */
enum {
    KVT_MOVE_COPY = 0,     /* memcpy */
    KVT_MOVE_FUSED = 1,    /* the fused copy + CRC (the verify pass) */
    KVT_MOVE_CRC_COPY = 2, /* the active backend's CRC, then memcpy */
    KVT_MOVE_NT = 3,       /* the fused kernel's non-temporal copy, CRC unused: into a cold
                              buffer cheaper than memcpy's read-for-ownership */
};

/* kvt_engine_read outcomes besides 0 and errno values (all > 0). */
#define KVT_READ_SHORT (-1) /* the file ended before len bytes */
#define KVT_READ_LONG (-2)  /* the file has more than len bytes */

/* Read the open file `fd` (O_DIRECT when *direct; cleared if the filesystem
 * refuses it at the first I/O) into dst[0, len) as described above. `move`
 * says how (KVT_MOVE_*); with KVT_MOVE_FUSED / KVT_MOVE_CRC_COPY *crc is the
 * CRC32C of the bytes moved. Returns 0 (exactly len bytes and the file ends
 * there), KVT_READ_SHORT / KVT_READ_LONG, ETIMEDOUT (the job state was not
 * LIVE at a commit point: nothing more was written into dst), ENOMEM, or the
 * errno of a failed read. */
int kvt_engine_read(int fd, uint8_t *dst, size_t len, int *direct, int move, kvt_job_state *js, uint32_t *crc);

/* The direct landing (block.h KVT_LAND_DIRECT): read exactly len bytes of
 * `fd` at offset 0 straight into dst, the caller's row (O_DIRECT when
 * *direct: dst page aligned; cleared if the filesystem refuses it), with
 * *crc = their CRC32C when `crc_on` (the active backend, a pass over dst).
 * One read of the whole block (as vLLM's and the floor's), then the pass:
 * no pieces (each one more device request, kick, completion interrupt and
 * wake-up, paid in CPU: docs/block_io.md "Load landing"). No private
 * memory, no copy, no commit points: block.c holds the job's commit section
 * around the whole call, and the file's size is checked before (fstat).
 * Returns 0, KVT_READ_SHORT, or the errno of a failed read. */
int kvt_engine_read_into(int fd, uint8_t *dst, size_t len, int *direct, int crc_on, uint32_t *crc);

/* Write src[0, len) at offset 0 of `fd` (O_DIRECT when *direct: src page
 * aligned, block.c; cleared if refused); with `crc_on`, *crc = CRC32C of the
 * caller's bytes written (the active backend). O_DIRECT or checksum off: one
 * pwrite of the whole block straight from src, then one CRC pass over it;
 * buffered with checksum: KVT_ENGINE_CHUNK at a time, each chunk checksummed
 * right after the kernel copied it. No private memory, no copy. Returns 0 or
 * an errno value. */
int kvt_engine_write(int fd, const uint8_t *src, size_t len, int *direct, int crc_on, uint32_t *crc);

/* 1 when loads move with the fused copy + CRC (KVT_MOVE_FUSED):
 * KVTIER_CRC_COPY (read once) is not 0/false/no/off, the CPU has a fused
 * kernel (not "generic"), and the active CRC32C backend is the best CPU one
 * (not forced to another, not DSA). */
int kvt_engine_crc_copy(void);

/* The fused copy + CRC that moves checksummed loads into the caller's
 * buffer (csrc/crc32c/copy.c). */
typedef struct kvt_crc_copy_stats {
    const char *kernel; /* kvt_crc32c_copy_best()->name */
    int enabled;        /* KVTIER_CRC_COPY not off, a fused kernel (not "generic"), and the
                           active CRC32C backend is the best CPU one (not forced, not DSA) */
    uint64_t blocks;    /* checksummed loads that went through it */
    uint64_t bytes;     /* bytes copied and checksummed by it */
} kvt_crc_copy_stats;
void kvt_crc_copy_info(kvt_crc_copy_stats *out);

#endif
