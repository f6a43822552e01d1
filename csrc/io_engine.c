/* The block I/O engine (io_engine.h). */
#define _GNU_SOURCE
#include "io_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "uring.h"

static _Atomic uint64_t stat_fused_blocks, stat_fused_bytes;

void kvt_engine_info(kvt_engine_stats *out)
{
    out->fused_blocks = atomic_load(&stat_fused_blocks);
    out->fused_bytes = atomic_load(&stat_fused_bytes);
}

/* ------------------------------------------------------------------ */
/* Plain syscalls                                                      */
/* ------------------------------------------------------------------ */

int kvt_set_direct(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
    return fcntl(fd, F_SETFL, fl);
}

/* After a failed pread/pwrite (errno set): 1 to retry it, 0 to fail. EINTR is
 * retried; EINVAL under O_DIRECT drops O_DIRECT for the rest of the file (a
 * filesystem refusing it at the first I/O, or an unaligned tail) and retries. */
static int retry_io(int fd, int *direct)
{
    if (errno == EINTR)
        return 1;
    if (errno == EINVAL && *direct) {
        if (kvt_set_direct(fd, 0) != 0)
            return 0;
        *direct = 0;
        return 1;
    }
    return 0;
}

int kvt_write_full(int fd, const uint8_t *p, size_t len, uint64_t off, int *direct)
{
    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, (off_t)off);
        if (w < 0) {
            if (retry_io(fd, direct))
                continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        p += w;
        off += (uint64_t)w;
        len -= (size_t)w;
    }
    return 0;
}

/* pread at least `min` and at most `max` bytes at `off` (fewer only at the end
 * of the file): one call when the first read brings `min`. Returns the bytes
 * read or -1 with errno. */
static ssize_t read_at_least(int fd, uint8_t *p, size_t min, size_t max, uint64_t off, int *direct)
{
    size_t got = 0;
    while (got < min) {
        ssize_t r = pread(fd, p + got, max - got, (off_t)(off + got));
        if (r < 0) {
            if (retry_io(fd, direct))
                continue;
            return -1;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

ssize_t kvt_read_full(int fd, uint8_t *p, size_t len, uint64_t off, int *direct)
{
    return read_at_least(fd, p, len, len, off, direct);
}

/* ------------------------------------------------------------------ */
/* Private per-thread memory                                           */
/* ------------------------------------------------------------------ */

/* O_DIRECT slots: KVT_PIECES x (KVT_PIECE + KVT_SLACK), page aligned; the
 * plain path uses them as one piece of KVT_PIECES * KVT_PIECE bytes. The
 * bounce buffer of buffered loads: KVT_ENGINE_CHUNK + KVT_SLACK. Allocated on
 * a thread's first use, freed when it exits. */
#define SLOT_STRIDE ((size_t)KVT_PIECE + KVT_SLACK)
#define PRIV_BYTES (KVT_PIECES * SLOT_STRIDE)
#define BOUNCE_BYTES ((size_t)KVT_ENGINE_CHUNK + KVT_SLACK)

static pthread_key_t priv_key, bounce_key;
static pthread_once_t keys_once = PTHREAD_ONCE_INIT;
static int keys_ok;
static __thread uint8_t *t_priv, *t_bounce;

static void make_keys(void)
{
    keys_ok = pthread_key_create(&priv_key, free) == 0 && pthread_key_create(&bounce_key, free) == 0;
}

static uint8_t *thread_buf(uint8_t **slot, pthread_key_t *key, size_t size)
{
    if (*slot == NULL) {
        pthread_once(&keys_once, make_keys);
        void *p = NULL;
        if (!keys_ok || posix_memalign(&p, 4096, size) != 0)
            return NULL;
        if (pthread_setspecific(*key, p) != 0) {
            free(p);
            return NULL;
        }
        *slot = p;
    }
    return *slot;
}

/* ------------------------------------------------------------------ */
/* Loads                                                               */
/* ------------------------------------------------------------------ */

/* The ring failed to submit or reap (not seen in practice: a kernel that
 * gave a ring runs it): ops may still be in flight into this thread's private
 * slots, so leave both to them (leaked) and take new ones next time. */
static void abandon(kvt_uring *ring)
{
    kvt_uring_abandon(ring);
    if (t_priv != NULL && keys_ok) {
        pthread_setspecific(priv_key, NULL);
        t_priv = NULL;
    }
}

/* Move piece [off, off + n) from private memory into dst inside a commit
 * section. 0, or ETIMEDOUT when the job is no longer LIVE. */
static int commit_piece(uint8_t *dst, const uint8_t *src, size_t n, int move, kvt_job_state *js, uint32_t *crc)
{
    if (!kvt_job_commit_begin(js))
        return ETIMEDOUT; /* expired: not a byte of this piece enters dst */
    if (move == KVT_MOVE_FUSED || move == KVT_MOVE_NT) {
        *crc = kvt_crc32c_copy(*crc, dst, src, n);
    } else {
        if (move == KVT_MOVE_CRC_COPY)
            *crc = kvt_crc32c(*crc, src, n);
        memcpy(dst, src, n);
    }
    kvt_job_commit_end(js);
    return 0;
}

/* Serial pieces of at most `piece` bytes through `priv`; the last one asks
 * for KVT_SLACK more to see the end of the file. */
static int read_plain(int fd, uint8_t *dst, size_t len, uint8_t *priv, size_t piece, int *direct, int move,
                      kvt_job_state *js, uint32_t *crc)
{
    *crc = 0;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < piece ? len - off : piece;
        int last = off + n == len;
        /* The last piece asks for KVT_SLACK more: a regular file answers a read
         * past its end short, so one pread sees where the file ends. */
        ssize_t r = read_at_least(fd, priv, n, n + (last ? KVT_SLACK : 0), off, direct);
        if (r < 0)
            return errno ? errno : EIO;
        size_t got = (size_t)r;
        if (got < n)
            return KVT_READ_SHORT;
        if (got > n)
            return KVT_READ_LONG;
        int e = commit_piece(dst + off, priv, n, move, js, crc);
        if (e)
            return e;
        off += n;
    }
    return 0;
}

/* O_DIRECT through io_uring: up to KVT_PIECES pieces in flight; piece k is
 * moved into dst while pieces k+1.. are read. Returns 0, ETIMEDOUT,
 * KVT_READ_SHORT / KVT_READ_LONG (the last piece), or EAGAIN: something
 * unusual happened (an error, a short piece, a refused O_DIRECT): the caller
 * redoes the block on the plain path, which tells them apart. In-flight
 * reads are always reaped before returning (they write the private slots). */
static int read_uring(kvt_uring *ring, int fd, uint8_t *dst, size_t len, uint8_t *priv, int move, kvt_job_state *js,
                      uint32_t *crc)
{
    /* Pieces of a quarter of the block (page multiples, 64 KiB - 1 MiB): even a
     * small block has its move overlapped with the reads of the rest. */
    size_t piece = ((len / KVT_PIECES) + 4095) & ~(size_t)4095;
    piece = piece < KVT_PIECE_MIN ? KVT_PIECE_MIN : piece > KVT_PIECE ? KVT_PIECE : piece;
    size_t np = (len + piece - 1) / piece;
    int res[KVT_PIECES], done[KVT_PIECES] = {0};
    size_t next = 0, inflight = 0;
    int err = 0;
    *crc = 0;
#define PIECE_LEN(k) ((k) + 1 == np ? len - (k) * piece : piece)
    for (; next < np && next < KVT_PIECES; next++, inflight++) {
        size_t n = PIECE_LEN(next) + (next + 1 == np ? KVT_SLACK : 0);
        kvt_uring_prep(ring, 0, fd, priv + (next % KVT_PIECES) * SLOT_STRIDE, n, next * (uint64_t)piece, next);
    }
    if (kvt_uring_submit(ring) != 0) {
        abandon(ring);
        return EAGAIN;
    }
    for (size_t k = 0; k < np; k++) {
        unsigned s = (unsigned)(k % KVT_PIECES);
        while (!done[s]) {
            uint64_t tag;
            int r;
            if (kvt_uring_wait(ring, &tag, &r) != 0) {
                abandon(ring);
                return EAGAIN;
            }
            done[tag % KVT_PIECES] = 1;
            res[tag % KVT_PIECES] = r;
            inflight--;
        }
        done[s] = 0;
        size_t n = PIECE_LEN(k);
        if (res[s] < 0 || (size_t)res[s] != n) {
            err = EAGAIN; /* an error, a short or long read: the plain path judges it */
            goto drain;
        }
        err = commit_piece(dst + k * piece, priv + s * SLOT_STRIDE, n, move, js, crc);
        if (err)
            goto drain;
        if (next < np) {
            size_t m = PIECE_LEN(next) + (next + 1 == np ? KVT_SLACK : 0);
            kvt_uring_prep(ring, 0, fd, priv + (next % KVT_PIECES) * SLOT_STRIDE, m, next * (uint64_t)piece, next);
            if (kvt_uring_submit(ring) != 0) {
                abandon(ring);
                return EAGAIN;
            }
            next++;
            inflight++;
        }
    }
#undef PIECE_LEN
    return 0;
drain:
    while (inflight > 0) {
        uint64_t tag;
        int r;
        if (kvt_uring_wait(ring, &tag, &r) != 0) {
            abandon(ring);
            break;
        }
        inflight--;
    }
    return err;
}

int kvt_engine_read(int fd, uint8_t *dst, size_t len, int *direct, int move, kvt_job_state *js, uint32_t *crc)
{
    int e;
    if (*direct) {
        uint8_t *priv = thread_buf(&t_priv, &priv_key, PRIV_BYTES);
        if (priv == NULL)
            return ENOMEM;
        kvt_uring *ring = len > KVT_PIECE_MIN ? kvt_uring_get() : NULL;
        if (ring != NULL) {
            e = read_uring(ring, fd, dst, len, priv, move, js, crc);
            if (e != EAGAIN)
                goto out;
        } else {
            kvt_uring_note_plain();
        }
        e = read_plain(fd, dst, len, priv, (size_t)KVT_PIECES * KVT_PIECE, direct, move, js, crc);
    } else {
        uint8_t *bounce = thread_buf(&t_bounce, &bounce_key, BOUNCE_BYTES);
        if (bounce == NULL)
            return ENOMEM;
        e = read_plain(fd, dst, len, bounce, KVT_ENGINE_CHUNK, direct, move, js, crc);
    }
out:
    if (e == 0 && move == KVT_MOVE_FUSED) {
        atomic_fetch_add_explicit(&stat_fused_blocks, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&stat_fused_bytes, len, memory_order_relaxed);
    }
    return e;
}

/* ------------------------------------------------------------------ */
/* Stores                                                              */
/* ------------------------------------------------------------------ */

/* O_DIRECT through io_uring: the whole block goes out in up to
 * KVT_URING_DEPTH writes, and the CRC is computed here while the device
 * reads the buffer. 0, or EAGAIN (redo on the plain path). */
static int write_uring(kvt_uring *ring, int fd, const uint8_t *src, size_t len, int checksum, uint32_t *crc)
{
    size_t piece = (len + KVT_URING_DEPTH - 1) / KVT_URING_DEPTH;
    piece = (piece + 4095) & ~(size_t)4095;
    if (piece < 4u * KVT_PIECE)
        piece = 4u * KVT_PIECE;
    if (piece > (1u << 30))
        return EAGAIN; /* > 8 GiB blocks: plain path */
    size_t np = (len + piece - 1) / piece, inflight = 0;
    for (size_t k = 0; k < np; k++) {
        size_t n = k + 1 == np ? len - k * piece : piece;
        kvt_uring_prep(ring, 1, fd, (void *)(src + k * piece), n, k * (uint64_t)piece, k);
    }
    if (kvt_uring_submit(ring) != 0) {
        abandon(ring); /* writes may be out: they land in the temp, which the store removes */
        return EIO;
    }
    inflight = np;
    if (checksum)
        *crc = kvt_crc32c(0, src, len);
    int err = 0;
    while (inflight > 0) {
        uint64_t tag;
        int r;
        if (kvt_uring_wait(ring, &tag, &r) != 0) {
            abandon(ring);
            return EIO;
        }
        inflight--;
        size_t n = tag + 1 == np ? len - tag * piece : piece;
        if (r < 0 || (size_t)r != n)
            err = EAGAIN;
    }
    return err;
}

int kvt_engine_write(int fd, const uint8_t *src, size_t len, int *direct, int checksum, uint32_t *crc)
{
    if (*direct) {
        kvt_uring *ring = kvt_uring_get();
        if (ring != NULL) {
            int e = write_uring(ring, fd, src, len, checksum, crc);
            if (e != EAGAIN)
                return e; /* 0, or EIO: the ring broke with writes out (not retried: they may land late) */
        }
        if (ring == NULL)
            kvt_uring_note_plain();
        /* plain: CRC of the block, then one write (nothing to overlap it with) */
        if (checksum)
            *crc = kvt_crc32c(0, src, len);
        return kvt_write_full(fd, src, len, 0, direct) == 0 ? 0 : errno;
    }
    /* Buffered: each chunk checksummed just before the kernel copies it, while
     * it is in the CPU cache. */
    uint32_t c = 0;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < KVT_ENGINE_CHUNK ? len - off : KVT_ENGINE_CHUNK;
        if (checksum)
            c = kvt_crc32c(c, src + off, n);
        if (kvt_write_full(fd, src + off, n, off, direct) != 0)
            return errno;
        off += n;
    }
    if (checksum)
        *crc = c;
    return 0;
}
