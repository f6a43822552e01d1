/* DSA engine: CRCGEN and COPY_CRC descriptors over a portal (real WQ or the
 * software model), completion polling, page-fault resume, CPU redo (with the
 * CPU CRC function the engine's creator hands in), the min-size gate, the
 * enable-time self-check, counters. The process-wide engines behind the
 * "dsa" and "dsa-model" CRC32C backends and their KVTIER_DSA* settings are
 * backend.c.
 *
 * Descriptor rules (design.md "DSA facts"):
 *  - flags CRAV|RCR always; BOF only if the WQ has block_on_fault=1; CC only
 *    on COPY_CRC and only if gen_cap has bit 0x4
 *  - completion record 32-B aligned, zeroed before submit, status read with
 *    acquire ordering; status & 0x7f: 1 success, 3 page fault -> resume with
 *    crc_seed = crc_val from bytes_completed, anything else -> CPU redo
 *  - crc_seed = previous standard CRC32C (0 to start) gives the standard value
 *  - transfers above max_transfer_size are split, chaining the seed
 *  - the completion record is engine-owned (pooled, 32-B aligned); every
 *    wait has a deadline (engine timeout, default 1 s): a descriptor the
 *    device never completes gets its record quarantined (never reused, the
 *    device may still write it), its work redone on the CPU, and the engine
 *    disabled with the reason "device stopped completing descriptors"
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "crc32c.h"
#include "dsa.h"

/* Layout the device depends on (linux/idxd.h; DSA spec descriptor and
 * completion record formats). */
_Static_assert(sizeof(struct dsa_hw_desc) == 64, "descriptor is 64 bytes");
_Static_assert(sizeof(struct dsa_completion_record) == 32, "completion record is 32 bytes");
_Static_assert(offsetof(struct dsa_hw_desc, completion_addr) == 8, "completion_addr at 8");
_Static_assert(offsetof(struct dsa_hw_desc, src_addr) == 16, "src_addr at 16");
_Static_assert(offsetof(struct dsa_hw_desc, dst_addr) == 24, "dst_addr at 24");
_Static_assert(offsetof(struct dsa_hw_desc, xfer_size) == 32, "xfer_size at 32");
_Static_assert(offsetof(struct dsa_hw_desc, crc_seed) == 40, "crc_seed at 40");
_Static_assert(offsetof(struct dsa_hw_desc, crc_rsvd) == 44, "crc_rsvd at 44");
_Static_assert(offsetof(struct dsa_completion_record, bytes_completed) == 4, "bytes_completed at 4");
_Static_assert(offsetof(struct dsa_completion_record, fault_addr) == 8, "fault_addr at 8");
_Static_assert(offsetof(struct dsa_completion_record, crc_val) == 16, "crc_val at 16");
_Static_assert(offsetof(kvt_dsa_op, desc) % 64 == 0, "descriptor 64-B aligned in the op");
_Static_assert(_Alignof(kvt_dsa_op) >= 64, "op aligned for the descriptor");

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

struct kvt_dsa_engine {
    char name[16];
    kvt_crc32c_fn cpu;    /* CPU redo (kvt_dsa_engine_create) */
    kvt_dsa_portal *portal;
    kvt_dsa_wq_info wq;
    unsigned in_flight;   /* atomic: descriptors submitted, completion not yet seen */
    size_t min_size;
    int wait_mode;
    long sleep_ns;
    int cache_control;
    int enabled;          /* atomic */
    char reason[400];
    kvt_dsa_selfcheck sc;
    uint64_t timeout_ns;  /* per-descriptor completion deadline */
    uint64_t selfcheck_timeout_ns;
    int dead;             /* atomic: a descriptor timed out (claimed by CAS 0->1) */
    int dead_ready;       /* atomic: dead_reason written (release) */
    char dead_reason[300];
    pthread_mutex_t pool_mu;
    struct comp_slot *pool; /* free completion records */
    kvt_dsa_counters c;   /* updated with __atomic builtins */
};

/* A completion record with its free-list link; 32-B aligned as the device
 * requires (DSA spec: completion record address alignment). */
struct comp_slot {
    _Alignas(32) struct dsa_completion_record rec;
    struct comp_slot *next;
};
_Static_assert(offsetof(struct comp_slot, rec) == 0, "record first in its slot");

/* Records (and self-check buffers) a device never completed: reachable,
 * never freed, never reused. */
static pthread_mutex_t g_abandoned_mu = PTHREAD_MUTEX_INITIALIZER;
static void **g_abandoned;

static void quarantine(void *p)
{
    void **slot = malloc(2 * sizeof(void *));
    pthread_mutex_lock(&g_abandoned_mu);
    if (slot) {
        slot[0] = p;
        slot[1] = g_abandoned;
        g_abandoned = slot;
    }
    pthread_mutex_unlock(&g_abandoned_mu);
}

#define CADD(e, field, v) __atomic_fetch_add(&(e)->c.field, (uint64_t)(v), __ATOMIC_RELAXED)

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *const STATUS_NAMES[128] = {
    [DSA_COMP_NONE] = "none",
    [DSA_COMP_SUCCESS] = "success",
    [DSA_COMP_SUCCESS_PRED] = "success_pred",
    [DSA_COMP_PAGE_FAULT_NOBOF] = "page_fault_nobof",
    [DSA_COMP_PAGE_FAULT_IR] = "page_fault_ir",
    [DSA_COMP_BATCH_FAIL] = "batch_fail",
    [DSA_COMP_BATCH_PAGE_FAULT] = "batch_page_fault",
    [DSA_COMP_DR_OFFSET_NOINC] = "dr_offset_noinc",
    [DSA_COMP_DR_OFFSET_ERANGE] = "dr_offset_erange",
    [DSA_COMP_DIF_ERR] = "dif_err",
    [DSA_COMP_BAD_OPCODE] = "bad_opcode",
    [DSA_COMP_INVALID_FLAGS] = "invalid_flags",
    [DSA_COMP_NOZERO_RESERVE] = "nozero_reserve",
    [DSA_COMP_XFER_ERANGE] = "xfer_erange",
    [DSA_COMP_DESC_CNT_ERANGE] = "desc_cnt_erange",
    [DSA_COMP_DR_ERANGE] = "dr_erange",
    [DSA_COMP_OVERLAP_BUFFERS] = "overlap_buffers",
    [DSA_COMP_DCAST_ERR] = "dcast_err",
    [DSA_COMP_DESCLIST_ALIGN] = "desclist_align",
    [DSA_COMP_INT_HANDLE_INVAL] = "int_handle_inval",
    [DSA_COMP_CRA_XLAT] = "cra_xlat",
    [DSA_COMP_CRA_ALIGN] = "cra_align",
    [DSA_COMP_ADDR_ALIGN] = "addr_align",
    [DSA_COMP_PRIV_BAD] = "priv_bad",
    [DSA_COMP_TRAFFIC_CLASS_CONF] = "traffic_class_conf",
    [DSA_COMP_PFAULT_RDBA] = "pfault_rdba",
    [DSA_COMP_HW_ERR1] = "hw_err1",
    [DSA_COMP_HW_ERR_DRB] = "hw_err_drb",
    [DSA_COMP_TRANSLATION_FAIL] = "translation_fail",
};

const char *kvt_dsa_status_name(int status)
{
    status &= 0x7f;
    return STATUS_NAMES[status] ? STATUS_NAMES[status] : NULL;
}

static const char *const WAIT_NAMES[] = {"spin", "yield", "sleep"};

const char *kvt_dsa_wait_name(int mode)
{
    return (mode >= 0 && mode <= KVT_DSA_WAIT_SLEEP) ? WAIT_NAMES[mode] : "?";
}

int kvt_dsa_wait_from_name(const char *name)
{
    for (int i = 0; i <= KVT_DSA_WAIT_SLEEP; i++)
        if (strcmp(name, WAIT_NAMES[i]) == 0)
            return i;
    return -1;
}

/* ------------------------------------------------------------------ */
/* Engine                                                              */
/* ------------------------------------------------------------------ */

kvt_dsa_engine *kvt_dsa_engine_create(const char *name, kvt_dsa_portal *portal,
                                      const kvt_dsa_wq_info *wq, kvt_crc32c_fn cpu)
{
    kvt_dsa_engine *e = calloc(1, sizeof *e);
    if (!e) {
        errno = ENOMEM;
        return NULL;
    }
    snprintf(e->name, sizeof e->name, "%s", name);
    e->cpu = cpu;
    e->portal = portal;
    e->wq = *wq;
    if (e->wq.size == 0)
        e->wq.size = 1;
    if (e->wq.max_transfer_size == 0 || e->wq.max_transfer_size > 0xFFFFFFFFu)
        e->wq.max_transfer_size = 0x80000000u; /* xfer_size is a 32-bit field */
    e->min_size = KVT_DSA_MIN_SIZE_DEFAULT;
    e->wait_mode = KVT_DSA_WAIT_YIELD;
    e->sleep_ns = 2000;
    e->cache_control = 1;
    e->timeout_ns = 1000000000ull;
    e->selfcheck_timeout_ns = 2000000000ull;
    pthread_mutex_init(&e->pool_mu, NULL);
    snprintf(e->reason, sizeof e->reason, "self-check not run");
    return e;
}

void kvt_dsa_engine_destroy(kvt_dsa_engine *e)
{
    if (!e)
        return;
    /* Every op waits for its descriptors or quarantines their records, so
     * no pooled record is in flight here. */
    if (e->portal)
        e->portal->ops->close(e->portal);
    for (struct comp_slot *c = e->pool, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    pthread_mutex_destroy(&e->pool_mu);
    free(e);
}

int kvt_dsa_engine_enabled(const kvt_dsa_engine *e)
{
    return e && __atomic_load_n(&e->enabled, __ATOMIC_ACQUIRE);
}
const char *kvt_dsa_engine_name(const kvt_dsa_engine *e) { return e->name; }
const char *kvt_dsa_engine_reason(const kvt_dsa_engine *e)
{
    return __atomic_load_n(&e->dead_ready, __ATOMIC_ACQUIRE) ? e->dead_reason : e->reason;
}
void kvt_dsa_engine_set_timeout(kvt_dsa_engine *e, uint64_t timeout_ns)
{
    if (timeout_ns > 0)
        __atomic_store_n(&e->timeout_ns, timeout_ns, __ATOMIC_RELAXED);
}
uint64_t kvt_dsa_engine_timeout(const kvt_dsa_engine *e)
{
    return __atomic_load_n(&e->timeout_ns, __ATOMIC_RELAXED);
}
void kvt_dsa_engine_set_selfcheck_timeout(kvt_dsa_engine *e, uint64_t timeout_ns)
{
    if (timeout_ns > 0)
        e->selfcheck_timeout_ns = timeout_ns;
}
int kvt_dsa_engine_dead(const kvt_dsa_engine *e)
{
    return __atomic_load_n(&e->dead_ready, __ATOMIC_ACQUIRE);
}

static struct dsa_completion_record *comp_get(kvt_dsa_engine *e)
{
    pthread_mutex_lock(&e->pool_mu);
    struct comp_slot *c = e->pool;
    if (c)
        e->pool = c->next;
    pthread_mutex_unlock(&e->pool_mu);
    if (!c)
        c = aligned_alloc(64, sizeof(struct comp_slot) < 64 ? 64 : sizeof(struct comp_slot));
    return c ? &c->rec : NULL;
}

/* Back to the pool: only once the device has written the record's status
 * (or it was never submitted). */
static void comp_put(kvt_dsa_op *op)
{
    if (!op->comp)
        return;
    struct comp_slot *c = (struct comp_slot *)op->comp;
    op->comp = NULL;
    kvt_dsa_engine *e = op->e;
    pthread_mutex_lock(&e->pool_mu);
    c->next = e->pool;
    e->pool = c;
    pthread_mutex_unlock(&e->pool_mu);
}

/* The device did not complete a descriptor in time: disable the engine
 * (later ops go to the CPU) and say why, once. */
static void mark_dead(kvt_dsa_engine *e, const char *what)
{
    int zero = 0;
    __atomic_store_n(&e->enabled, 0, __ATOMIC_RELEASE);
    if (!__atomic_compare_exchange_n(&e->dead, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return;
    snprintf(e->dead_reason, sizeof e->dead_reason,
             "device stopped completing descriptors (%s within %llu ms; completion record "
             "quarantined, CRC redone on the CPU); engine disabled, the CPU computes",
             what, (unsigned long long)(kvt_dsa_engine_timeout(e) / 1000000ull));
    __atomic_store_n(&e->dead_ready, 1, __ATOMIC_RELEASE);
}
const char *kvt_dsa_engine_portal_kind(const kvt_dsa_engine *e) { return e->portal->kind; }
void kvt_dsa_engine_wq(const kvt_dsa_engine *e, kvt_dsa_wq_info *out) { *out = e->wq; }
void kvt_dsa_engine_get_selfcheck(const kvt_dsa_engine *e, kvt_dsa_selfcheck *out) { *out = e->sc; }
void kvt_dsa_engine_set_min_size(kvt_dsa_engine *e, size_t min_size) { e->min_size = min_size; }
size_t kvt_dsa_engine_min_size(const kvt_dsa_engine *e) { return e->min_size; }
int kvt_dsa_engine_wait_mode(const kvt_dsa_engine *e) { return e->wait_mode; }
void kvt_dsa_engine_set_cache_control(kvt_dsa_engine *e, int on) { e->cache_control = on; }

void kvt_dsa_engine_set_wait(kvt_dsa_engine *e, int mode, long sleep_ns)
{
    if (mode >= KVT_DSA_WAIT_SPIN && mode <= KVT_DSA_WAIT_SLEEP)
        e->wait_mode = mode;
    if (sleep_ns > 0)
        e->sleep_ns = sleep_ns;
}

void kvt_dsa_engine_get_counters(const kvt_dsa_engine *e, kvt_dsa_counters *out)
{
    const uint64_t *src = (const uint64_t *)&e->c;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

void kvt_dsa_engine_reset_counters(kvt_dsa_engine *e)
{
    uint64_t *p = (uint64_t *)&e->c;
    for (size_t i = 0; i < sizeof e->c / sizeof(uint64_t); i++)
        __atomic_store_n(&p[i], 0, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ */
/* Operations                                                          */
/* ------------------------------------------------------------------ */

/* The CPU CRC of an op: its engine's; an op without engine (the caller
 * passed NULL) takes the table backend, which every build has. */
static kvt_crc32c_fn cpu_of(const kvt_dsa_engine *e)
{
    return e ? e->cpu : kvt_crc32c_table;
}

static void cpu_rest(kvt_dsa_op *op)
{
    size_t rem = op->len - op->done;
    if (rem) {
        if (op->opcode == DSA_OPCODE_COPY_CRC)
            memcpy(op->dst + op->done, op->src + op->done, rem);
        op->crc = cpu_of(op->e)(op->crc, op->src + op->done, rem);
        op->on_device = 0;
    }
    op->done = op->len;
    op->state = 0;
    comp_put(op); /* status written by the device, or never submitted */
}

static void wait_backoff(const kvt_dsa_engine *e, unsigned *spins)
{
    unsigned s = ++*spins;
    switch (e->wait_mode) {
    case KVT_DSA_WAIT_SPIN:
        cpu_relax();
        break;
    case KVT_DSA_WAIT_SLEEP:
        if (s < 16) {
            cpu_relax();
        } else {
            struct timespec ts = {0, e->sleep_ns};
            nanosleep(&ts, NULL);
        }
        break;
    default:
        if (s < 64)
            cpu_relax();
        else
            sched_yield();
        break;
    }
}

/* Submit the descriptor for the next chunk. 0, or -1 (submission failed). */
static int submit_chunk(kvt_dsa_op *op)
{
    kvt_dsa_engine *e = op->e;
    if (__atomic_load_n(&e->dead, __ATOMIC_ACQUIRE))
        return -1; /* a descriptor timed out: the device is not trusted any more */
    if (!op->comp && !(op->comp = comp_get(e))) {
        CADD(e, submit_failures, 1);
        return -1;
    }
    size_t rem = op->len - op->done;
    size_t chunk = rem < e->wq.max_transfer_size ? rem : (size_t)e->wq.max_transfer_size;
    op->chunk = chunk;

    memset(&op->desc, 0, sizeof op->desc);
    memset(op->comp, 0, sizeof *op->comp); /* status = 0 before submit */
    uint32_t flags = IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR;
    if (e->wq.block_on_fault)
        flags |= IDXD_OP_FLAG_BOF;
    if (op->opcode == DSA_OPCODE_COPY_CRC && e->cache_control &&
        (e->wq.gen_cap & KVT_DSA_GENCAP_CACHE_CONTROL))
        flags |= IDXD_OP_FLAG_CC;
    op->desc.opcode = (uint32_t)op->opcode;
    op->desc.flags = flags;
    op->desc.completion_addr = (uint64_t)(uintptr_t)op->comp;
    op->desc.src_addr = (uint64_t)(uintptr_t)(op->src + op->done);
    if (op->opcode == DSA_OPCODE_COPY_CRC)
        op->desc.dst_addr = (uint64_t)(uintptr_t)(op->dst + op->done);
    op->desc.xfer_size = (uint32_t)chunk;
    op->desc.crc_seed = op->crc;

    /* Dedicated WQ: MOVDIR64B to a full WQ loses the descriptor, so never
     * have more than `size` in flight. */
    unsigned spins = 0;
    if (e->wq.dedicated) {
        uint64_t deadline = 0;
        for (;;) {
            unsigned cur = __atomic_load_n(&e->in_flight, __ATOMIC_RELAXED);
            if (cur < e->wq.size &&
                __atomic_compare_exchange_n(&e->in_flight, &cur, cur + 1, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_RELAXED))
                break;
            wait_backoff(e, &spins);
            if ((spins & 63) == 0) {
                /* Slots held by descriptors that never complete: bounded too. */
                if (__atomic_load_n(&e->dead, __ATOMIC_ACQUIRE))
                    return -1;
                if (deadline == 0)
                    deadline = now_ns() + kvt_dsa_engine_timeout(e);
                else if (now_ns() > deadline) {
                    mark_dead(e, "no free dedicated WQ slot");
                    CADD(e, timeouts, 1);
                    return -1;
                }
            }
        }
    } else {
        __atomic_fetch_add(&e->in_flight, 1, __ATOMIC_ACQ_REL);
    }
    /* Make the zeroed completion record (and the source data) visible
     * before the device can see the descriptor. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    unsigned retries = 0;
    for (;;) {
        int r = e->portal->ops->submit(e->portal, &op->desc);
        if (r == KVT_DSA_SUBMIT_OK)
            break;
        if (r == KVT_DSA_SUBMIT_RETRY && retries < KVT_DSA_ENQCMD_RETRY_MAX) {
            retries++;
            CADD(e, enqcmd_retries, 1);
            if (retries < 16)
                cpu_relax();
            else
                sched_yield();
            continue;
        }
        __atomic_fetch_sub(&e->in_flight, 1, __ATOMIC_ACQ_REL);
        CADD(e, submit_failures, 1);
        return -1;
    }
    CADD(e, descriptors_submitted, 1);
    op->state = 1;
    return 0;
}

static void start(kvt_dsa_engine *e, kvt_dsa_op *op, int opcode, void *dst, const void *src,
                  size_t len, uint32_t seed, int force)
{
    op->e = e;
    op->comp = NULL;
    op->opcode = opcode;
    op->src = (const uint8_t *)src;
    op->dst = (uint8_t *)dst;
    op->len = len;
    op->done = 0;
    op->chunk = 0;
    op->crc = seed;
    op->state = 0;
    op->on_device = 0;
    op->dev_bytes = 0;
    op->last_status = 0;
    op->pf_no_progress = 0;
    if (dst && len && (uintptr_t)dst < (uintptr_t)src + len && (uintptr_t)src < (uintptr_t)dst + len) {
        /* Overlap: undefined for memcpy, OVERLAP_BUFFERS on the device. CRC
         * of the source as it is, then a memmove, all on the CPU. */
        op->crc = cpu_of(e)(op->crc, src, len);
        memmove(dst, src, len);
        op->done = len;
        return;
    }
    if (!e || len == 0 || (!force && !kvt_dsa_engine_enabled(e))) {
        cpu_rest(op);
        return;
    }
    if (!force && len < e->min_size) {
        CADD(e, below_min_size, 1);
        cpu_rest(op);
        return;
    }
    op->on_device = 1;
    if (submit_chunk(op) < 0)
        cpu_rest(op);
}

void kvt_dsa_crc_submit(kvt_dsa_engine *e, kvt_dsa_op *op, const void *buf, size_t len,
                        uint32_t seed)
{
    start(e, op, DSA_OPCODE_CRCGEN, NULL, buf, len, seed, 0);
}

void kvt_dsa_copy_crc_submit(kvt_dsa_engine *e, kvt_dsa_op *op, void *dst, const void *src,
                             size_t len, uint32_t seed)
{
    start(e, op, DSA_OPCODE_COPY_CRC, dst, src, len, seed, 0);
}

/* Make the faulting page present before resubmitting (BOF off: the device
 * does not fault pages in itself). Only addresses inside the op's buffers. */
static void touch_fault(kvt_dsa_op *op, uint64_t addr, int write)
{
    uintptr_t a = (uintptr_t)addr;
    if (write && op->dst && a >= (uintptr_t)op->dst && a < (uintptr_t)(op->dst + op->len))
        __atomic_fetch_add((uint8_t *)a, 0, __ATOMIC_RELAXED);
    else if (a >= (uintptr_t)op->src && a < (uintptr_t)(op->src + op->len))
        (void)*(volatile const uint8_t *)a;
}

/* Wait for the op, at most `timeout` ns per descriptor (from the start of
 * the wait for it). Returns 0, or -1 when a descriptor timed out: its
 * completion record is then quarantined (the device may still write it),
 * the rest of the op is redone on the CPU (op->crc is right either way),
 * counter `timeouts` grows and, with mark, the engine is disabled. */
static int wait_until(kvt_dsa_op *op, uint64_t timeout, int mark)
{
    if (op->state == 0)
        return 0;
    kvt_dsa_engine *e = op->e;
    uint64_t t0 = now_ns();
    while (op->state == 1) {
        const uint8_t *status_p = (const uint8_t *)op->comp;
        uint64_t deadline = now_ns() + timeout;
        unsigned spins = 0;
        uint8_t s;
        while ((s = __atomic_load_n(status_p, __ATOMIC_ACQUIRE)) == 0) {
            wait_backoff(e, &spins);
            if ((spins & 63) == 0 && now_ns() > deadline) {
                quarantine(op->comp); /* in_flight keeps counting it: it is */
                op->comp = NULL;
                CADD(e, timeouts, 1);
                CADD(e, cpu_redo_total, 1);
                if (mark)
                    mark_dead(e, "no completion record");
                cpu_rest(op);
                CADD(e, wait_ns, now_ns() - t0);
                return -1;
            }
        }
        __atomic_fetch_sub(&e->in_flight, 1, __ATOMIC_ACQ_REL);
        op->state = 0;
        int st = s & DSA_COMP_STATUS_MASK;
        op->last_status = st;
        if (st == DSA_COMP_SUCCESS) {
            CADD(e, completed_on_device, 1);
            CADD(e, bytes_on_device, op->chunk);
            op->dev_bytes += op->chunk;
            op->crc = (uint32_t)op->comp->crc_val;
            op->done += op->chunk;
            op->pf_no_progress = 0;
            if (op->done < op->len && submit_chunk(op) < 0)
                cpu_rest(op);
            continue;
        }
        if (st == DSA_COMP_PAGE_FAULT_NOBOF && op->comp->bytes_completed <= op->chunk) {
            uint32_t bc = op->comp->bytes_completed;
            if (bc) {
                op->crc = (uint32_t)op->comp->crc_val;
                op->done += bc;
                op->pf_no_progress = 0;
                CADD(e, bytes_on_device, bc);
                op->dev_bytes += bc;
            } else {
                op->pf_no_progress++;
            }
            if (op->pf_no_progress <= 4) {
                CADD(e, page_fault_resumes, 1);
                touch_fault(op, op->comp->fault_addr, (s & DSA_COMP_STATUS_WRITE) != 0);
                if (op->done < op->len && submit_chunk(op) < 0)
                    cpu_rest(op);
                continue;
            }
        }
        /* Anything else (or a fault that makes no progress): redo on the CPU. */
        if (st >= 0 && st < 128)
            CADD(e, cpu_redo_by_status[st], 1);
        CADD(e, cpu_redo_total, 1);
        cpu_rest(op);
    }
    comp_put(op);
    CADD(e, wait_ns, now_ns() - t0);
    return 0;
}

uint32_t kvt_dsa_wait(kvt_dsa_op *op)
{
    if (op->state)
        wait_until(op, kvt_dsa_engine_timeout(op->e), 1);
    return op->crc;
}

uint32_t kvt_dsa_crc(kvt_dsa_engine *e, uint32_t seed, const void *buf, size_t len)
{
    kvt_dsa_op op;
    kvt_dsa_crc_submit(e, &op, buf, len, seed);
    return kvt_dsa_wait(&op);
}

/* See dsa.h. The counts come from what the op's completion records said
 * (op.dev_bytes): a refused, failed or timed-out descriptor's bytes are CPU
 * bytes, never offloaded ones. */
int kvt_dsa_commit_copy_crc(kvt_dsa_engine *e, void *dst, const void *src, size_t len, uint32_t *crc)
{
    if (len < e->min_size)
        return 0; /* below the gate: the CPU copy, the CRC counted below_min_size */
    kvt_dsa_op op;
    kvt_dsa_copy_crc_submit(e, &op, dst, src, len, *crc);
    *crc = kvt_dsa_wait(&op);
    CADD(e, commit_ops, 1);
    CADD(e, commit_bytes_on_device, op.dev_bytes);
    CADD(e, commit_bytes_cpu, len - op.dev_bytes);
    return 1;
}

uint32_t kvt_dsa_copy_crc(kvt_dsa_engine *e, void *dst, const void *src, size_t len, uint32_t seed)
{
    kvt_dsa_op op;
    kvt_dsa_copy_crc_submit(e, &op, dst, src, len, seed);
    return kvt_dsa_wait(&op);
}

/* ------------------------------------------------------------------ */
/* Self-check                                                          */
/* ------------------------------------------------------------------ */

/* Anonymous mapping with every page populated for write: a device touching
 * an unpopulated page stalls on an IOMMU page request (CacheLib measured it). */
static void *populated(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    if (madvise(p, n, MADV_POPULATE_WRITE) != 0) {
        for (size_t i = 0; i < n; i += 4096)
            ((volatile uint8_t *)p)[i] = 0;
    }
    return p;
}

static const char *sname(int st)
{
    const char *n = kvt_dsa_status_name(st);
    return n ? n : "unknown";
}

#define APPEND(...)                                                        \
    do {                                                                   \
        size_t l_ = strlen(e->reason);                                     \
        snprintf(e->reason + l_, sizeof e->reason - l_, __VA_ARGS__);      \
    } while (0)

int kvt_dsa_engine_selfcheck(kvt_dsa_engine *e)
{
    const size_t n = KVT_DSA_SELFCHECK_SIZE;
    memset(&e->sc, 0, sizeof e->sc);
    e->enabled = 0;
    uint8_t *src = populated(n), *dst = populated(n);
    /* The completion record is engine-owned (quarantined on a timeout); the
     * buffers are leaked rather than unmapped if the device never answers. */
    kvt_dsa_op opv, *op = &opv;
    if (!src || !dst) {
        snprintf(e->reason, sizeof e->reason, "self-check: cannot allocate 2 x 1 MiB: %s",
                 strerror(errno));
        if (src)
            munmap(src, n);
        if (dst)
            munmap(dst, n);
        return 0;
    }
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(src + i, &x, 8);
    }
    memset(dst, 0xA5, n);
    static const char check[] = "123456789";
    uint32_t ref = e->cpu(0, src, n);
    uint64_t timeout = e->selfcheck_timeout_ns;
    e->sc.ran = 1;
    snprintf(e->reason, sizeof e->reason, "self-check failed:");

    start(e, op, DSA_OPCODE_CRCGEN, NULL, src, n, 0, 1);
    if (wait_until(op, timeout, 0) < 0)
        goto timeout;
    uint32_t c1 = op->crc;
    e->sc.crcgen_on_device = op->on_device;
    e->sc.crcgen_status = op->last_status;
    /* also the standard check value through a single small descriptor */
    start(e, op, DSA_OPCODE_CRCGEN, NULL, check, 9, 0, 1);
    if (wait_until(op, timeout, 0) < 0)
        goto timeout;
    e->sc.crcgen_on_device &= op->on_device;
    e->sc.crcgen_match = c1 == ref && op->crc == 0xE3069283u;

    start(e, op, DSA_OPCODE_COPY_CRC, dst, src, n, 0, 1);
    if (wait_until(op, timeout, 0) < 0)
        goto timeout;
    e->sc.copy_on_device = op->on_device;
    e->sc.copy_status = op->last_status;
    e->sc.copy_match = op->crc == ref && memcmp(src, dst, n) == 0;
    munmap(src, n);
    munmap(dst, n);

    if (e->sc.crcgen_on_device && e->sc.crcgen_match && e->sc.copy_on_device && e->sc.copy_match) {
        __atomic_store_n(&e->enabled, 1, __ATOMIC_RELEASE);
        snprintf(e->reason, sizeof e->reason, "self-check passed (CRCGEN and COPY_CRC on 1 MiB)");
        return 1;
    }
    if (!e->sc.crcgen_on_device)
        APPEND(" CRCGEN not completed on the device (status 0x%02x %s, redone on the CPU);",
               e->sc.crcgen_status, sname(e->sc.crcgen_status));
    if (!e->sc.crcgen_match)
        APPEND(" CRCGEN result differs from the CPU;");
    if (!e->sc.copy_on_device)
        APPEND(" COPY_CRC not completed on the device (status 0x%02x %s, redone on the CPU);",
               e->sc.copy_status, sname(e->sc.copy_status));
    if (!e->sc.copy_match)
        APPEND(" COPY_CRC result or copied bytes differ from the CPU;");
    return 0;

timeout:
    /* The record is quarantined by wait_until; the buffers stay mapped
     * (reachable, never reused) since the device may still use them. */
    quarantine(src);
    quarantine(dst);
    APPEND(" no completion within %llu ms (completion record and buffers leaked, never reused);",
           (unsigned long long)(timeout / 1000000ull));
    e->sc.crcgen_on_device = e->sc.copy_on_device = 0;
    return 0;
}

