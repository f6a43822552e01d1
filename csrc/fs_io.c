/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 *
 * On-disk contract and the load outcome table: docs/design.md
 * ("On-disk contract"), compatible with vLLM's FS offload tier.
 *
 * Plain C11 (gnu11) + POSIX/Linux, no Python: a whole batch runs without the
 * GIL and the C test programs under tests/c/ call it directly.
 *
 * Checksum cost. The CRC is computed chunk by chunk (KVT_IO_CHUNK bytes) right
 * next to the I/O of that chunk: a load reads a chunk into the caller's buffer
 * and checksums it while it is still in the CPU cache; a store checksums a
 * chunk and then writes it, so the kernel's copy into the page cache reads
 * cache-hot data. There is never a second full pass over cold memory.
 * Checksummed buffered loads go through a per-thread bounce buffer and a
 * fused copy + CRC kernel (see "Fused copy"; x86-64 with PCLMULQDQ, unless
 * KVTIER_CRC_COPY=0 or the CRC32C backend is forced). Without it, those of
 * KVT_CRC_HELPER_MIN bytes and more share their chunk CRCs with a helper
 * thread, overlapped with the copy of the next chunk (on with >= 2 usable
 * CPUs unless KVTIER_CRC_HELPER=0; see "CRC hook").
 * All CRC work goes through crc_begin/crc_ready/crc_finish/crc_cancel: the
 * one place where an offload engine (Intel DSA: submit before the write,
 * collect after; verify on the device) plugs in.
 */
#define _GNU_SOURCE
#include "fs_io.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "dsa.h" /* third CRC engine (csrc/dsa) */
#include "job_state.h"

/* ------------------------------------------------------------------ */
/* CRC hook: inline, or overlapped on a helper thread                  */
/* ------------------------------------------------------------------ */

/* The CRC of a block is fed in order as its bytes become available:
 *   crc_begin(c, buf, len, overlap)  start; picks the engine. overlap: 0, or
 *                            the bytes left in the batch from this block on
 *                            when the helper may take the CRC
 *   crc_ready(c, upto)       bytes [0, upto) of buf are final (just read by a
 *                            load, or about to be written by a store)
 *   crc_finish(c)            return the standard CRC32C of buf
 *   crc_cancel(c)            abandon (error path)
 * After crc_finish/crc_cancel no engine touches buf any more.
 *
 * Engines: "inline" checksums each range on the calling thread right away
 * (cache-hot). "helper" (only when `overlap`: buffered loads that the fused
 * copy path does not take (read_verify), where the I/O
 * is the kernel's copy out of the page cache and costs about what the CRC
 * does) hands KVT_CRC_PIECE pieces to one process-wide helper thread, which
 * checksums piece k while the caller reads the next chunk, so a load costs
 * about max(copy, CRC) instead of copy + CRC. The helper claims pieces from
 * the front; at crc_finish the caller claims the rest from the back (joined
 * with kvt_crc32c_combine) and waits only for the one piece the helper may be
 * in the middle of (<= 64 KiB, about 1 us; it reads buf). A helper that falls
 * more than KVT_CRC_HELPER_LAG behind (not awake yet, descheduled) is taken
 * over (crc_takeover): the caller checksums the rest inline while it is still
 * in cache, so a missing helper costs only the inline CRC. One block at a
 * time: a caller that finds the helper busy (many I/O threads) uses inline.
 *
 * Waking a sleeping thread costs its waker ~8 us and itself 7 us - 1 ms on a
 * VM (an IPI to a halted vCPU), as much as the copy of a 1 MiB block, so the
 * helper polls for crc_helper_poll_ns before it sleeps (the blocks of a batch
 * and back-to-back loads find it awake), and a sleeping helper is woken only
 * for a batch with KVT_CRC_HELPER_WAKE_MIN left or in a stream of loads
 * (crc_helper_acquire). Woken onto the caller's CPU it moves off it
 * (helper_move_off). It uses only a core nobody else wants: found descheduled
 * (KVT_CRC_HELPER_LATE_NS), or with preempted / never-claimed jobs piling up
 * (helper_note_job), it backs off and loads checksum inline for a while
 * (helper_back_off).
 *
 * Claims word: generation (32 bits) | front (16) | back (16), in pieces, so a
 * helper still looking at a finished job can never claim a piece of the next
 * one. Done word: generation (low 16 bits) | pieces done (16) | their CRC (32).
 * A job opens with (gen, 0, n); the caller writes base/len/ready/done before
 * it and a new job only after the old one has nothing left to claim, so a
 * successful claim CAS proves the base/len the helper read are that job's. */

#define KVT_CRC_PIECE (64u * 1024u) /* helper granularity (bytes) */
#define KVT_CRC_PIECES_MAX 0xffffu  /* 16-bit piece counts: blocks < 4 GiB */
#define KVT_CRC_SPIN 200            /* pause loops before yielding (caller) */
#define CL_MAKE(g, f, b) (((uint64_t)(uint32_t)(g) << 32) | ((uint64_t)(f) << 16) | (uint64_t)(b))
#define CL_GEN(c) ((uint32_t)((c) >> 32))
#define CL_FRONT(c) ((unsigned)(((c) >> 16) & 0xffffu))
#define CL_BACK(c) ((unsigned)((c)&0xffffu))
#define DN_MAKE(g, n, crc) ((((uint64_t)((g)&0xffffu)) << 48) | ((uint64_t)(n) << 32) | (uint64_t)(uint32_t)(crc))
#define DN_COUNT(d) ((unsigned)(((d) >> 32) & 0xffffu))
#define DN_CRC(d) ((uint32_t)(d))

typedef struct kvt_crc_ctx {
    const uint8_t *base;
    size_t len;
    size_t pos;    /* inline: bytes checksummed */
    uint32_t crc;
    int helper;    /* 1 when the helper engine owns this block */
    int taken;     /* the caller took the rest over at byte `took` (helper behind) */
    int idle_helper; /* ... and the helper, polling at crc_begin, had not started on it */
    int helper_awake; /* the helper was in its poll loop at crc_begin */
    size_t took;
    uint32_t gen;
    long nivcsw;   /* thread_nivcsw() at crc_begin (helper engine) */
    /* DSA engine when the active CRC backend is "dsa" / "dsa-model"
     * (read-locked from crc_begin to crc_finish/crc_cancel). Each crc_ready()
     * collects the previous range's descriptor and submits the new range
     * chained from it, so the device checksums chunk k while the caller
     * reads/writes chunk k+1. The op stays valid until the device is done. */
    kvt_dsa_engine *dsa;
    size_t dsa_pos;   /* bytes submitted to the device */
    int dsa_inflight;
    kvt_dsa_op dsa_op;
} kvt_crc_ctx;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;                /* helper sleeps here; callers signal */
    int state;                        /* 0 not started, 1 running, -1 unavailable (under mu) */
    uint32_t gen;                     /* last job posted (owned by the busy caller) */
    _Atomic int busy;                 /* 1 while a caller owns the helper */
    _Atomic int sleeping;             /* helper is (about to be) in cond_wait */
    _Atomic int polling;              /* helper is running its poll loop */
    _Atomic int caller_cpu;           /* CPU of the caller that posted the job */
    _Atomic(const uint8_t *) base;    /* the current job */
    _Atomic size_t len;
    _Atomic size_t ready;             /* bytes published by the caller */
    _Atomic uint64_t claims;          /* CL_MAKE(gen, front, back) */
    _Atomic uint64_t done;            /* DN_MAKE(gen, pieces done, their CRC) */
} helper = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int crc_helper_mode; /* KVTIER_CRC_HELPER: 1 on, 0 off; set once (crc_helper_read_env) */
static int crc_copy_mode;   /* KVTIER_CRC_COPY: 1 on (default), 0 off; set once (crc_helper_read_env) */
static uint64_t crc_helper_poll_ns = KVT_CRC_HELPER_POLL_NS; /* KVTIER_CRC_HELPER_POLL_US */
static _Atomic uint64_t helper_cool_until; /* CLOCK_MONOTONIC ns: inline until then */
static _Atomic uint64_t helper_last_begin; /* CLOCK_MONOTONIC ns of the last eligible load */
static _Atomic uint64_t stat_helper_blocks, stat_helper_bytes, stat_helper_late;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline size_t piece_len(size_t len, unsigned k)
{
    size_t start = (size_t)k * KVT_CRC_PIECE;
    return len - start < KVT_CRC_PIECE ? len - start : KVT_CRC_PIECE;
}

/* The helper, or a caller waiting for it, was descheduled: the host has no
 * idle core for it. Checksum inline for KVT_CRC_HELPER_COOL_NS, doubled while
 * it recurs within a minute (up to 64x), so the helper does not compete for
 * CPU with the I/O threads and the rest of the process. */
static uint64_t helper_late_last; /* under helper.mu */
static unsigned helper_late_streak;

static void helper_back_off(uint64_t now)
{
    pthread_mutex_lock(&helper.mu);
    unsigned streak = helper_late_streak;
    streak = now - helper_late_last > 60000000000ull ? 1 : (streak < 7 ? streak + 1 : 7);
    helper_late_streak = streak;
    helper_late_last = now;
    atomic_store(&helper_cool_until, now + ((uint64_t)KVT_CRC_HELPER_COOL_NS << (streak - 1)));
    pthread_mutex_unlock(&helper.mu);
    atomic_fetch_add(&stat_helper_late, 1);
}

/* Involuntary context switches of the calling thread so far: another runnable
 * task took its CPU, so the host has no idle core. */
static long thread_nivcsw(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : 0;
}

/* A job on which the caller or the helper was preempted (involuntary
 * context switch), or that the helper never got to: evidence of a host with
 * no idle core, but a quiet host has some too (kernel threads, ~1 per 100
 * jobs here). Leaky bucket: each adds 16, each clean job takes 1
 * away; 48 (three close together) backs off. */
static _Atomic int helper_preempt_score;

static void helper_note_job(int preempted)
{
    if (preempted) {
        if (atomic_fetch_add(&helper_preempt_score, 16) + 16 >= 48) {
            atomic_store(&helper_preempt_score, 0);
            helper_back_off(mono_ns());
        }
        return;
    }
    int v = atomic_load(&helper_preempt_score);
    while (v > 0 && !atomic_compare_exchange_weak(&helper_preempt_score, &v, v - 1))
        ;
}

static int helper_cooling(void)
{
    uint64_t cool = atomic_load_explicit(&helper_cool_until, memory_order_relaxed);
    return cool != 0 && mono_ns() < cool;
}

/* Leave CPU `cpu` now: run on the others (the kernel migrates the thread
 * before sched_setaffinity returns), then allow every CPU again. Without
 * another CPU to go to, just yield it. */
static void helper_move_off(int cpu)
{
    cpu_set_t all, others;
    if (cpu >= 0 && cpu < CPU_SETSIZE && sched_getaffinity(0, sizeof all, &all) == 0) {
        others = all;
        CPU_CLR(cpu, &others);
        if (CPU_COUNT(&others) > 0 && sched_setaffinity(0, sizeof others, &others) == 0) {
            sched_setaffinity(0, sizeof all, &all);
            return;
        }
    }
    sched_yield();
}

/* Helper: poll `has_work` for crc_helper_poll_ns. Returns 0 when it has work,
 * 1 when the window ran out, 2 when the helper found itself descheduled
 * between two looks (no idle core: it backed off). */
static int helper_poll(int (*has_work)(const void *), const void *arg)
{
    uint64_t t0 = 0, prev = 0;
    atomic_store_explicit(&helper.polling, 1, memory_order_relaxed);
    for (unsigned spins = 0;; spins++) {
        if (has_work(arg))
            return 0;
        if ((spins & 63u) == 63u) { /* every ~1-2 us */
            /* Woken onto the caller's CPU (the idle one was halted): polling
             * there would take the CPU from the caller; move off it. */
            int cc = atomic_load_explicit(&helper.caller_cpu, memory_order_relaxed);
            if (sched_getcpu() == cc) {
                helper_move_off(cc);
                prev = 0;
            }
            uint64_t t = mono_ns();
            if (t0 == 0)
                t0 = t;
            else if (prev != 0 && t - prev >= KVT_CRC_HELPER_LATE_NS) {
                helper_back_off(t);
                return 2;
            } else if (t - t0 >= crc_helper_poll_ns)
                return 1;
            prev = t;
        }
        cpu_relax();
    }
}

/* Sleep until a caller signals (Dekker with helper_signal_if_sleeping: they
 * store, then load `sleeping`; we store `sleeping`, then re-check under mu). */
static void helper_sleep(int (*has_work)(const void *), const void *arg)
{
    atomic_store_explicit(&helper.polling, 0, memory_order_relaxed);
    pthread_mutex_lock(&helper.mu);
    atomic_store(&helper.sleeping, 1);
    if (!has_work(arg))
        pthread_cond_wait(&helper.cv, &helper.mu);
    atomic_store(&helper.sleeping, 0);
    pthread_mutex_unlock(&helper.mu);
}

typedef struct {
    uint32_t gen;
    size_t need; /* bytes that must be ready */
} piece_wait;

static void helper_run_pieces(uint32_t gen);

/* Piece wait is over: its bytes are ready, or the job is no longer open. */
static int piece_or_job_over(const void *arg)
{
    const piece_wait *w = arg;
    uint64_t c = atomic_load(&helper.claims);
    return CL_GEN(c) != w->gen || CL_FRONT(c) >= CL_BACK(c) || atomic_load(&helper.ready) >= w->need;
}

static void helper_run_job(uint32_t gen)
{
    long nivcsw0 = thread_nivcsw();
    helper_run_pieces(gen);
    if (thread_nivcsw() != nivcsw0)
        helper_note_job(1); /* preempted while on the job */
}

static void helper_run_pieces(uint32_t gen)
{
    const uint8_t *base = atomic_load(&helper.base);
    size_t len = atomic_load(&helper.len);
    uint32_t crc = 0;
    for (;;) {
        uint64_t c = atomic_load(&helper.claims);
        unsigned f = CL_FRONT(c), b = CL_BACK(c);
        if (CL_GEN(c) != gen || f >= b)
            return; /* finished, or everything claimed */
        size_t n = piece_len(len, f);
        piece_wait w = {gen, (size_t)f * KVT_CRC_PIECE + n};
        if (atomic_load(&helper.ready) < w.need) {
            int r = helper_poll(piece_or_job_over, &w);
            if (r == 2)
                return; /* backed off: the caller checksums the rest */
            if (r == 1)
                helper_sleep(piece_or_job_over, &w);
            continue;
        }
        if (!atomic_compare_exchange_strong(&helper.claims, &c, CL_MAKE(gen, f + 1, b)))
            continue; /* the caller claimed from the back */
        uint64_t t0 = mono_ns();
        uint32_t next = kvt_crc32c(crc, base + (size_t)f * KVT_CRC_PIECE, n);
        atomic_store(&helper.done, DN_MAKE(gen, f + 1, next));
        atomic_fetch_add_explicit(&stat_helper_bytes, n, memory_order_relaxed);
        crc = next;
        uint64_t t1 = mono_ns();
        if (t1 - t0 >= KVT_CRC_HELPER_LATE_NS) { /* ~1 us of work took this long */
            helper_back_off(t1);
            return;
        }
    }
}

/* A job other than `*last` is open. */
static int new_job(const void *arg)
{
    uint64_t c = atomic_load(&helper.claims);
    return CL_GEN(c) != *(const uint32_t *)arg && CL_FRONT(c) < CL_BACK(c);
}

static void *crc_helper_main(void *arg)
{
    (void)arg;
    uint32_t last = 0;
    for (;;) {
        if (helper_poll(new_job, &last) != 0)
            helper_sleep(new_job, &last);
        uint64_t c = atomic_load(&helper.claims);
        if (CL_GEN(c) == last || CL_FRONT(c) >= CL_BACK(c))
            continue; /* woken for nothing */
        last = CL_GEN(c);
        helper_run_job(last);
    }
    return NULL;
}

static void helper_signal_if_sleeping(void)
{
    if (atomic_load(&helper.sleeping)) {
        pthread_mutex_lock(&helper.mu);
        pthread_cond_signal(&helper.cv);
        pthread_mutex_unlock(&helper.mu);
    }
}

/* fork(): the child has no helper thread; start a new one on demand. */
static void crc_helper_atfork_child(void)
{
    pthread_mutex_init(&helper.mu, NULL);
    pthread_cond_init(&helper.cv, NULL);
    helper.state = 0;
    atomic_store(&helper.busy, 0);
    atomic_store(&helper.sleeping, 0);
    atomic_store(&helper.polling, 0);
    atomic_store(&helper.claims, CL_MAKE(helper.gen, 0, 0));
    atomic_store(&helper_cool_until, 0); /* a new process: judge its own host share */
    atomic_store(&helper_preempt_score, 0);
    helper_late_last = 0;
    helper_late_streak = 0;
}

/* KVTIER_CRC_HELPER: 1/true/yes/on, 0/false/no/off, unset or empty: on when
 * this process may run on at least two CPUs (sched_getaffinity), since the
 * helper needs a second one. KVTIER_CRC_HELPER_POLL_US: the poll window (microseconds).
 * KVTIER_CRC_COPY: 0/false/no/off turns the fused copy path off (see "Fused
 * copy"). Read once per process (the first checksummed buffered load, or status). */
static pthread_once_t crc_helper_once = PTHREAD_ONCE_INIT;

static int env_word(const char *e, const char *const *words)
{
    for (; *words != NULL; words++)
        if (strcasecmp(e, *words) == 0)
            return 1;
    return 0;
}

static void crc_helper_read_env(void)
{
    static const char *const on[] = {"1", "true", "yes", "on", NULL};
    static const char *const off[] = {"0", "false", "no", "off", NULL};
    const char *e = getenv("KVTIER_CRC_HELPER");
    if (e != NULL && env_word(e, on)) {
        crc_helper_mode = 1;
    } else if (e != NULL && env_word(e, off)) {
        crc_helper_mode = 0;
    } else { /* unset, empty or unknown (kvtier.io refuses unknown values at import) */
        cpu_set_t set;
        crc_helper_mode = sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) >= 2;
    }
    const char *c = getenv("KVTIER_CRC_COPY"); /* unset, empty or unknown: on */
    crc_copy_mode = !(c != NULL && env_word(c, off));
    const char *p = getenv("KVTIER_CRC_HELPER_POLL_US");
    if (p != NULL && p[0] != '\0') {
        char *end;
        errno = 0;
        unsigned long long us = strtoull(p, &end, 10);
        if (errno == 0 && *end == '\0' && p[0] != '-' && us <= 10000000ull) /* <= 10 s; else default */
            crc_helper_poll_ns = us * 1000u;
    }
}

static int crc_helper_wanted(void)
{
    pthread_once(&crc_helper_once, crc_helper_read_env);
    return crc_helper_mode;
}

/* See fs_io.h. */
void kvt_crc_helper_info(kvt_crc_helper_stats *out)
{
    int enabled = crc_helper_wanted();
    pthread_mutex_lock(&helper.mu);
    out->enabled = enabled;
    out->running = helper.state == 1;
    pthread_mutex_unlock(&helper.mu);
    out->poll_ns = crc_helper_poll_ns;
    out->blocks = atomic_load(&stat_helper_blocks);
    out->bytes = atomic_load(&stat_helper_bytes);
    out->late = atomic_load(&stat_helper_late);
}

/* Take the helper for one block (starting it on first use): 1 if ours, 0 if
 * busy, unavailable or cooling down, or if it sleeps, fewer than
 * KVT_CRC_HELPER_WAKE_MIN bytes are left in the batch and no other load
 * began within the poll window: the wake-up would cost more than it hides. */
static int crc_helper_acquire(size_t batch_rest)
{
    if (!crc_helper_wanted())
        return 0;
    /* A wake-up pays off for a big batch, or in a stream of loads (the last
     * one began within the poll window): it stays awake from then on. */
    uint64_t now = mono_ns();
    uint64_t prev = atomic_exchange_explicit(&helper_last_begin, now, memory_order_relaxed);
    if (batch_rest < KVT_CRC_HELPER_WAKE_MIN && now - prev > crc_helper_poll_ns && atomic_load(&helper.sleeping))
        return 0;
    uint64_t cool = atomic_load_explicit(&helper_cool_until, memory_order_relaxed);
    if (cool != 0 && now < cool)
        return 0; /* backed off (helper_back_off) */
    int expected = 0;
    if (!atomic_compare_exchange_strong(&helper.busy, &expected, 1))
        return 0;
    if (helper.state == 1)
        return 1; /* started before; only ever 1 -> 0 in a forked child */
    pthread_mutex_lock(&helper.mu);
    if (helper.state == 0) {
        static int atfork_done;
        if (!atfork_done) {
            pthread_atfork(NULL, NULL, crc_helper_atfork_child);
            atfork_done = 1;
        }
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        helper.state = pthread_create(&t, &attr, crc_helper_main, NULL) == 0 ? 1 : -1;
        pthread_attr_destroy(&attr);
    }
    int ok = helper.state == 1;
    pthread_mutex_unlock(&helper.mu);
    if (!ok)
        atomic_store(&helper.busy, 0);
    return ok;
}

static void crc_begin(kvt_crc_ctx *c, const void *buf, size_t len, size_t overlap)
{
    c->base = (const uint8_t *)buf;
    c->len = len;
    c->pos = 0;
    c->crc = 0;
    c->helper = 0;
    c->taken = 0;
    c->idle_helper = 0;
    c->dsa = kvt_dsa_acquire_active(); /* NULL unless the backend is dsa/dsa-model */
    c->dsa_pos = 0;
    c->dsa_inflight = 0;
    if (c->dsa)
        return;
    size_t npieces = (len + KVT_CRC_PIECE - 1) / KVT_CRC_PIECE;
    if (overlap == 0 || len < KVT_CRC_HELPER_MIN || npieces > KVT_CRC_PIECES_MAX || !crc_helper_acquire(overlap))
        return;
    uint32_t gen = ++helper.gen;
    if (gen == 0)
        gen = ++helper.gen; /* 0 is the helper's "no job seen yet" */
    atomic_store(&helper.base, c->base);
    atomic_store(&helper.len, len);
    atomic_store(&helper.ready, 0);
    atomic_store(&helper.done, DN_MAKE(gen, 0, 0));
    atomic_store_explicit(&helper.caller_cpu, sched_getcpu(), memory_order_relaxed);
    atomic_store(&helper.claims, CL_MAKE(gen, 0, npieces));
    c->helper_awake = atomic_load_explicit(&helper.polling, memory_order_relaxed);
    helper_signal_if_sleeping();
    atomic_fetch_add_explicit(&stat_helper_blocks, 1, memory_order_relaxed);
    c->nivcsw = c->helper_awake ? thread_nivcsw() : 0; /* only then is it evidence (crc_settle) */
    c->helper = 1;
    c->gen = gen;
}

/* DSA: collect the in-flight range (its CRC seeds the next one). */
static void dsa_collect(kvt_crc_ctx *c)
{
    if (c->dsa_inflight) {
        c->crc = kvt_dsa_wait(&c->dsa_op);
        c->dsa_inflight = 0;
    }
}

/* The helper is more than KVT_CRC_HELPER_LAG behind (not awake yet, or
 * descheduled): leave it the pieces it has claimed, checksum the rest here
 * while it is still in cache (so never a late cold pass), inline from now on. */
static void crc_takeover(kvt_crc_ctx *c, size_t upto)
{
    uint64_t cl = atomic_load(&helper.claims);
    while (!atomic_compare_exchange_weak(&helper.claims, &cl, CL_MAKE(c->gen, CL_FRONT(cl), CL_FRONT(cl))))
        ;
    c->taken = 1;
    c->took = (size_t)CL_FRONT(cl) * KVT_CRC_PIECE;
    /* Polling when the job was posted, yet it never got to it: it gets no CPU. */
    c->idle_helper = CL_FRONT(cl) == 0 && c->helper_awake;
    c->crc = kvt_crc32c(0, c->base + c->took, upto - c->took);
    c->pos = upto;
}

static inline void crc_ready(kvt_crc_ctx *c, size_t upto)
{
    if (c->dsa) {
        if (upto > c->dsa_pos) {
            dsa_collect(c);
            kvt_dsa_crc_submit(c->dsa, &c->dsa_op, c->base + c->dsa_pos, upto - c->dsa_pos, c->crc);
            c->dsa_inflight = 1;
            c->dsa_pos = upto;
        }
        return;
    }
    if (c->helper && !c->taken) {
        atomic_store(&helper.ready, upto);
        uint64_t cl = atomic_load(&helper.claims);
        if (upto - (size_t)CL_FRONT(cl) * KVT_CRC_PIECE <= KVT_CRC_HELPER_LAG) {
            if (atomic_load(&helper.sleeping) && !helper_cooling())
                helper_signal_if_sleeping();
            return;
        }
        crc_takeover(c, upto);
    } else if (upto > c->pos) {
        c->crc = kvt_crc32c(c->crc, c->base + c->pos, upto - c->pos);
        c->pos = upto;
    }
}

/* Claim every unclaimed piece from the back (computing them when `compute`),
 * then wait for the piece the helper may be in the middle of (it reads buf);
 * release the helper. Returns the CRC. */
static uint32_t crc_settle(kvt_crc_ctx *c, int compute)
{
    const uint32_t gen = c->gen;
    uint32_t tail = 0;
    size_t tail_len = 0;
    unsigned front = 0;
    if (c->taken) { /* crc_takeover closed the job; we hold the rest */
        front = (unsigned)(c->took / KVT_CRC_PIECE);
        tail = c->crc;
        tail_len = c->pos - c->took;
    } else {
        for (;;) {
            uint64_t cl = atomic_load(&helper.claims);
            unsigned f = CL_FRONT(cl), b = CL_BACK(cl);
            /* done when the helper can claim nothing more; a cancel closes it */
            if (f >= b || (!compute && atomic_compare_exchange_strong(&helper.claims, &cl, CL_MAKE(gen, f, f)))) {
                front = f;
                break;
            }
            if (!compute || !atomic_compare_exchange_strong(&helper.claims, &cl, CL_MAKE(gen, f, b - 1)))
                continue;
            size_t n = piece_len(c->len, b - 1);
            uint32_t cb = kvt_crc32c(0, c->base + (size_t)(b - 1) * KVT_CRC_PIECE, n);
            tail = tail_len ? kvt_crc32c_combine(cb, tail, tail_len) : cb;
            tail_len += n;
        }
    }
    c->helper = 0;
    c->taken = 0;
    uint64_t d, t_late = 0;
    for (unsigned spins = 0; DN_COUNT(d = atomic_load(&helper.done)) != front; spins++) {
        if (spins < KVT_CRC_SPIN) {
            cpu_relax();
            continue;
        }
        /* The helper was descheduled mid-piece (a busy host): wait for it (it
         * reads buf), and leave it alone for a while if that took long. */
        if (t_late == 0)
            t_late = mono_ns();
        sched_yield();
    }
    /* Kept waiting by a descheduled helper: back off. With the helper polling
     * at crc_begin (a wake-up may itself preempt us: not then), preempted
     * during the job (the helper's CPU would be someone's), or the helper
     * never got to it: count it. */
    if (t_late != 0 && mono_ns() - t_late >= KVT_CRC_HELPER_LATE_NS)
        helper_back_off(mono_ns());
    else
        helper_note_job(c->helper_awake && (c->idle_helper || thread_nivcsw() != c->nivcsw));
    atomic_store(&helper.busy, 0);
    if (front == 0)
        return tail;
    if (tail_len == 0)
        return DN_CRC(d);
    return kvt_crc32c_combine(DN_CRC(d), tail, tail_len);
}

static uint32_t crc_finish(kvt_crc_ctx *c)
{
    if (c->dsa) {
        if (c->dsa_pos < c->len)
            crc_ready(c, c->len);
        dsa_collect(c);
        kvt_dsa_release(c->dsa);
        c->dsa = NULL;
        return c->crc;
    }
    if (!c->helper)
        return c->crc;
    return crc_settle(c, 1);
}

static void crc_cancel(kvt_crc_ctx *c)
{
    if (c->dsa) { /* the device may still read buf: wait for it */
        dsa_collect(c);
        kvt_dsa_release(c->dsa);
        c->dsa = NULL;
        return;
    }
    if (c->helper)
        crc_settle(c, 0);
}

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static void put_be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

static uint32_t get_be32(const uint8_t in[4])
{
    return ((uint32_t)in[0] << 24) | ((uint32_t)in[1] << 16) | ((uint32_t)in[2] << 8) | (uint32_t)in[3];
}

static void set_fail(kvt_batch_result *res, int err, size_t index, int checksum_failed)
{
    res->err = err ? err : EIO;
    res->index = index;
    res->checksum_failed = checksum_failed;
}

/* Size and O_DIRECT alignment of an open file.
 * Returns 0 and fills *size, *mem_align, *off_align. *mem_align == 0 means the
 * filesystem reported that it does not support O_DIRECT for this file
 * (statx STATX_DIOALIGN with stx_dio_mem_align == 0). Without STATX_DIOALIGN
 * (kernel < 6.1 or a filesystem that does not report it, e.g. tmpfs) the
 * conservative KVT_DIO_FALLBACK_ALIGN is used for both memory and offset. */
static int file_info(int fd, uint64_t *size, size_t *mem_align, size_t *off_align)
{
#if defined(STATX_DIOALIGN)
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_SIZE | STATX_DIOALIGN, &sx) == 0) {
        *size = sx.stx_size;
        if (sx.stx_mask & STATX_DIOALIGN) {
            *mem_align = sx.stx_dio_mem_align;
            *off_align = sx.stx_dio_offset_align;
            if (*mem_align == 0 || *off_align == 0)
                *mem_align = *off_align = 0;
        } else {
            *mem_align = *off_align = KVT_DIO_FALLBACK_ALIGN;
        }
        return 0;
    }
    if (errno != ENOSYS && errno != EINVAL)
        return -1;
#endif
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -1;
    *size = (uint64_t)st.st_size;
    *mem_align = *off_align = KVT_DIO_FALLBACK_ALIGN;
    return 0;
}

/* 1 if an O_DIRECT transfer of `len` bytes at `buf` (file offset 0) meets the
 * alignment; every chunk we issue starts at a multiple of KVT_IO_CHUNK, which
 * is a multiple of any realistic alignment (checked here too). */
static int dio_usable(const void *buf, size_t len, size_t mem_align, size_t off_align)
{
    if (mem_align == 0 || off_align == 0)
        return 0;
    size_t a = mem_align > off_align ? mem_align : off_align;
    if (KVT_IO_CHUNK % a != 0)
        return 0;
    return ((uintptr_t)buf % mem_align) == 0 && (len % off_align) == 0 && len > 0;
}

/* Switch O_DIRECT on or off on an open fd. Returns 0 or -1 (errno set; EINVAL
 * when the filesystem refuses O_DIRECT). */
static int set_direct(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
    return fcntl(fd, F_SETFL, fl);
}

/* mkdir -p of the directory part of `path`. Returns 0 or -1 with errno. */
static int make_parents(const char *path)
{
    size_t n = strlen(path);
    char *p = malloc(n + 1);
    if (!p) {
        errno = ENOMEM;
        return -1;
    }
    memcpy(p, path, n + 1);
    char *slash = strrchr(p, '/');
    if (!slash || slash == p) {
        free(p);
        return 0;
    }
    *slash = '\0';
    /* Fast path: the parent usually exists except for its last component(s). */
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            free(p);
            errno = e;
            return -1;
        }
        *s = '/';
    }
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
        int e = errno;
        free(p);
        errno = e;
        return -1;
    }
    free(p);
    return 0;
}

/* ------------------------------------------------------------------ */
/* EINTR-safe wrappers                                                 */
/* ------------------------------------------------------------------ */

/* A signal handler installed without SA_RESTART (Python installs its own that
 * way) makes a slow call on NFS/FUSE fail with EINTR before it did anything:
 * retry open, the xattr calls and rename. */
static int open_r(const char *path, int flags, mode_t mode)
{
    int fd;
    do
        fd = open(path, flags, mode);
    while (fd < 0 && errno == EINTR);
    return fd;
}

static int fsetxattr_r(int fd, const char *name, const void *val, size_t n)
{
    int r;
    do
        r = fsetxattr(fd, name, val, n, 0);
    while (r != 0 && errno == EINTR);
    return r;
}

static ssize_t fgetxattr_r(int fd, const char *name, void *val, size_t n)
{
    ssize_t r;
    do
        r = fgetxattr(fd, name, val, n);
    while (r < 0 && errno == EINTR);
    return r;
}

static int rename_r(const char *from, const char *to)
{
    int r;
    do
        r = rename(from, to);
    while (r != 0 && errno == EINTR);
    return r;
}

/* close(2) is never retried: on Linux the descriptor is released even when
 * close returns EINTR (close(2) NOTES), and a retry could close a descriptor
 * another thread just got. EINTR therefore counts as success. Returns 0 or
 * -1 with errno (EIO, ENOSPC, EDQUOT: deferred write errors of NFS/FUSE). */
static int close_r(int fd)
{
    if (close(fd) == 0 || errno == EINTR)
        return 0;
    return -1;
}

/* ------------------------------------------------------------------ */
/* Full-length I/O with EINTR / short transfers / O_DIRECT refusal     */
/* ------------------------------------------------------------------ */

/* After a failed pread/pwrite (errno set): 1 to retry it, 0 to fail. EINTR is
 * retried; EINVAL under O_DIRECT drops O_DIRECT for the rest of the file (a
 * filesystem refusing it at the first I/O) and retries buffered. */
static int retry_io(int fd, int *direct)
{
    if (errno == EINTR)
        return 1;
    if (errno == EINVAL && *direct) {
        if (set_direct(fd, 0) != 0)
            return 0;
        *direct = 0;
        return 1;
    }
    return 0;
}

/* pwrite `len` bytes at offset `off`. On EINVAL with O_DIRECT (filesystem
 * refusing O_DIRECT at the first I/O, or a short write leaving an unaligned
 * offset) drop O_DIRECT for the rest of the file and retry buffered.
 * Returns 0 or -1 with errno. */
static int write_full(int fd, const uint8_t *p, size_t len, uint64_t off, int *direct)
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

/* pread up to `len` bytes at `off`; retries EINTR and short reads. Returns the
 * number of bytes read (< len only at end of file) or -1 with errno. */
static ssize_t read_full(int fd, uint8_t *p, size_t len, uint64_t off, int *direct)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, p + got, len - got, (off_t)(off + got));
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

/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

/* fsync the directory holding `path` (makes a rename durable).
 * Returns 0 or an errno value; EINVAL (directory fsync not supported, e.g.
 * some FUSE filesystems) counts as done. */
static int fsync_parent(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash)
        dir = strdup(".");
    else if (slash == path)
        dir = strdup("/");
    else
        dir = strndup(path, (size_t)(slash - path));
    if (!dir)
        return ENOMEM;
    int fd = open_r(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    free(dir);
    if (fd < 0)
        return errno;
    int err = 0, r;
    do
        r = fsync(fd);
    while (r != 0 && errno == EINTR);
    if (r != 0 && errno != EINVAL)
        err = errno;
    close_r(fd);
    return err;
}

/* Store one block. Returns 0, or an errno value (the temp is removed). */
static int store_one(const char *tmp, const char *dest, const uint8_t *buf, size_t len, int use_o_direct,
                     int checksum, int durable, kvt_job_state *js)
{
    struct stat st;
    if (!kvt_job_live(js))
        return ETIMEDOUT; /* expired before this block began: nothing created */
    if (stat(dest, &st) == 0)
        return 0; /* already stored (by us or a peer): nothing to do */

    int fd = open_r(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        if (make_parents(tmp) != 0)
            return errno;
        fd = open_r(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    }
    if (fd < 0)
        return errno;

    int err = 0;
    int direct = 0;
    if (use_o_direct) {
        uint64_t size;
        size_t mem_align, off_align;
        /* Opened buffered, then O_DIRECT via fcntl: a filesystem that refuses
         * O_DIRECT says EINVAL here instead of at open(2), where the temp
         * would already have been created (ramfs does that). */
        if (file_info(fd, &size, &mem_align, &off_align) == 0 && dio_usable(buf, len, mem_align, off_align))
            direct = set_direct(fd, 1) == 0;
    }

    kvt_crc_ctx crc;
    if (checksum)
        crc_begin(&crc, buf, len, 0);
    const size_t chunk = KVT_IO_CHUNK;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < chunk ? len - off : chunk;
        if (checksum)
            crc_ready(&crc, off + n); /* CRC this chunk (hot) as the kernel copies it */
        if (write_full(fd, buf + off, n, off, &direct) != 0) {
            err = errno;
            break;
        }
        off += n;
    }
    if (checksum && err)
        crc_cancel(&crc);

    if (!err && checksum) {
        uint8_t rec[KVT_XATTR_LEN];
        put_be32(rec, crc_finish(&crc));
        if (fsetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec) != 0)
            err = errno;
    }
    if (!err && durable) { /* data before the name */
        int r;
        do
            r = fdatasync(fd);
        while (r != 0 && errno == EINTR);
        if (r != 0)
            err = errno;
    }
    /* The temp's identity, to tell our published file from a peer's later. */
    struct stat mine = {0};
    if (!err && durable && fstat(fd, &mine) != 0)
        err = errno;
    if (close_r(fd) != 0 && !err)
        err = errno;
    /* Publish only while the job is live (job_state.h): an expired store
     * unlinks its temp below instead. */
    if (!err && !kvt_job_commit_begin(js))
        err = ETIMEDOUT;
    else if (!err) {
        if (rename_r(tmp, dest) != 0)
            err = errno;
        kvt_job_commit_end(js);
    }
    if (err) {
        unlink(tmp);
        return err;
    }
    if (durable && (err = fsync_parent(dest)) != 0) {
        /* Published but not durable: a failed store leaves nothing. Only our
         * own file, though: a peer that renamed its block onto dest after our
         * rename (its stat(dest) ran before it) keeps its block. */
        if (stat(dest, &st) == 0 && st.st_ino == mine.st_ino && st.st_dev == mine.st_dev)
            unlink(dest);
    }
    return err;
}

int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths, const void *const *bufs,
                    const size_t *lens, size_t n, int use_o_direct, int checksum, int durable,
                    kvt_job_state *js, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    res->retried = 0;
    for (size_t i = 0; i < n; i++) {
        int e = store_one(tmp_paths[i], dest_paths[i], (const uint8_t *)bufs[i], lens[i], use_o_direct, checksum,
                          durable, js);
        if (e) {
            set_fail(res, e, i, 0);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Load                                                                */
/* ------------------------------------------------------------------ */

/* Process-wide checksum counters (kvt_checksum_stats). */
static _Atomic uint64_t stat_retries, stat_condemned;

void kvt_checksum_stats(uint64_t *retries, uint64_t *condemned)
{
    *retries = atomic_load(&stat_retries);
    *condemned = atomic_load(&stat_condemned);
}

/* ------------------------------------------------------------------ */
/* Fused copy: buffered loads through a bounce buffer                  */
/* ------------------------------------------------------------------ */

/* A checksummed buffered load reads each KVT_IO_CHUNK into a per-thread
 * bounce buffer (cache-resident) and moves it to the caller's buffer with
 * kvt_crc32c_copy (csrc/crc32c/copy.c): one pass that copies with
 * non-temporal stores and folds the CRC in the shadow of those stores. The
 * kernel's copy into the bounce buffer writes cache lines it already owns,
 * and the caller's buffer is written without a read-for-ownership, so the
 * pair costs about what the kernel's copy straight into a cold caller buffer
 * does, and the CRC comes nearly free, on the calling thread (no second core,
 * unlike the helper). Used when the path is enabled (kvt_crc_copy_info) and
 * the destination is not a recently loaded, likely cache-hot range (below);
 * the block's bytes then end up in memory, not in this core's cache. The bounce
 * buffer (KVT_IO_CHUNK bytes, 64-byte aligned) is allocated on a thread's
 * first such load and freed when the thread exits. */
static _Atomic uint64_t stat_copy_blocks, stat_copy_bytes;
static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;
static int bounce_key_ok;
static __thread uint8_t *bounce_buf;

static void bounce_make_key(void)
{
    bounce_key_ok = pthread_key_create(&bounce_key, free) == 0;
}

static int crc_copy_enabled(void)
{
    pthread_once(&crc_helper_once, crc_helper_read_env);
    return crc_copy_mode && kvt_crc32c_copy_best()->available != NULL &&
           kvt_crc32c_active() == kvt_crc32c_best_cpu();
}

/* This thread's bounce buffer, or NULL (out of memory). */
static uint8_t *thread_bounce(void)
{
    if (bounce_buf == NULL) {
        pthread_once(&bounce_once, bounce_make_key);
        void *p = NULL;
        if (!bounce_key_ok || posix_memalign(&p, 4096, KVT_PRIV_BYTES) != 0)
            return NULL;
        if (pthread_setspecific(bounce_key, p) != 0) {
            free(p);
            return NULL;
        }
        bounce_buf = p;
    }
    return bounce_buf;
}

/* This thread's bounce buffer for the fused copy, or NULL (path off, or out
 * of memory: the regular path). */
static uint8_t *crc_copy_bounce(void)
{
    return crc_copy_enabled() ? thread_bounce() : NULL;
}

/* Destination reuse. Non-temporal stores suit a cold destination (a CPU tier
 * of gigabytes, each load into another block of it) and not a cache-hot one:
 * into a buffer that a load wrote a moment ago and that still sits in the
 * last-level cache, the kernel's plain copy runs at cache speed (~28 us per
 * MiB here, against ~47 us for the fused copy to memory), and the helper or
 * inline CRC of it costs less than pushing it all out to memory. So every
 * buffered load records its destination range, and a checksummed one whose
 * range overlaps that of a buffered load followed by less than
 * KVT_COPY_REUSE_BYTES of other buffered loads takes the regular path
 * ("reused" in kvt_crc_copy_info). KVT_COPY_RING recent loads are kept: the
 * window is complete for blocks of >= 128 KiB (smaller ones see the last 256
 * loads only). One mutex, process-wide (a
 * staging buffer may be filled by any I/O thread); reset in a forked child. */
#define KVT_COPY_REUSE_BYTES (32ull << 20)
#define KVT_COPY_RING 256
static struct {
    pthread_mutex_t mu;
    uint64_t total; /* bytes of buffered loads recorded */
    unsigned next;
    struct {
        uintptr_t lo, hi;
        uint64_t end; /* `total` after this load */
    } r[KVT_COPY_RING];
} reuse = {.mu = PTHREAD_MUTEX_INITIALIZER};
static _Atomic uint64_t stat_copy_reused;
static pthread_once_t reuse_once = PTHREAD_ONCE_INIT;

static void reuse_atfork_child(void)
{
    pthread_mutex_init(&reuse.mu, NULL);
}

static void reuse_init(void)
{
    pthread_atfork(NULL, NULL, reuse_atfork_child);
}

/* Record a buffered load into [buf, buf + len). With `check`, 1 if that range
 * overlaps a recorded load followed by < KVT_COPY_REUSE_BYTES of loads. */
static int dest_note(const void *buf, size_t len, int check)
{
    pthread_once(&reuse_once, reuse_init);
    uintptr_t lo = (uintptr_t)buf, hi = lo + len;
    int hot = 0;
    pthread_mutex_lock(&reuse.mu);
    for (unsigned i = 0; check && !hot && i < KVT_COPY_RING; i++)
        hot = reuse.r[i].hi > lo && reuse.r[i].lo < hi && reuse.total - reuse.r[i].end < KVT_COPY_REUSE_BYTES;
    reuse.total += len;
    reuse.r[reuse.next].lo = lo;
    reuse.r[reuse.next].hi = hi;
    reuse.r[reuse.next].end = reuse.total;
    reuse.next = (reuse.next + 1) % KVT_COPY_RING;
    pthread_mutex_unlock(&reuse.mu);
    return hot;
}

/* See fs_io.h. */
void kvt_crc_copy_info(kvt_crc_copy_stats *out)
{
    out->kernel = kvt_crc32c_copy_best()->name;
    out->enabled = crc_copy_enabled();
    out->blocks = atomic_load(&stat_copy_blocks);
    out->bytes = atomic_load(&stat_copy_bytes);
    out->reused = atomic_load(&stat_copy_reused);
}

/* See fs_io.h. */
int kvt_crc_copy_dest_reused(const void *buf, size_t len, int checksummed)
{
    int hot = dest_note(buf, len, checksummed && crc_copy_enabled());
    if (hot)
        atomic_fetch_add_explicit(&stat_copy_reused, 1, memory_order_relaxed);
    return hot;
}

/* How a private-buffer load moves each piece into the caller's buffer. */
enum { MOVE_COPY = 0, MOVE_FUSED = 1, MOVE_CRC_COPY = 2 };

/* The data loop of a load through the private per-thread buffer `priv`:
 * each piece of at most `piece` bytes is read into it (O_DIRECT when
 * *direct), then moved into the caller's buffer: with the fused copy + CRC
 * (MOVE_FUSED), checksummed there by the active backend and then copied
 * (MOVE_CRC_COPY: a re-read, a forced backend), or copied (MOVE_COPY). With
 * a job state each move is a commit section (job_state.h): a job that is no
 * longer LIVE stops the load before a byte of the piece is written (ETIMEDOUT).
 * Returns 0 with *crc, or an errno value (*remove = 1 for a short read). */
static int read_copy(int fd, uint8_t *buf, size_t len, uint8_t *priv, size_t piece, int *direct, int move,
                     kvt_job_state *js, uint32_t *crc, int *remove)
{
    uint32_t c = 0;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < piece ? len - off : piece;
        ssize_t r = read_full(fd, priv, n, off, direct);
        if (r < 0 || (size_t)r < n) {
            if (r >= 0)
                *remove = 1; /* shrank after fstat: short read */
            return r < 0 ? errno : EIO;
        }
        if (!kvt_job_commit_begin(js))
            return ETIMEDOUT; /* expired: not a byte of this piece enters buf */
        if (move == MOVE_FUSED) {
            c = kvt_crc32c_copy(c, buf + off, priv, n);
        } else {
            if (move == MOVE_CRC_COPY)
                c = kvt_crc32c(c, priv, n);
            memcpy(buf + off, priv, n);
        }
        kvt_job_commit_end(js);
        off += n;
    }
    if (move == MOVE_FUSED) {
        atomic_fetch_add_explicit(&stat_copy_blocks, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&stat_copy_bytes, len, memory_order_relaxed);
    }
    *crc = c;
    return 0;
}

/* Read the record (with `checksum`) and the data of an open block of the
 * right size. Returns 0 with *mismatch = 1 for a CRC mismatch or malformed
 * record, 0 with *mismatch = 0 when good (or legacy), or an errno value
 * (*remove = 1 when the file proved corrupt: short read). */
static int read_verify(int fd, uint8_t *buf, size_t len, int use_o_direct, size_t mem_align, size_t off_align,
                       int checksum, size_t batch_rest, int reread, kvt_job_state *js, int *mismatch, int *remove)
{
    *mismatch = 0;
    /* Record first: a legacy block (ENODATA) needs no CRC at all. */
    int have_rec = 0;
    uint32_t want = 0;
    if (checksum) {
        uint8_t rec[KVT_XATTR_BUF];
        ssize_t r = fgetxattr_r(fd, KVT_XATTR_NAME, rec, sizeof rec);
        int xerr = r < 0 ? errno : 0;
        switch (kvt_xattr_parse(rec, (long)r, xerr, &want)) {
        case KVT_REC_OK:
            have_rec = 1;
            break;
        case KVT_REC_ABSENT: /* ENODATA: legacy block stored without checksum, accept */
            break;
        case KVT_REC_MALFORMED: /* wrong length, or longer than the buffer (ERANGE) */
            *mismatch = 1;
            return 0;
        default: /* EOPNOTSUPP, EIO, ...: not the block's fault, keep */
            return xerr;
        }
    }

    /* The re-read after a mismatch is checksummed in a private buffer: the
     * caller's buffer may be written by another of its threads meanwhile (a
     * caller bug), and a block is condemned only on bytes nobody else can
     * touch. Buffered, through this thread's bounce buffer. */
    if (js != NULL) {
        /* Under a job state every byte lands in private memory first and
         * enters buf only in commit sections (job_state.h): O_DIRECT pieces of
         * up to KVT_PRIV_BYTES DMA'd into the private buffer, buffered ones
         * KVT_IO_CHUNK at a time (cache-resident), each then moved with the
         * fused copy + CRC, which is the verify pass. */
        uint8_t *pbuf = thread_bounce();
        if (pbuf == NULL)
            return ENOMEM;
        int pdirect = 0;
        if (!reread && use_o_direct && dio_usable(pbuf, len, mem_align, off_align))
            pdirect = set_direct(fd, 1) == 0;
        else if (reread)
            set_direct(fd, 0);
        int move = !have_rec ? MOVE_COPY : (!reread && crc_copy_enabled()) ? MOVE_FUSED : MOVE_CRC_COPY;
        uint32_t got = 0;
        int err = read_copy(fd, buf, len, pbuf, pdirect ? KVT_PRIV_BYTES : KVT_IO_CHUNK, &pdirect, move, js, &got,
                            remove);
        if (err == 0 && have_rec && got != want)
            *mismatch = 1;
        return err;
    }
    uint8_t *priv = reread && have_rec ? thread_bounce() : NULL;
    int direct = 0;
    if (!priv && use_o_direct && dio_usable(buf, len, mem_align, off_align))
        direct = set_direct(fd, 1) == 0;
    else if (fcntl(fd, F_GETFL) & O_DIRECT)
        set_direct(fd, 0);
    /* Every buffered load records its destination (the reuse rule); a
     * checksummed first read whose destination was not loaded into recently
     * goes through the fused copy, a re-read through the private buffer. */
    uint8_t *bounce = priv;
    if (!direct) {
        int reused = kvt_crc_copy_dest_reused(buf, len, have_rec && !priv);
        if (have_rec && !priv && !reused)
            bounce = crc_copy_bounce();
    }
    if (bounce) {
        uint32_t got = 0;
        int err = read_copy(fd, buf, len, bounce, KVT_IO_CHUNK, &direct, bounce != priv ? MOVE_FUSED : MOVE_CRC_COPY,
                            NULL, &got, remove);
        if (err == 0 && got != want)
            *mismatch = 1;
        return err;
    }
    kvt_crc_ctx crc;
    if (have_rec)
        crc_begin(&crc, buf, len, direct ? 0 : batch_rest); /* overlap only page-cache copies */
    const size_t chunk = KVT_IO_CHUNK;
    for (size_t off = 0; off < len;) {
        size_t n = len - off < chunk ? len - off : chunk;
        ssize_t r = read_full(fd, buf + off, n, off, &direct);
        if (r < 0 || (size_t)r < n) {
            int err = r < 0 ? errno : EIO;
            if (r >= 0)
                *remove = 1; /* shrank after fstat: short read */
            if (have_rec)
                crc_cancel(&crc);
            return err;
        }
        if (have_rec)
            crc_ready(&crc, off + n); /* CRC this chunk while the next one is read */
        off += n;
    }
    if (have_rec && crc_finish(&crc) != want)
        *mismatch = 1;
    return 0;
}

/* See fs_io.h. */
int kvt_xattr_parse(const void *rec, long r, int err, uint32_t *crc)
{
    if (r < 0) {
        if (err == ENODATA)
            return KVT_REC_ABSENT;
        if (err == ERANGE)
            return KVT_REC_MALFORMED;
        return KVT_REC_ERROR;
    }
    if (r != KVT_XATTR_LEN)
        return KVT_REC_MALFORMED;
    *crc = get_be32((const uint8_t *)rec);
    return KVT_REC_OK;
}

/* 1 if the open file's xattr record is a well-formed CRC32C that matches all
 * `size` bytes of the file (read through a scratch buffer, so any size works).
 * Used only on the wrong-size error path, to tell a caller's block-size
 * mismatch (intact block: keep it) from a truncated or grown file (remove). */
static int whole_file_verifies(int fd, uint64_t size)
{
    uint8_t rec[KVT_XATTR_BUF];
    uint32_t want;
    ssize_t r = fgetxattr(fd, KVT_XATTR_NAME, rec, sizeof rec);
    if (kvt_xattr_parse(rec, (long)r, r < 0 ? errno : 0, &want) != KVT_REC_OK)
        return 0;
    uint8_t *buf = malloc(KVT_IO_CHUNK);
    if (!buf)
        return 0;
    uint32_t crc = 0;
    uint64_t off = 0;
    int direct = 0;
    while (off < size) {
        size_t n = size - off < KVT_IO_CHUNK ? (size_t)(size - off) : KVT_IO_CHUNK;
        ssize_t got = read_full(fd, buf, n, off, &direct);
        if (got != (ssize_t)n)
            break;
        crc = kvt_crc32c(crc, buf, n);
        off += n;
    }
    free(buf);
    return off == size && crc == want;
}

/* Remove `path` only if it is still the file open as `fd`: a peer that
 * republished a good block under the same name meanwhile keeps it. */
static void unlink_if_same(const char *path, int fd)
{
    struct stat a, b;
    if (fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev)
        unlink(path);
}

/* Load one block. Returns 0, or an errno value with *checksum_failed set for
 * a CRC mismatch / malformed record. A first mismatch is retried once (the
 * page cache dropped, record and data re-read) to tell a transient glitch
 * from a bad block; a second condemns it. Removes the file when condemned
 * or of the wrong size (the table in design.md). *retried = 1 if re-read. */
static int load_one(const char *src, uint8_t *buf, size_t len, int use_o_direct, int checksum, size_t batch_rest,
                    kvt_job_state *js, int *checksum_failed, int *retried)
{
    *checksum_failed = 0;
    *retried = 0;
    if (!kvt_job_live(js))
        return ETIMEDOUT; /* expired before this block began */
    /* O_NOFOLLOW: a block is never a symlink (ELOOP, kept: nothing outside the
     * cache is read or removed). O_NONBLOCK: a FIFO or device at a block path
     * must not block the batch; a regular file ignores it. */
    int fd = open_r(src, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0)
        return errno;

    int err = 0;
    int remove = 0;
    uint64_t size;
    size_t mem_align, off_align;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        err = errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) { /* not ours to judge or remove: kept */
        err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        goto out;
    }
    if (file_info(fd, &size, &mem_align, &off_align) != 0) {
        err = errno;
        goto out;
    }
    if (size != (uint64_t)len) {
        err = EIO; /* truncated, empty or longer: corrupt ... */
        /* ... unless its own record proves its bytes intact: then the caller asked
         * for another block size (a layout mismatch), and the block is kept. */
        remove = !(checksum && whole_file_verifies(fd, size));
        goto out;
    }
    for (int attempt = 0;; attempt++) {
        int mismatch = 0;
        err = read_verify(fd, buf, len, use_o_direct, mem_align, off_align, checksum, batch_rest, attempt > 0, js,
                          &mismatch, &remove);
        if (err || !mismatch)
            break;
        atomic_fetch_add(&stat_retries, attempt == 0);
        if (attempt == 1) {
            atomic_fetch_add(&stat_condemned, 1);
            *checksum_failed = 1;
            err = EBADMSG;
            remove = 1;
            break;
        }
        *retried = 1;
        posix_fadvise(fd, 0, (off_t)len, POSIX_FADV_DONTNEED); /* re-read from the device */
    }

out:
    if (remove)
        unlink_if_same(src, fd);
    close_r(fd); /* read-only: nothing deferred to report */
    return err;
}

int kvt_batch_load(const char *const *src_paths, void *const *bufs, const size_t *lens, size_t n, int use_o_direct,
                   int checksum, kvt_job_state *js, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    res->retried = 0;
    size_t rest = 0; /* bytes left in the batch (a helper wake-up pays off for many) */
    for (size_t i = 0; i < n; i++)
        rest = lens[i] > SIZE_MAX - rest ? SIZE_MAX : rest + lens[i];
    for (size_t i = 0; i < n; i++) {
        int cf = 0, retried = 0;
        int e = load_one(src_paths[i], (uint8_t *)bufs[i], lens[i], use_o_direct, checksum, rest, js, &cf, &retried);
        rest -= rest == SIZE_MAX ? 0 : lens[i];
        res->retried += (size_t)retried;
        if (e) {
            set_fail(res, e, i, cf);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Lookup                                                              */
/* ------------------------------------------------------------------ */

void kvt_batch_lookup(const char *const *paths, size_t n, uint8_t *out)
{
    struct stat st;
    for (size_t i = 0; i < n; i++)
        out[i] = stat(paths[i], &st) == 0;
}
