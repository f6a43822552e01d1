/* io_uring for block I/O (liburing): several large pieces of one block in
 * flight at once, so a load checksums/copies piece k while the device fills
 * pieces k+1.. (stores are one pwrite each: engine.h).
 *
 * One ring per I/O thread (created on its first use, freed at thread exit,
 * re-created in a forked child). Mode, process-wide, fixed at first use:
 * KVTIER_IO_URING=0 never, =1 or unset: when the build has liburing
 * (KVTIER_HAVE_LIBURING) and the kernel gives a ring (io_uring_setup may be
 * refused: ENOSYS under seccomp, EPERM with kernel.io_uring_disabled);
 * otherwise the engine's plain pread/pwrite path. No Python here. */
#ifndef KVTIER_URING_H
#define KVTIER_URING_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_uring kvt_uring;

/* This thread's ring, or NULL: use the plain syscall path. */
kvt_uring *kvt_uring_get(void);

/* Queue one read of `len` bytes at file offset `off` (not submitted
 * yet); `tag` comes back with its completion. 0, or -1 when the queue is full
 * (submit and reap first). */
int kvt_uring_prep(kvt_uring *r, int fd, void *buf, size_t len, uint64_t off, uint64_t tag);
/* Submit everything queued. 0 or an errno value. */
int kvt_uring_submit(kvt_uring *r);
/* Wait for one completion: its tag and result (bytes, or -errno). 0, or an
 * errno value from the wait itself (EINTR is retried). */
int kvt_uring_wait(kvt_uring *r, uint64_t *tag, int *res);

/* Forget this thread's ring without tearing it down (a failed submit/wait
 * may leave ops in flight); the next kvt_uring_get makes a new one. */
void kvt_uring_abandon(kvt_uring *r);

/* Queue depth per ring (the engine keeps one op in flight). */
#define KVT_URING_DEPTH 2

typedef struct kvt_uring_stats {
    int built;            /* compiled with liburing */
    int setting;          /* KVTIER_IO_URING: -1 unset, 0, 1 */
    int active;           /* io_uring in use (a ring was created), 0 otherwise */
    int setup_errno;      /* why not, when the kernel refused (ENOSYS, EPERM ...) or 0 */
    uint64_t ops;         /* reads completed through rings */
    uint64_t plain;       /* blocks that took the plain syscall path */
} kvt_uring_stats;
void kvt_uring_info(kvt_uring_stats *out);
/* Count a block done with plain syscalls (for the stats). */
void kvt_uring_note_plain(void);

#endif
