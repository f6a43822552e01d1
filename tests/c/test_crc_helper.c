/* Stress test of the CRC helper thread of checksummed buffered loads
 * (csrc/fs_io.c "CRC hook": crc_begin/crc_ready/crc_settle, the claims and
 * done words, helper_wait's poll-then-sleep, the cooldown) and of the lazily
 * filled combine table (csrc/crc32c/combine.c), linked directly with
 * csrc/fs_io.c and the sources of csrc/crc32c and csrc/dsa.
 *
 * Built and run by tests/test_crc_helper.py (normally and under
 * ThreadSanitizer). Prints "N passed, N failed" and exits non-zero on any
 * failure; a watchdog turns a hang into exit status 3.
 *
 *   test_crc_helper [--poll0] [--off] [--warm] [--accounting] [--fork]
 *                   [--iters N] [--backend NAME] [--dir DIR]
 *
 * Default: first use from 4 threads at once, then 4 threads loading
 * (single-block and multi-block batches, bytes compared, corrupt copies),
 * then bit flips at piece edges; at the end the helper must have shared
 * blocks, and bytes unless it backed off (late).
 *   --poll0   KVTIER_CRC_HELPER_POLL_US=0: the helper sleeps whenever it has
 *             no ready piece and every piece must wake it (condvar path)
 *   --off     KVTIER_CRC_HELPER=0: the helper must never be used
 *   --warm    one load on the main thread before the worker threads start
 *             (otherwise the first loads of the process run concurrently)
 *   --accounting  instead, single-threaded in a fresh process: exact
 *             helper counters per load (which blocks it takes: sizes,
 *             O_DIRECT, stores, unchecksummed) and the wake-up policy
 *   --fork    instead, in a fresh process: fork children while a thread
 *             loads; each child loads, detects a bit flip and must start
 *             its own helper (not under TSan)
 *   --backend CRC32C backend for kvt_crc32c_select ("sse42", "table",
 *             "isal"; default: the best one)
 * The environment is read once per process, hence the separate invocations.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "fs_io.h"

#define KIB ((size_t)1024)
#define MIB (KIB * KIB)
#define PIECE (64 * KIB) /* KVT_CRC_PIECE in fs_io.c */
#define NTHREADS 4

static atomic_int n_pass, n_fail;

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (cond) {                                                              \
            atomic_fetch_add(&n_pass, 1);                                        \
        } else {                                                                 \
            if (atomic_fetch_add(&n_fail, 1) < 40) {                             \
                fprintf(stderr, "FAIL %s:%d: %s: ", __func__, __LINE__, #cond);  \
                fprintf(stderr, __VA_ARGS__);                                    \
                fputc('\n', stderr);                                             \
            }                                                                    \
        }                                                                        \
    } while (0)

/* ------------------------------------------------------------------ */
/* Blocks                                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    size_t len;
    uint8_t *data;
    uint32_t crc; /* slice8 (not the dispatched backend): an independent oracle */
    char path[PATH_MAX];
} blk;

/* Piece edge cases: below the helper threshold, exactly at it, whole pieces,
 * a short last piece (65529 bytes), a 1-byte last piece, many pieces. */
static const size_t SIZES[] = {512 * KIB - 1, 512 * KIB, 1 * MIB, 3 * MIB - 7, 4 * MIB + 1, 16 * MIB};
#define NB (sizeof SIZES / sizeof SIZES[0])
enum { B_SMALL = 0, B_512K, B_1M, B_3M, B_4M1, B_16M };

static blk blocks[NB];
static char dir[1024]; /* short enough for every path built under it */
static int opt_iters = 4, opt_poll0, opt_off, opt_warm, opt_accounting, opt_fork;
/* bytes of checksummed buffered loads (each re-read counted): the helper's bytes are a part */
static _Atomic unsigned long long eligible_bytes;

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void fill_random(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = xorshift(&s);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)xorshift(&s);
}

static void *xmalloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 1) != 0) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int store_one(const char *path, const void *buf, size_t len, int direct)
{
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    const char *tp = tmp, *dp = path;
    kvt_batch_result res;
    int rc = kvt_batch_store(&tp, &dp, &buf, &len, 1, direct, 1, 0, NULL, &res);
    CHECK(rc == 0, "store %s: err %d", path, res.err);
    return rc;
}

static uint32_t xattr_crc(const char *path)
{
    uint8_t rec[8];
    ssize_t r = getxattr(path, KVT_XATTR_NAME, rec, sizeof rec);
    CHECK(r == 4, "xattr of %s: %zd (errno %d)", path, r, errno);
    if (r != 4)
        return 0;
    return ((uint32_t)rec[0] << 24) | ((uint32_t)rec[1] << 16) | ((uint32_t)rec[2] << 8) | rec[3];
}

static int exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static void flip_bit(const char *path, size_t pos, uint8_t mask)
{
    int fd = open(path, O_RDWR);
    uint8_t b = 0;
    CHECK(fd >= 0 && pread(fd, &b, 1, (off_t)pos) == 1, "read byte %zu of %s", pos, path);
    b ^= mask;
    CHECK(fd >= 0 && pwrite(fd, &b, 1, (off_t)pos) == 1, "write byte %zu of %s", pos, path);
    if (fd >= 0)
        close(fd);
}

static void info(kvt_crc_helper_stats *s)
{
    memset(s, 0, sizeof *s);
    kvt_crc_helper_info(s);
}

/* ------------------------------------------------------------------ */
/* Load + verify                                                       */
/* ------------------------------------------------------------------ */

/* Load blocks idx[0..n) buffered with checksum into bufs (poisoned first)
 * and compare every byte. */
static void load_verify(const int *idx, size_t n, uint8_t **bufs, uint8_t poison, const char *what)
{
    const char *paths[NB];
    void *outs[NB];
    size_t lens[NB];
    for (size_t i = 0; i < n; i++) {
        paths[i] = blocks[idx[i]].path;
        outs[i] = bufs[idx[i]];
        lens[i] = blocks[idx[i]].len;
        memset(bufs[idx[i]], poison, lens[i]);
    }
    kvt_batch_result res;
    int rc = kvt_batch_load(paths, outs, lens, n, 0, 1, NULL, &res);
    for (size_t i = 0; i < n; i++)
        atomic_fetch_add(&eligible_bytes, lens[i]);
    CHECK(rc == 0 && res.err == 0 && res.index == n && res.retried == 0,
          "%s: load of %zu blocks: rc %d err %d index %zu retried %zu", what, n, rc, res.err, res.index, res.retried);
    for (size_t i = 0; i < n; i++)
        CHECK(memcmp(outs[i], blocks[idx[i]].data, lens[i]) == 0, "%s: bytes of block %zu (%zu B) differ", what,
              i, lens[i]);
}

/* A copy of block b with one bit flipped at pos, loaded after `good` in one
 * batch: EBADMSG at index 1, checksum_failed, retried once, copy removed,
 * the good block's bytes intact. */
static void corrupt_case(int b, size_t pos, const char *tag, uint8_t *goodbuf, uint8_t *badbuf, int good)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/bad_%s_%zu_%zu.bin", dir, tag, blocks[b].len, pos);
    if (store_one(path, blocks[b].data, blocks[b].len, 0) != 0)
        return;
    CHECK(xattr_crc(path) == blocks[b].crc, "stored record of %s", path);
    flip_bit(path, pos, (uint8_t)(1u << (pos % 8)));
    const char *paths[2];
    void *outs[2];
    size_t lens[2];
    size_t n = 0;
    if (good >= 0) {
        paths[n] = blocks[good].path;
        outs[n] = goodbuf;
        lens[n++] = blocks[good].len;
    }
    paths[n] = path;
    outs[n] = badbuf;
    lens[n++] = blocks[b].len;
    kvt_batch_result res;
    memset(&res, 0x5a, sizeof res);
    int rc = kvt_batch_load(paths, outs, lens, n, 0, 1, NULL, &res);
    atomic_fetch_add(&eligible_bytes, (good >= 0 ? blocks[good].len : 0) + 2 * blocks[b].len);
    CHECK(rc == -1 && res.err == EBADMSG && res.checksum_failed == 1 && res.index == n - 1 && res.retried == 1,
          "%s: bit flip at %zu of %zu B: rc %d err %d cf %d index %zu retried %zu", tag, pos, blocks[b].len, rc,
          res.err, res.checksum_failed, res.index, res.retried);
    CHECK(!exists(path), "%s: condemned copy %s still exists", tag, path);
    if (good >= 0)
        CHECK(memcmp(goodbuf, blocks[good].data, blocks[good].len) == 0, "%s: good block before the bad one", tag);
    unlink(path);
}

/* ------------------------------------------------------------------ */
/* Phases                                                              */
/* ------------------------------------------------------------------ */

/* Two barrier objects: ThreadSanitizer models a barrier as one sync object,
 * so a thread still waking from a first wait on it would acquire what another
 * thread released at a second wait on the same object, hiding a race. */
static pthread_barrier_t barrier, barrier2;

/* First use from NTHREADS threads at once: the combine table is filled
 * lazily, the helper configuration read and the thread started on demand. */
static void *cold_worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    size_t n = 200 * KIB + (size_t)t * 4099;
    uint8_t *buf = xmalloc(n);
    fill_random(buf, n, 1000 + (uint64_t)t);
    uint32_t whole = kvt_crc32c_slice8(0, buf, n);
    pthread_barrier_wait(&barrier);
    /* Even threads: the configuration (environment) is read on first use, here
     * by two status calls at once. Odd threads: the combine table is filled
     * on first use, by two threads at once. The second barrier keeps each
     * pair's accesses adjacent, so that ThreadSanitizer still holds both in
     * its shadow memory when it checks them. */
    const size_t splits[] = {0, 1, 7, 4096, PIECE - 1, PIECE, PIECE + 1, n / 2, n - 1, n};
    for (int round = 0; round < 2; round++) {
        if (round == 0 && t % 2 == 0) {
            kvt_crc_helper_stats s;
            info(&s);
            CHECK(s.enabled == !opt_off, "enabled %d (first use)", s.enabled);
        } else {
            for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
                size_t s = splits[k];
                uint32_t a = kvt_crc32c_slice8(0, buf, s), b = kvt_crc32c_slice8(0, buf + s, n - s);
                CHECK(kvt_crc32c_combine(a, b, n - s) == whole, "combine split %zu of %zu", s, n);
            }
        }
        if (round == 0)
            pthread_barrier_wait(&barrier2);
    }
    /* First loads at once: the helper is started by whichever comes first. */
    uint8_t *outs[NB] = {0};
    outs[B_16M] = xmalloc(blocks[B_16M].len);
    outs[B_4M1] = xmalloc(blocks[B_4M1].len);
    int idx[2] = {t % 2 ? B_16M : B_4M1, t % 2 ? B_4M1 : B_16M};
    load_verify(idx, 1, outs, 0xee, "cold single");
    kvt_crc_helper_stats s;
    info(&s);
    CHECK(s.enabled == !opt_off, "enabled %d", s.enabled);
    load_verify(idx, 2, outs, 0x11, "cold batch");
    free(outs[B_16M]);
    free(outs[B_4M1]);
    free(buf);
    return NULL;
}

static const size_t CORRUPT_AT_4M1[] = {0, PIECE - 1, PIECE, PIECE + 1, 2 * MIB, 4 * MIB};

/* NTHREADS threads, each with its own buffers: single-block and multi-block
 * batches in varying orders, bytes compared; a corrupt copy now and then. */
static void *stress_worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    uint8_t *bufs[NB];
    for (size_t i = 0; i < NB; i++)
        bufs[i] = xmalloc(blocks[i].len);
    uint8_t *badbuf = xmalloc(blocks[B_4M1].len);
    pthread_barrier_wait(&barrier);
    for (int it = 0; it < opt_iters; it++) {
        for (size_t k = 0; k < NB; k++) {
            int i = (int)((k + (size_t)t + (size_t)it) % NB);
            load_verify(&i, 1, bufs, (uint8_t)(0xa5 ^ t ^ it), "single");
        }
        int idx[NB];
        for (size_t k = 0; k < NB; k++) /* rotated, reversed on odd iterations */
            idx[k] = (int)(it % 2 ? (NB - 1 - (k + (size_t)t) % NB) : (k + (size_t)t + (size_t)it) % NB);
        load_verify(idx, NB, bufs, (uint8_t)(0x3c ^ t), "batch");
        int pair[2] = {B_1M, B_16M};
        load_verify(pair, 2, bufs, 0x77, "pair");
        if ((it + t) % 2 == 0) {
            char tag[32];
            snprintf(tag, sizeof tag, "t%d_i%d", t, it);
            size_t np = sizeof CORRUPT_AT_4M1 / sizeof CORRUPT_AT_4M1[0];
            corrupt_case(B_4M1, CORRUPT_AT_4M1[(size_t)(t + it) % np], tag, bufs[B_1M], badbuf, B_1M);
        }
    }
    for (size_t i = 0; i < NB; i++)
        free(bufs[i]);
    free(badbuf);
    return NULL;
}

static void run_threads(void *(*fn)(void *))
{
    pthread_t th[NTHREADS];
    pthread_barrier_init(&barrier, NULL, NTHREADS);
    pthread_barrier_init(&barrier2, NULL, NTHREADS);
    for (int t = 0; t < NTHREADS; t++)
        if (pthread_create(&th[t], NULL, fn, (void *)(intptr_t)t) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            exit(2);
        }
    for (int t = 0; t < NTHREADS; t++)
        pthread_join(th[t], NULL);
    pthread_barrier_destroy(&barrier);
    pthread_barrier_destroy(&barrier2);
}

/* Bit flips at the first byte, around 64 KiB piece boundaries, in the
 * middle and at the last byte, of blocks taken by the helper. */
static void phase_corrupt(void)
{
    uint8_t *goodbuf = xmalloc(blocks[B_16M].len), *badbuf = xmalloc(blocks[B_16M].len);
    const int which[] = {B_512K, B_1M, B_3M, B_4M1, B_16M};
    for (size_t w = 0; w < sizeof which / sizeof which[0]; w++) {
        int b = which[w];
        size_t len = blocks[b].len;
        size_t pos[] = {0, PIECE - 1, PIECE, PIECE + 1, len / 2, (len - 1) / PIECE * PIECE - 1,
                        (len - 1) / PIECE * PIECE, len - 1};
        for (size_t k = 0; k < sizeof pos / sizeof pos[0]; k++) {
            corrupt_case(b, pos[k], "single", NULL, badbuf, -1);
            if (k % 2 == 0) /* after a 16 MiB block in the same batch */
                corrupt_case(b, pos[k], "batch", goodbuf, badbuf, B_16M);
        }
    }
    free(goodbuf);
    free(badbuf);
}

typedef struct {
    uint64_t blocks, bytes, late;
} delta_t;

/* Exact counter deltas need a helper that is not in cooldown: a caller
 * that had to wait for it (descheduled: a busy host) leaves it alone for
 * 0.1 s or more, and the helper may back off by itself. So each measured
 * load is preceded by a control load of the 16 MiB block (>= 2 MiB left:
 * the helper takes it when available); the measurement is exact when the
 * control took the helper and `late` did not move from the control to the
 * end of the measured op. Otherwise it is counted as skipped. */
static int exact_checked, exact_skipped;
static uint8_t *control_buf;

static void control_load(void)
{
    const char *path = blocks[B_16M].path;
    void *out = control_buf;
    size_t len = blocks[B_16M].len;
    kvt_batch_result res;
    CHECK(kvt_batch_load(&path, &out, &len, 1, 0, 1, NULL, &res) == 0, "control load: err %d", res.err);
    atomic_fetch_add(&eligible_bytes, len);
}

/* The control load; returns 1 when it took the helper. *a: stats after it. */
static int control(kvt_crc_helper_stats *a)
{
    kvt_crc_helper_stats c;
    info(&c);
    control_load();
    info(a);
    return a->blocks - c.blocks == 1 && a->late == c.late;
}

static delta_t measure(void (*op)(void *), void *arg, int *exact)
{
    kvt_crc_helper_stats a, b;
    int avail = control(&a);
    op(arg);
    info(&b);
    delta_t d = {b.blocks - a.blocks, b.bytes - a.bytes, b.late - a.late};
    *exact = avail && d.late == 0;
    if (*exact)
        exact_checked++;
    else
        exact_skipped++;
    return d;
}

typedef struct {
    const int *idx;
    size_t n;
    uint8_t **bufs;
    int direct;
} load_args;

static void op_load(void *p)
{
    load_args *a = p;
    const char *paths[NB];
    void *outs[NB];
    size_t lens[NB];
    for (size_t i = 0; i < a->n; i++) {
        paths[i] = blocks[a->idx[i]].path;
        outs[i] = a->bufs[a->idx[i]];
        lens[i] = blocks[a->idx[i]].len;
        memset(outs[i], 0xcd, lens[i]);
    }
    kvt_batch_result res;
    int rc = kvt_batch_load(paths, outs, lens, a->n, a->direct, 1, NULL, &res);
    for (size_t i = 0; i < a->n; i++) /* O_DIRECT: only odd lengths are read buffered */
        atomic_fetch_add(&eligible_bytes, lens[i]);
    CHECK(rc == 0, "load (O_DIRECT %d) of %zu blocks: err %d", a->direct, a->n, res.err);
    for (size_t i = 0; i < a->n; i++)
        CHECK(memcmp(outs[i], blocks[a->idx[i]].data, lens[i]) == 0, "bytes of block %zu", i);
}

static void op_load_nochecksum(void *p)
{
    load_args *a = p;
    const char *path = blocks[a->idx[0]].path;
    void *out = a->bufs[a->idx[0]];
    size_t len = blocks[a->idx[0]].len;
    memset(out, 0, len);
    kvt_batch_result res;
    CHECK(kvt_batch_load(&path, &out, &len, 1, 0, 0, NULL, &res) == 0, "unchecksummed load: err %d", res.err);
    CHECK(memcmp(out, blocks[a->idx[0]].data, len) == 0, "unchecksummed bytes");
}

static void op_store(void *p)
{
    const int *direct = p;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/store_%d.bin", dir, *direct);
    unlink(path);
    if (store_one(path, blocks[B_16M].data, blocks[B_16M].len, *direct) == 0)
        CHECK(xattr_crc(path) == blocks[B_16M].crc, "record of a stored 16 MiB block");
    unlink(path);
}

static int o_direct_works(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0)
        return 0;
    void *b = xmalloc(4096);
    ssize_t r = pread(fd, b, 4096, 0);
    free(b);
    close(fd);
    return r == 4096;
}

/* The helper took `want` blocks: exact when measured so; never more (a
 * cooldown only takes blocks away). */
#define TOOK(want, ...)                                                                  \
    do {                                                                                 \
        CHECK(d.blocks <= (want), __VA_ARGS__);                                          \
        if (exact)                                                                       \
            CHECK(d.blocks == (want), __VA_ARGS__);                                      \
    } while (0)

/* Which blocks the helper takes: >= 512 KiB buffered checksummed loads only;
 * its bytes are whole pieces from the front (or the whole block).
 * Single-threaded, in a process that ran nothing else (--accounting). */
static void phase_accounting(void)
{
    uint8_t *bufs[NB];
    for (size_t i = 0; i < NB; i++)
        bufs[i] = xmalloc(blocks[i].len);
    int exact;
    delta_t d;
    int all[NB] = {0, 1, 2, 3, 4, 5};

    if (opt_off) { /* nothing ever goes to the helper */
        load_args a = {all, NB, bufs, 0};
        for (int r = 0; r < 3; r++)
            op_load(&a);
        goto out;
    }

    /* single 16 MiB loads (>= 2 MiB left: a sleeping helper is woken) */
    for (int r = 0; r < 5; r++) {
        int i16 = B_16M;
        load_args a = {&i16, 1, bufs, 0};
        d = measure(op_load, &a, &exact);
        TOOK(1, "16 MiB load: helper blocks +%llu", (unsigned long long)d.blocks);
        CHECK(d.bytes <= blocks[B_16M].len && d.bytes % PIECE == 0, "16 MiB load: helper bytes +%llu",
              (unsigned long long)d.bytes);
    }
    /* 1-byte last piece: the helper's share is whole pieces, or everything */
    for (int r = 0; r < 5; r++) {
        int pair[2] = {B_4M1, B_4M1};
        load_args a = {pair, 2, bufs, 0};
        d = measure(op_load, &a, &exact);
        TOOK(2, "2 x (4 MiB + 1): helper blocks +%llu", (unsigned long long)d.blocks);
        CHECK(d.bytes <= 2 * blocks[B_4M1].len && d.bytes % PIECE <= 2, "2 x (4 MiB + 1): helper bytes +%llu",
              (unsigned long long)d.bytes);
    }
    /* the threshold: 512 KiB - 1 is inline, 512 KiB goes to the helper
     * (each batched before a 16 MiB block, so >= 2 MiB are left) */
    for (int r = 0; r < 3; r++) {
        int b1[2] = {B_SMALL, B_16M}, b2[2] = {B_512K, B_16M};
        load_args a1 = {b1, 2, bufs, 0}, a2 = {b2, 2, bufs, 0};
        d = measure(op_load, &a1, &exact);
        TOOK(1, "[512 KiB - 1, 16 MiB]: helper blocks +%llu (want 1)", (unsigned long long)d.blocks);
        d = measure(op_load, &a2, &exact);
        TOOK(2, "[512 KiB, 16 MiB]: helper blocks +%llu (want 2)", (unsigned long long)d.blocks);
    }
    /* not the helper's: unchecksummed loads, stores, O_DIRECT loads */
    {
        int i16 = B_16M;
        load_args a = {&i16, 1, bufs, 0};
        d = measure(op_load_nochecksum, &a, &exact);
        CHECK(d.blocks == 0 && d.bytes == 0, "unchecksummed load: helper blocks +%llu", (unsigned long long)d.blocks);
        for (int direct = 0; direct < 2; direct++) {
            d = measure(op_store, &direct, &exact);
            CHECK(d.blocks == 0 && d.bytes == 0, "store (O_DIRECT %d): helper blocks +%llu bytes +%llu", direct,
                  (unsigned long long)d.blocks, (unsigned long long)d.bytes);
        }
        if (o_direct_works(blocks[B_16M].path)) {
            /* aligned lengths: read with O_DIRECT, CRC inline (no page-cache copy to overlap) */
            int aligned[3] = {B_512K, B_1M, B_16M};
            load_args ad = {aligned, 3, bufs, 1};
            d = measure(op_load, &ad, &exact);
            CHECK(d.blocks == 0 && d.bytes == 0, "O_DIRECT loads: helper blocks +%llu bytes +%llu",
                  (unsigned long long)d.blocks, (unsigned long long)d.bytes);
            /* odd lengths cannot use O_DIRECT: read buffered, so the helper takes them */
            int odd[2] = {B_3M, B_4M1};
            load_args ao = {odd, 2, bufs, 1};
            d = measure(op_load, &ao, &exact);
            TOOK(2, "use_o_direct with odd lengths (buffered): helper blocks +%llu (want 2)",
                  (unsigned long long)d.blocks);
            printf("o_direct: checked\n");
        } else {
            printf("o_direct: not supported in %s, skipped\n", dir);
        }
    }
out:
    for (size_t i = 0; i < NB; i++)
        free(bufs[i]);
}

/* The wake-up policy: a sleeping helper is woken only for >= 2 MiB left in
 * the batch, or in a stream (the previous eligible load began within the
 * poll window). Timing based: an attempt that a slow host spoils is retried
 * with a longer pause; a wrong policy fails every attempt. */
static void phase_policy(void)
{
    uint8_t *bufs[NB];
    for (size_t i = 0; i < NB; i++)
        bufs[i] = xmalloc(blocks[i].len);
    int i1 = B_1M, two[2] = {B_1M, B_1M};
    load_args one = {&i1, 1, bufs, 0}, pair = {two, 2, bufs, 0};
    int ok_sleep = 0, ok_stream = 0, ok_batch = 0, tried_stream = 0, tried_batch = 0;
    for (int attempt = 0; attempt < 8 && !(ok_sleep && ok_stream && ok_batch); attempt++) {
        unsigned pause = 30u << (attempt < 2 ? attempt : 2); /* > the poll window (1 ms): the helper sleeps */
        kvt_crc_helper_stats a0, a, b, c;
        int avail = control(&a0); /* the helper is available (no cooldown) ... */
        sleep_ms(pause);          /* ... and now asleep */
        info(&a);
        uint64_t t1 = mono_ns();
        op_load(&one); /* sleeping helper, 1 MiB left, no stream: inline */
        info(&b);
        uint64_t t2 = mono_ns();
        op_load(&one); /* right after: a stream (poll 1 ms), woken; poll 0: inline */
        info(&c);
        /* conclusive when the helper was available, and the second load began
         * within the poll window (the first was not stalled) */
        if (avail && c.late == a0.late && t2 - t1 < 800000u) {
            tried_stream++;
            ok_sleep |= b.blocks - a.blocks == 0;
            ok_stream |= opt_poll0 ? c.blocks - b.blocks == 0 : c.blocks - b.blocks == 1;
        }
        avail = control(&a0);
        sleep_ms(pause);
        info(&a);
        t1 = mono_ns();
        op_load(&pair); /* 2 MiB left: worth waking it; then a stream (poll 0: the
                         * helper sleeps again at once and 1 MiB is not worth it) */
        info(&b);
        t2 = mono_ns();
        if (avail && b.late == a0.late && t2 - t1 < 800000u) {
            tried_batch++;
            ok_batch |= opt_poll0 ? b.blocks - a.blocks >= 1 : b.blocks - a.blocks == 2;
        }
    }
    if (tried_stream) {
        exact_checked++;
        CHECK(ok_sleep, "a single 1 MiB load woke the sleeping helper in every attempt");
        CHECK(ok_stream, "back-to-back 1 MiB loads: the second %s the helper in every attempt",
              opt_poll0 ? "woke (poll 0: no stream)" : "did not take");
    } else {
        exact_skipped++;
    }
    if (tried_batch) {
        exact_checked++;
        CHECK(ok_batch, "a batch of 2 x 1 MiB did not take the helper (%s) in any attempt",
              opt_poll0 ? "for its first block" : "for both blocks");
    } else {
        exact_skipped++;
    }
    for (size_t i = 0; i < NB; i++)
        free(bufs[i]);
}

/* fork() while another thread is loading through the helper: the child has
 * no helper thread (or one it cannot wait for); it starts its own. */
static atomic_int fork_stop, fork_pause;
static void *fork_bg(void *arg)
{
    (void)arg;
    uint8_t *bufs[NB] = {0};
    bufs[B_16M] = xmalloc(blocks[B_16M].len);
    bufs[B_4M1] = xmalloc(blocks[B_4M1].len);
    int idx[2] = {B_16M, B_4M1};
    while (!atomic_load(&fork_stop)) {
        load_verify(idx, 2, bufs, 0x99, "fork background");
        while (atomic_load(&fork_pause) && !atomic_load(&fork_stop))
            sleep_ms(1);
    }
    free(bufs[B_16M]);
    free(bufs[B_4M1]);
    return NULL;
}

/* Exit status: 0 checks passed and the child's own helper took work; 4
 * checks passed but the helper stayed unused because of a cooldown (a late
 * wait, inherited from the parent or the child's own); 1 a check failed. */
static int child_checks(int k)
{
    /* n_pass/n_fail are copies: report through the exit status */
    int fail0 = atomic_load(&n_fail);
    kvt_crc_helper_stats a, b;
    info(&a);
    CHECK(a.running == 0, "child %d: the parent's helper thread counted as running", k);
    uint8_t *bufs[NB];
    for (size_t i = 0; i < NB; i++)
        bufs[i] = xmalloc(blocks[i].len);
    int all[NB] = {0, 1, 2, 3, 4, 5};
    /* Until the child's own helper has taken blocks and checksummed bytes: a
     * cooldown inherited from the parent, or a late start of the new thread,
     * legitimately keeps the first loads inline. */
    uint64_t deadline = mono_ns() + 2500000000ull;
    int r = 0, took;
    do {
        load_verify(all, NB, bufs, (uint8_t)r++, "child batch");
        info(&b);
        took = b.running && b.blocks > a.blocks && b.bytes > a.bytes;
    } while (!took && mono_ns() < deadline);
    char tag[32];
    snprintf(tag, sizeof tag, "child%d", k);
    corrupt_case(B_4M1, PIECE * (size_t)(k + 1), tag, bufs[B_16M], bufs[B_4M1], B_16M);
    if (!took && b.late == 0)
        CHECK(took, "child %d after %d batches: helper running %d blocks %llu -> %llu bytes %llu -> %llu", k, r,
              b.running, (unsigned long long)a.blocks, (unsigned long long)b.blocks, (unsigned long long)a.bytes,
              (unsigned long long)b.bytes);
    if (atomic_load(&n_fail) != fail0)
        return 1;
    return took ? 0 : 4;
}

/* fork() while another thread loads through the helper (a fresh process). */
static void phase_fork(void)
{
    pthread_t th;
    int verified = 0, nforks = 6;
    atomic_store(&fork_stop, 0);
    pthread_create(&th, NULL, fork_bg, NULL);
    for (int k = 0; k < nforks; k++) {
        sleep_ms(3 + (unsigned)k * 2);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(60);
            _exit(child_checks(k));
        }
        CHECK(pid > 0, "fork: errno %d", errno);
        if (pid <= 0)
            continue;
        atomic_store(&fork_pause, 1); /* the child gets the CPUs */
        int st = 0;
        CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 4),
              "child %d: status 0x%x (exit 1: checks failed; SIGALRM: hung)", k, st);
        verified += WIFEXITED(st) && WEXITSTATUS(st) == 0;
        atomic_store(&fork_pause, 0);
    }
    atomic_store(&fork_stop, 1);
    pthread_join(th, NULL);
    printf("fork: helper restarted in %d of %d children\n", verified, nforks);
}

/* ------------------------------------------------------------------ */

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "TIMEOUT: test_crc_helper hung (watchdog)\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    _exit(3);
}

static void cleanup(void)
{
    for (size_t i = 0; i < NB; i++)
        unlink(blocks[i].path);
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (dir[0] && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(int argc, char **argv)
{
    const char *backend = NULL, *parent = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--poll0"))
            opt_poll0 = 1;
        else if (!strcmp(argv[i], "--off"))
            opt_off = 1;
        else if (!strcmp(argv[i], "--warm"))
            opt_warm = 1;
        else if (!strcmp(argv[i], "--accounting"))
            opt_accounting = 1;
        else if (!strcmp(argv[i], "--fork"))
            opt_fork = 1;
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            opt_iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            backend = argv[++i];
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            parent = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--poll0] [--off] [--warm] [--accounting] [--fork] [--iters N] "
                            "[--backend NAME] [--dir DIR]\n", argv[0]);
            return 2;
        }
    }
    signal(SIGALRM, on_alarm);
    alarm(240);
    /* Read once, at the first checksummed buffered load: set before it. The
     * fused copy path (fs_io.c "Fused copy") takes those loads when it is on:
     * off here, so they reach the helper (tests/test_crc_copy.py covers it). */
    setenv("KVTIER_CRC_COPY", "0", 1);
    setenv("KVTIER_CRC_HELPER", opt_off ? "0" : "1", 1);
    if (opt_poll0)
        setenv("KVTIER_CRC_HELPER_POLL_US", "0", 1);
    else
        unsetenv("KVTIER_CRC_HELPER_POLL_US");
    if (kvt_crc32c_select(backend) != 0) {
        fprintf(stderr, "backend %s: %s\n", backend ? backend : "(best)", strerror(errno));
        return 2;
    }
    printf("backend: %s\n", kvt_crc32c_active()->name);

    if (!parent)
        parent = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, sizeof dir, "%s/kvt_crc_helper_XXXXXX", parent);
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 2;
    }
    atexit(cleanup);

    uint64_t t0 = mono_ns();
    for (size_t i = 0; i < NB; i++) {
        blocks[i].len = SIZES[i];
        blocks[i].data = xmalloc(SIZES[i]);
        fill_random(blocks[i].data, SIZES[i], 7 + i);
        blocks[i].crc = kvt_crc32c_slice8(0, blocks[i].data, SIZES[i]);
        snprintf(blocks[i].path, sizeof blocks[i].path, "%s/blk_%zu.bin", dir, SIZES[i]);
        store_one(blocks[i].path, blocks[i].data, SIZES[i], i % 2);
        CHECK(xattr_crc(blocks[i].path) == blocks[i].crc, "record of block %zu", i);
    }
    kvt_crc_helper_stats s0;
    control_buf = xmalloc(blocks[B_16M].len);
    if (opt_fork) {
        if (!opt_off)
            phase_fork();
    } else if (opt_accounting) {
        info(&s0);
        CHECK(s0.enabled == !opt_off && s0.running == 0 && s0.blocks == 0 && s0.bytes == 0,
              "before any load: enabled %d running %d blocks %llu", s0.enabled, s0.running,
              (unsigned long long)s0.blocks);
        phase_accounting();
        printf("accounting: done\n");
        if (!opt_off) {
            phase_policy();
            printf("policy: done\n");
        }
        printf("exact: %d checked, %d skipped (helper late: cooldown)\n", exact_checked, exact_skipped);
    } else {
        if (opt_warm) {
            int i16 = B_16M;
            uint8_t *bufs[NB] = {0};
            bufs[B_16M] = xmalloc(blocks[B_16M].len);
            load_verify(&i16, 1, bufs, 0, "warm");
            free(bufs[B_16M]);
        }
        run_threads(cold_worker);
        printf("cold: done\n");
        run_threads(stress_worker);
        printf("stress: %d threads x %d iterations\n", NTHREADS, opt_iters);
        phase_corrupt();
        printf("corrupt: done\n");
    }
    info(&s0);
    CHECK(s0.enabled == !opt_off, "enabled %d", s0.enabled);
    CHECK(s0.poll_ns == (opt_poll0 ? 0u : 1000000u), "poll_ns %llu", (unsigned long long)s0.poll_ns);
    CHECK(s0.running == !opt_off, "running %d after the loads", s0.running);

    kvt_crc_helper_stats s;
    info(&s);
    unsigned long long total = atomic_load(&eligible_bytes);
    if (opt_off)
        CHECK(s.blocks == 0 && s.bytes == 0 && s.late == 0, "KVTIER_CRC_HELPER=0: helper blocks %llu bytes %llu",
              (unsigned long long)s.blocks, (unsigned long long)s.bytes);
    else /* bytes > 0 unless the helper backed off (late: a busy host, it is
          * then left alone for >= 0.1 s), or in the short single-threaded
          * --accounting / --fork runs, where the new thread may not get a CPU
          * in time (the caller then checksums everything itself) */
        CHECK(s.blocks > 0 && (s.bytes > 0 || s.late > 0 || opt_accounting || opt_fork) && s.bytes <= total,
              "helper used: blocks %llu bytes %llu of %llu checksummed buffered", (unsigned long long)s.blocks,
              (unsigned long long)s.bytes, total);
    printf("helper: enabled %d running %d poll_ns %llu blocks %llu bytes %llu late %llu\n", s.enabled, s.running,
           (unsigned long long)s.poll_ns, (unsigned long long)s.blocks, (unsigned long long)s.bytes,
           (unsigned long long)s.late);
    printf("time: %.2f s\n", (double)(mono_ns() - t0) / 1e9);
    printf("%d passed, %d failed\n", atomic_load(&n_pass), atomic_load(&n_fail));
    for (size_t i = 0; i < NB; i++)
        free(blocks[i].data);
    free(control_buf);
    return atomic_load(&n_fail) ? 1 : 0;
}
