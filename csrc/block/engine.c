/* The block I/O engine (engine.h). */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "crc32c.h"
#include "env.h"
#include "policy.h"
#include "sys.h"
#include "uring.h"

static _Atomic uint64_t stat_fused_blocks, stat_fused_bytes;

/* KVTIER_CRC_COPY: 0/false/no/off turns the fused copy off (loads then
 * checksum each piece with the active backend and copy it). Read once. */
static pthread_once_t crc_copy_once = PTHREAD_ONCE_INIT;
static int crc_copy_mode;

static void crc_copy_read_env(void)
{
    crc_copy_mode = kvt_env_switch("KVTIER_CRC_COPY") != 0; /* unset, empty or unknown: on */
}

/* See engine.h: not turned off, a fused kernel for this CPU, and the active
 * CRC32C backend is the best CPU one (not forced to another, not DSA). */
int kvt_engine_crc_copy(void)
{
    pthread_once(&crc_copy_once, crc_copy_read_env);
    return crc_copy_mode && kvt_crc32c_copy_best()->fused && kvt_crc32c_active() == kvt_crc32c_best_cpu();
}

/* See engine.h. */
void kvt_crc_copy_info(kvt_crc_copy_stats *out)
{
    out->kernel = kvt_crc32c_copy_best()->name;
    out->enabled = kvt_engine_crc_copy();
    out->blocks = atomic_load(&stat_fused_blocks);
    out->bytes = atomic_load(&stat_fused_bytes);
}


/* ------------------------------------------------------------------ */
/* Private per-thread memory                                           */
/* ------------------------------------------------------------------ */

/* Two slots of KVT_SLOT bytes, KVT_SLOT aligned, asked for transparent huge
 * pages (madvise MADV_HUGEPAGE), then one KVT_SLACK page: what the last read of
 * a block reads past its end lands there or inside its slot. A slot on one
 * huge page is one segment of physical memory for the device (a 4 KiB page
 * pool is 256 per MiB, each a descriptor the virtio disk handles on its own:
 * docs/block_io.md "I/O engine"). Mapped on a thread's first O_DIRECT block,
 * unmapped when it exits. The bounce buffer of buffered loads:
 * KVT_ENGINE_CHUNK + KVT_SLACK from malloc. */
#define PRIV_BYTES (2 * (size_t)KVT_SLOT + KVT_SLACK)
#define BOUNCE_BYTES ((size_t)KVT_ENGINE_CHUNK + KVT_SLACK)

static pthread_key_t priv_key, bounce_key;
static pthread_once_t keys_once = PTHREAD_ONCE_INIT;
static int keys_ok;
static __thread uint8_t *t_priv, *t_bounce;

static void priv_free(void *p)
{
    munmap(p, PRIV_BYTES);
}

static void make_keys(void)
{
    keys_ok = pthread_key_create(&priv_key, priv_free) == 0 && pthread_key_create(&bounce_key, free) == 0;
}

/* PRIV_BYTES at a KVT_SLOT-aligned address, huge pages asked for the slots. */
static void *priv_map(void)
{
    size_t span = PRIV_BYTES + KVT_SLOT;
    uint8_t *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + KVT_SLOT - 1) & ~(uintptr_t)(KVT_SLOT - 1));
    if (p > m)
        munmap(m, (size_t)(p - m));
    if (m + span > p + PRIV_BYTES)
        munmap(p + PRIV_BYTES, (size_t)(m + span - (p + PRIV_BYTES)));
    madvise(p, 2 * (size_t)KVT_SLOT, MADV_HUGEPAGE); /* a hint: 4 KiB pages where THP is off */
    return p;
}

static uint8_t *thread_priv(void)
{
    if (t_priv == NULL) {
        pthread_once(&keys_once, make_keys);
        if (!keys_ok)
            return NULL;
        void *p = priv_map();
        if (p == NULL)
            return NULL;
        if (pthread_setspecific(priv_key, p) != 0) {
            priv_free(p);
            return NULL;
        }
        t_priv = p;
    }
    return t_priv;
}

static uint8_t *thread_bounce(void)
{
    if (t_bounce == NULL) {
        pthread_once(&keys_once, make_keys);
        void *p = NULL;
        if (!keys_ok || posix_memalign(&p, 4096, BOUNCE_BYTES) != 0)
            return NULL;
        if (pthread_setspecific(bounce_key, p) != 0) {
            free(p);
            return NULL;
        }
        t_bounce = p;
    }
    return t_bounce;
}

/* ------------------------------------------------------------------ */
/* The ring                                                            */
/* ------------------------------------------------------------------ */

/* The ring failed to submit or reap (not seen in practice: a kernel that
 * gave a ring runs it): an op may still be in flight on this thread's private
 * slots, so leave both to it (leaked) and take new ones next time. */
static void abandon(kvt_uring *ring)
{
    kvt_uring_abandon(ring);
    if (t_priv != NULL && keys_ok) {
        pthread_setspecific(priv_key, NULL);
        t_priv = NULL;
    }
}

/* The ring for an O_DIRECT block of `len` bytes: none for one piece (one
 * pread needs none); NULL, counted as a plain block, when this thread
 * has none. */
static kvt_uring *ring_for(size_t len)
{
    if (len <= KVT_PIECE_MIN)
        return NULL;
    kvt_uring *ring = kvt_uring_get();
    if (ring == NULL)
        kvt_uring_note_plain();
    return ring;
}

/* One read through the ring, submitted now. 0, or EAGAIN after
 * abandoning the ring (the caller redoes the block on the plain path). */
static int ring_start(kvt_uring *ring, int fd, uint8_t *buf, size_t n, uint64_t off)
{
    if (kvt_uring_prep(ring, fd, buf, n, off, off) != 0 || kvt_uring_submit(ring) != 0) {
        abandon(ring);
        return EAGAIN;
    }
    return 0;
}

/* Reap the one op in flight: its result (bytes or -errno) in *res. 0, or
 * EAGAIN after abandoning the ring. */
static int ring_reap(kvt_uring *ring, int *res)
{
    uint64_t tag;
    if (kvt_uring_wait(ring, &tag, res) != 0) {
        abandon(ring);
        return EAGAIN;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Loads                                                               */
/* ------------------------------------------------------------------ */

/* Move piece [off, off + n) from private memory into dst inside a commit
 * section. 0, or ETIMEDOUT when the job is no longer LIVE. */
static int commit_piece(uint8_t *dst, const uint8_t *src, size_t n, int move, kvt_job_state *js, uint32_t *crc)
{
    if (!kvt_job_commit_begin(js))
        return ETIMEDOUT; /* expired: not a byte of this piece enters dst */
    const kvt_crc32c_backend *b;
    if (move == KVT_MOVE_FUSED || move == KVT_MOVE_NT) {
        *crc = kvt_crc32c_copy(*crc, dst, src, n);
    } else if (move == KVT_MOVE_CRC_COPY && (b = kvt_crc32c_active())->copy_crc != NULL &&
               b->copy_crc(dst, src, n, crc)) {
        /* the active backend copied and checksummed the piece in one op (DSA: COPY_CRC) */
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
        ssize_t r = kvt_read_at_least(fd, priv, n, n + (last ? KVT_SLACK : 0), off, direct);
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

/* The next O_DIRECT load piece when `rest` bytes are left: half of them (a
 * page multiple, at most a slot), or all when that is at most KVT_PIECE_MIN.
 * The device reads piece k+1 while piece k is moved (the move is ~2x faster
 * than the read), and the last move, which nothing hides, is short. */
static size_t load_piece(size_t rest)
{
    if (rest <= KVT_PIECE_MIN)
        return rest;
    size_t half = (rest / 2 + 4095) & ~(size_t)4095;
    return half < KVT_SLOT ? half : KVT_SLOT;
}

/* O_DIRECT through io_uring, one read in flight: when piece k arrives, the
 * read of piece k+1 (into the other slot) is started, then piece k is moved
 * into dst. (Several reads in flight at once are merged by the block layer or
 * completed together by the device: their moves would not overlap anything.)
 * Returns 0, ETIMEDOUT, or EAGAIN: something unusual happened (an error, a
 * short or long piece, a refused O_DIRECT): the caller redoes the block on
 * the plain path, which tells them apart. A read in flight is always reaped
 * before returning (it writes a private slot). */
static int read_uring(kvt_uring *ring, int fd, uint8_t *dst, size_t len, uint8_t *priv, int move, kvt_job_state *js,
                      uint32_t *crc)
{
    size_t off = 0, n = load_piece(len);
    unsigned s = 0;
    *crc = 0;
    /* The last piece (<= KVT_PIECE_MIN) asks for KVT_SLACK more, inside its slot. */
    if (ring_start(ring, fd, priv, n + (n == len ? KVT_SLACK : 0), 0) != 0)
        return EAGAIN;
    for (;;) {
        int r;
        if (ring_reap(ring, &r) != 0)
            return EAGAIN;
        if (r < 0 || (size_t)r != n)
            return EAGAIN; /* an error, a short or long read: the plain path judges it */
        size_t next = off + n, m = next < len ? load_piece(len - next) : 0;
        if (m > 0 && ring_start(ring, fd, priv + (s ^ 1) * (size_t)KVT_SLOT, m + (next + m == len ? KVT_SLACK : 0),
                                next) != 0)
            return EAGAIN;
        int e = commit_piece(dst + off, priv + s * (size_t)KVT_SLOT, n, move, js, crc);
        if (e) {
            if (m > 0 && ring_reap(ring, &r) != 0)
                return EAGAIN;
            return e;
        }
        if (m == 0)
            return 0;
        off = next;
        n = m;
        s ^= 1;
    }
}

int kvt_engine_read(int fd, uint8_t *dst, size_t len, int *direct, int move, kvt_job_state *js, uint32_t *crc)
{
    int e;
    if (*direct) {
        uint8_t *priv = thread_priv();
        if (priv == NULL)
            return ENOMEM;
        kvt_uring *ring = ring_for(len);
        if (ring != NULL) {
            e = read_uring(ring, fd, dst, len, priv, move, js, crc);
            if (e != EAGAIN)
                goto out;
            priv = thread_priv(); /* a new one if the ring was abandoned */
            if (priv == NULL)
                return ENOMEM;
        }
        e = read_plain(fd, dst, len, priv, 2 * (size_t)KVT_SLOT, direct, move, js, crc);
    } else {
        uint8_t *bounce = thread_bounce();
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

/* See engine.h: one read of the whole block, then (crc_on) one CRC pass over
 * dst. No pieces: each is one more request for the device to start, one
 * more kick and completion interrupt (a trap to the hypervisor on a virtio
 * disk) and one more sleep and wake-up of this thread, which the process pays
 * in CPU. With nothing to move, all a later piece could hide is the CRC
 * pass, which costs the same CPU hidden or not (docs/block_io.md "Load
 * landing"). No op is ever in flight into dst when this returns. */
int kvt_engine_read_into(int fd, uint8_t *dst, size_t len, int *direct, int crc_on, uint32_t *crc)
{
    ssize_t r = kvt_read_full(fd, dst, len, 0, direct);
    if (r < 0)
        return errno ? errno : EIO;
    if ((size_t)r != len)
        return KVT_READ_SHORT;
    *crc = crc_on ? kvt_crc32c(0, dst, len) : 0;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Stores                                                              */
/* ------------------------------------------------------------------ */

int kvt_engine_write(int fd, const uint8_t *src, size_t len, int *direct, int crc_on, uint32_t *crc)
{
    /* O_DIRECT (src page aligned: block.c), or without checksum: one write of
     * the whole block straight from the caller's buffer (vLLM's one call),
     * then, with checksum, one CRC pass over the same bytes (the verified
     * floor's sequence: docs/block_io.md "O_DIRECT stores"). On both paths
     * the CRC is of the caller's bytes, which are the bytes written as long as
     * the caller leaves its buffer alone while the job is live (its contract:
     * a store reads the buffer until it returns); a buffer changed meanwhile
     * makes a block whose record fails at load: a miss, never wrong bytes. */
    if (*direct || !crc_on) {
        if (kvt_write_full(fd, src, len, 0, direct) != 0)
            return errno;
        *crc = crc_on ? kvt_crc32c(0, src, len) : 0;
        return 0;
    }
    /* Buffered with checksum: each chunk checksummed right after the kernel
     * copied it into the page cache, from the CPU cache that copy left it in
     * (~67 GB/s here; checksummed first, it is read cold from memory, ~13
     * GB/s, and the copy's cheaper hot read does not make up for it:
     * docs/block_io.md "Buffered stores"). */
    uint32_t c = 0;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < KVT_ENGINE_CHUNK ? len - off : KVT_ENGINE_CHUNK;
        if (kvt_write_full(fd, src + off, n, off, direct) != 0)
            return errno;
        c = kvt_crc32c(c, src + off, n);
        off += n;
    }
    *crc = c;
    return 0;
}
