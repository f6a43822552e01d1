/* io_uring rings for the block I/O engine (uring.h). */
#define _GNU_SOURCE
#include "uring.h"

#include "env.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h> /* RWF_NOWAIT */
#include <unistd.h>

static _Atomic uint64_t stat_ops, stat_plain;
static pthread_once_t mode_once = PTHREAD_ONCE_INIT;
static int setting = -1;        /* KVTIER_IO_URING */
static _Atomic int mode = -1;   /* -1 undecided, 0 plain, 1 io_uring */
static _Atomic int setup_errno; /* the kernel's refusal */

static void read_setting(void)
{
    int s = kvt_env_switch("KVTIER_IO_URING");
    /* unset or empty: -1; an off word: 0; an on word, or anything else: 1
     * (kvtier._blockio.env refuses anything else at import) */
    setting = s == KVT_ENV_UNSET ? -1 : s != 0;
}

void kvt_uring_note_plain(void)
{
    atomic_fetch_add_explicit(&stat_plain, 1, memory_order_relaxed);
}

#ifdef KVTIER_HAVE_LIBURING
#include <liburing.h>

struct kvt_uring {
    struct io_uring ring;
    unsigned queued;
    unsigned gen; /* fork_gen when it was made: another one means a forked child */
};

static pthread_key_t ring_key;
static int ring_key_ok;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static __thread kvt_uring *my_ring;

/* The fork generation: +1 in the child of every fork() (a pthread_atfork
 * handler, registered before the first ring exists; os.fork and
 * multiprocessing's fork call fork()). A ring made in another generation is
 * the parent's: not ours to use or tear down. One relaxed load per block where
 * a getpid() was one syscall per block (glibc no longer caches the pid). A
 * child made by a raw clone(2), which runs no atfork handlers, must not do
 * block I/O. */
static _Atomic unsigned fork_gen;

static void fork_child(void)
{
    atomic_fetch_add_explicit(&fork_gen, 1, memory_order_relaxed);
}

static unsigned gen_now(void)
{
    return atomic_load_explicit(&fork_gen, memory_order_relaxed);
}

static void ring_free(void *p)
{
    kvt_uring *r = p;
    if (r->gen == gen_now())
        io_uring_queue_exit(&r->ring);
    free(r);
}

static void make_key(void)
{
    ring_key_ok = pthread_key_create(&ring_key, ring_free) == 0 && pthread_atfork(NULL, NULL, fork_child) == 0;
}

static kvt_uring *ring_new(void)
{
    kvt_uring *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    int e = io_uring_queue_init(KVT_URING_DEPTH, &r->ring, 0);
    if (e < 0) {
        free(r);
        if (e != -ENOMEM) { /* the kernel says no: plain path for the process */
            atomic_store(&setup_errno, -e);
            int undecided = -1;
            atomic_compare_exchange_strong(&mode, &undecided, 0);
        }
        return NULL;
    }
    r->gen = gen_now();
    int undecided = -1;
    atomic_compare_exchange_strong(&mode, &undecided, 1);
    return r;
}

kvt_uring *kvt_uring_get(void)
{
    pthread_once(&mode_once, read_setting);
    if (setting == 0 || atomic_load_explicit(&mode, memory_order_relaxed) == 0)
        return NULL;
    kvt_uring *r = my_ring;
    if (r != NULL && r->gen == gen_now())
        return r;
    if (r != NULL) { /* a forked child: the parent's ring is not ours to use */
        my_ring = NULL;
        if (ring_key_ok)
            pthread_setspecific(ring_key, NULL);
        free(r); /* its mapping stays (the parent's); a new ring below */
    }
    pthread_once(&key_once, make_key);
    if (!ring_key_ok)
        return NULL;
    r = ring_new();
    if (r == NULL)
        return NULL;
    if (pthread_setspecific(ring_key, r) != 0) {
        ring_free(r);
        return NULL;
    }
    my_ring = r;
    return r;
}

void kvt_uring_abandon(kvt_uring *r)
{
    if (r != NULL && r == my_ring) { /* leaked on purpose: ops may be in flight */
        my_ring = NULL;
        if (ring_key_ok)
            pthread_setspecific(ring_key, NULL);
    }
}

int kvt_uring_prep(kvt_uring *r, int fd, void *buf, size_t len, uint64_t off, uint64_t tag)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (sqe == NULL)
        return -1;
    io_uring_prep_read(sqe, fd, buf, (unsigned)len, off);
    /* RWF_NOWAIT: an EAGAIN comes back in the completion (the caller redoes
     * the block on the plain path, which follows the error policy: P2/P3)
     * instead of being reissued by the kernel. Without it a filesystem that
     * answers EAGAIN (a FUSE daemon's, NFS's) is reissued in a loop that only
     * ends when the filesystem stops: 2.3 million reads in 123 s for one load
     * (issue #24). ext4 and XFS serve an O_DIRECT read without blocking:
     * RWF_NOWAIT changes nothing there. */
    sqe->rw_flags = RWF_NOWAIT;
    io_uring_sqe_set_data64(sqe, tag);
    r->queued++;
    return 0;
}

int kvt_uring_submit(kvt_uring *r)
{
    while (r->queued > 0) {
        int n = io_uring_submit(&r->ring);
        if (n == -EINTR || n == -EAGAIN)
            continue;
        if (n < 0)
            return -n;
        r->queued -= (unsigned)n < r->queued ? (unsigned)n : r->queued;
    }
    return 0;
}

int kvt_uring_wait(kvt_uring *r, uint64_t *tag, int *res)
{
    struct io_uring_cqe *cqe;
    int e;
    do
        e = io_uring_wait_cqe(&r->ring, &cqe);
    while (e == -EINTR);
    if (e < 0)
        return -e;
    *tag = io_uring_cqe_get_data64(cqe);
    *res = cqe->res;
    io_uring_cqe_seen(&r->ring, cqe);
    atomic_fetch_add_explicit(&stat_ops, 1, memory_order_relaxed);
    return 0;
}

#else /* built without liburing: always the plain path */

kvt_uring *kvt_uring_get(void)
{
    pthread_once(&mode_once, read_setting);
    atomic_store(&mode, 0);
    return NULL;
}

int kvt_uring_prep(kvt_uring *r, int fd, void *buf, size_t len, uint64_t off, uint64_t tag)
{
    (void)r, (void)fd, (void)buf, (void)len, (void)off, (void)tag;
    return -1;
}

int kvt_uring_submit(kvt_uring *r)
{
    (void)r;
    return ENOSYS;
}

void kvt_uring_abandon(kvt_uring *r)
{
    (void)r;
}

int kvt_uring_wait(kvt_uring *r, uint64_t *tag, int *res)
{
    (void)r, (void)tag, (void)res;
    return ENOSYS;
}
#endif

void kvt_uring_info(kvt_uring_stats *out)
{
    kvt_uring_get(); /* decide the mode if no I/O did yet */
#ifdef KVTIER_HAVE_LIBURING
    out->built = 1;
#else
    out->built = 0;
#endif
    out->setting = setting;
    out->active = atomic_load(&mode) == 1 && setting != 0;
    out->setup_errno = atomic_load(&setup_errno);
    out->ops = atomic_load(&stat_ops);
    out->plain = atomic_load(&stat_plain);
}
