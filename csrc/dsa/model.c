/* Software model of a DSA work queue + engine.
 *
 * It is a drop-in kvt_dsa_portal: submit() copies the 64-byte struct
 * dsa_hw_desc into the WQ (like MOVDIR64B / ENQCMD do), and the model's own
 * thread executes it with device semantics and writes the completion record
 * at desc->completion_addr, every field first and `status` last with release
 * ordering, as the device does. It never reports itself as hardware: the
 * backend built on it is called "dsa-model".
 *
 * Semantics modelled (DSA architecture spec; status codes from
 * <linux/idxd.h> DSA_COMP_*):
 *  - opcodes MEMMOVE, CRCGEN, COPY_CRC (NOOP completes); others BAD_OPCODE
 *  - reserved fields must be zero (NOZERO_RESERVE)
 *  - BOF on a WQ without block_on_fault, CC on CRCGEN or without gen_cap
 *    bit 2, undefined flags -> INVALID_FLAGS with the offending bits in
 *    invalid_flags
 *  - xfer_size > max_transfer_size -> XFER_ERANGE
 *  - CRC: crc_val = ~raw(data, init = ~crc_seed)
 *  - page fault without BOF: partial work, bytes_completed, fault_addr,
 *    crc_val = CRC of the completed part, status PAGE_FAULT_NOBOF
 *    (| DSA_COMP_STATUS_WRITE for a fault on the destination)
 *  - dedicated WQ: a descriptor arriving at a full WQ is lost (counted);
 *    shared WQ: ENQCMD is refused (ZF=1)
 *  - injected "hang": descriptors accepted and never completed (a WQ the
 *    admin disabled, a hung device), or completed late
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "crc32c.h"
#include "dsa.h"

struct kvt_dsa_model {
    kvt_dsa_portal base; /* first: the model is its own portal */
    kvt_dsa_model_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct dsa_hw_desc *ring;
    unsigned head, count;
    int stop;
    pthread_t thread;
    /* injected faults (under mu) */
    uint64_t f_enqcmd;
    uint64_t f_pf_count, f_pf_offset;
    uint64_t f_bof, f_cc, f_stale;
    uint64_t f_xfer_count, f_xfer_max;
    uint64_t f_reject_count;
    int f_reject_status;
    uint64_t f_hang_count, f_hang_late_ns;
    kvt_dsa_model_stats st;
};

/* The model's CRC engine: the raw register over the table backend, so the
 * device arithmetic does not share code with the CPU redo path (sse42/isal). */
static uint32_t raw_crc(const void *p, size_t n, uint32_t init)
{
    return ~kvt_crc32c_table(~init, p, n);
}

static uint32_t device_crc(uint32_t seed, const void *p, size_t n)
{
    return ~raw_crc(p, n, ~seed);
}

typedef struct {
    int pf;
    uint64_t pf_offset;
    int bof, cc, stale;
    int xfer;
    uint64_t xfer_max;
    int reject;
    int reject_status;
    int hang;
    uint64_t hang_late_ns;
} taken_faults;

static void complete(struct dsa_completion_record *c, int status, uint32_t bytes,
                     uint64_t fault_addr, uint64_t crc, uint32_t invalid_flags)
{
    c->result = 0;
    c->rsvd = 0;
    c->bytes_completed = bytes;
    c->fault_addr = fault_addr;
    memset(c->op_specific, 0, sizeof c->op_specific);
    if (invalid_flags)
        c->invalid_flags = invalid_flags;
    else
        c->crc_val = crc;
    __atomic_store_n((uint8_t *)c, (uint8_t)status, __ATOMIC_RELEASE);
}

#define ALLOWED_FLAGS                                                                     \
    (IDXD_OP_FLAG_FENCE | IDXD_OP_FLAG_BOF | IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR |          \
     IDXD_OP_FLAG_CC | IDXD_OP_FLAG_STORD | IDXD_OP_FLAG_ADDR1_TCS | IDXD_OP_FLAG_ADDR2_TCS | \
     IDXD_OP_FLAG_ADDR3_TCS | IDXD_OP_FLAG_CR_TCS)

static void execute(kvt_dsa_model *m, struct dsa_hw_desc *d, const taken_faults *f)
{
    m->st.executed++; /* only the model thread writes it */
    if (!(d->flags & IDXD_OP_FLAG_CRAV) || d->completion_addr == 0)
        return; /* no completion record requested: nothing observable */
    struct dsa_completion_record *c = (struct dsa_completion_record *)(uintptr_t)d->completion_addr;
    if (f->hang) {
        __atomic_fetch_add(&m->st.hung, 1, __ATOMIC_RELAXED);
        if (f->hang_late_ns == 0)
            return; /* swallowed: never completed */
        /* A device coming back late writes the record software gave up on
         * (no data touched: the caller's buffers may be gone by now). */
        struct timespec ts = {(time_t)(f->hang_late_ns / 1000000000ull),
                              (long)(f->hang_late_ns % 1000000000ull)};
        nanosleep(&ts, NULL);
        complete(c, DSA_COMP_SUCCESS, d->xfer_size, 0, 0xDEADBEEFu, 0);
        return;
    }
    if (d->completion_addr & 31) {
        complete(c, DSA_COMP_CRA_ALIGN, 0, 0, 0, 0);
        return;
    }
    if (f->reject) {
        complete(c, f->reject_status, 0, 0, 0,
                 f->reject_status == DSA_COMP_INVALID_FLAGS ? (d->flags ? d->flags : 1) : 0);
        return;
    }
    if (f->bof)
        d->flags |= IDXD_OP_FLAG_BOF;
    if (f->cc)
        d->flags |= IDXD_OP_FLAG_CC;
    if (f->stale)
        d->crc_rsvd = 0x5a5a5a5au;

    unsigned op = d->opcode;
    if (op != DSA_OPCODE_NOOP && op != DSA_OPCODE_MEMMOVE && op != DSA_OPCODE_CRCGEN &&
        op != DSA_OPCODE_COPY_CRC) {
        complete(c, DSA_COMP_BAD_OPCODE, 0, 0, 0, 0);
        return;
    }
    int reserved_dirty = d->rsvd != 0 || d->rsvd1 != 0 || d->int_handle != 0;
    if (op == DSA_OPCODE_CRCGEN || op == DSA_OPCODE_COPY_CRC)
        reserved_dirty |= d->crc_rsvd != 0 || d->seed_addr != 0;
    if (op == DSA_OPCODE_CRCGEN)
        reserved_dirty |= d->dst_addr != 0;
    if (reserved_dirty) {
        complete(c, DSA_COMP_NOZERO_RESERVE, 0, 0, 0, 0);
        return;
    }
    uint32_t bad = d->flags & ~(uint32_t)ALLOWED_FLAGS;
    if ((d->flags & IDXD_OP_FLAG_BOF) && !m->cfg.block_on_fault)
        bad |= IDXD_OP_FLAG_BOF;
    if ((d->flags & IDXD_OP_FLAG_CC) &&
        (op == DSA_OPCODE_CRCGEN || op == DSA_OPCODE_NOOP ||
         !(m->cfg.gen_cap & KVT_DSA_GENCAP_CACHE_CONTROL)))
        bad |= IDXD_OP_FLAG_CC;
    if (bad) {
        complete(c, DSA_COMP_INVALID_FLAGS, 0, 0, 0, bad);
        return;
    }
    if (op == DSA_OPCODE_NOOP) {
        complete(c, DSA_COMP_SUCCESS, 0, 0, 0, 0);
        return;
    }
    uint64_t max = m->cfg.max_transfer_size;
    if (f->xfer && f->xfer_max < max)
        max = f->xfer_max;
    if (d->xfer_size > max) {
        complete(c, DSA_COMP_XFER_ERANGE, 0, 0, 0, 0);
        return;
    }

    if (m->cfg.latency_ns) {
        struct timespec ts = {0, (long)m->cfg.latency_ns};
        nanosleep(&ts, NULL);
    }

    const uint8_t *src = (const uint8_t *)(uintptr_t)d->src_addr;
    uint8_t *dst = (uint8_t *)(uintptr_t)d->dst_addr;
    size_t n = d->xfer_size;
    int status = DSA_COMP_SUCCESS;
    uint64_t fault_addr = 0;
    if (f->pf && f->pf_offset < n) {
        if (d->flags & IDXD_OP_FLAG_BOF) {
            __atomic_fetch_add(&m->st.faults_resolved, 1, __ATOMIC_RELAXED);
        } else {
            __atomic_fetch_add(&m->st.faults_injected, 1, __ATOMIC_RELAXED);
            n = (size_t)f->pf_offset;
            status = DSA_COMP_PAGE_FAULT_NOBOF;
            if (op == DSA_OPCODE_CRCGEN) {
                fault_addr = d->src_addr + n;
            } else {
                status |= DSA_COMP_STATUS_WRITE;
                fault_addr = d->dst_addr + n;
            }
        }
    }
    uint64_t crc = 0;
    switch (op) {
    case DSA_OPCODE_MEMMOVE:
        memmove(dst, src, n);
        break;
    case DSA_OPCODE_CRCGEN:
        crc = device_crc(d->crc_seed, src, n);
        break;
    case DSA_OPCODE_COPY_CRC:
        memcpy(dst, src, n);
        crc = device_crc(d->crc_seed, src, n);
        break;
    }
    complete(c, status, (uint32_t)n, fault_addr, crc, 0);
}

static int take(uint64_t *counter)
{
    if (*counter == 0)
        return 0;
    if (*counter != UINT64_MAX)
        (*counter)--;
    return 1;
}

static void *model_thread(void *arg)
{
    kvt_dsa_model *m = arg;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (m->count == 0 && !m->stop)
            pthread_cond_wait(&m->cv, &m->mu);
        if (m->count == 0 && m->stop)
            break;
        struct dsa_hw_desc d = m->ring[m->head];
        m->head = (m->head + 1) % m->cfg.size;
        m->count--;
        taken_faults f = {0};
        f.hang = take(&m->f_hang_count);
        f.hang_late_ns = m->f_hang_late_ns;
        if (!f.hang)
            f.reject = take(&m->f_reject_count);
        f.reject_status = m->f_reject_status;
        if (d.opcode != DSA_OPCODE_NOOP && !f.reject && !f.hang) {
            /* A page fault needs a transfer long enough to reach the byte. */
            if (m->f_pf_count && m->f_pf_offset < d.xfer_size) {
                f.pf = take(&m->f_pf_count);
                f.pf_offset = m->f_pf_offset;
            }
            f.bof = take(&m->f_bof);
            f.cc = take(&m->f_cc);
            f.stale = take(&m->f_stale);
            f.xfer = take(&m->f_xfer_count);
            f.xfer_max = m->f_xfer_max;
        }
        pthread_mutex_unlock(&m->mu);
        execute(m, &d, &f);
        pthread_mutex_lock(&m->mu);
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

static int model_submit(kvt_dsa_portal *p, const struct dsa_hw_desc *desc)
{
    kvt_dsa_model *m = (kvt_dsa_model *)p;
    pthread_mutex_lock(&m->mu);
    if (m->cfg.shared && take(&m->f_enqcmd)) {
        m->st.enqcmd_rejected++;
        pthread_mutex_unlock(&m->mu);
        return KVT_DSA_SUBMIT_RETRY;
    }
    if (m->count == m->cfg.size) {
        int r = KVT_DSA_SUBMIT_OK;
        if (m->cfg.shared) {
            m->st.enqcmd_rejected++;
            r = KVT_DSA_SUBMIT_RETRY;
        } else {
            m->st.dropped++; /* MOVDIR64B to a full dedicated WQ: lost */
        }
        pthread_mutex_unlock(&m->mu);
        return r;
    }
    memcpy(&m->ring[(m->head + m->count) % m->cfg.size], desc, sizeof *desc);
    m->count++;
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->mu);
    return KVT_DSA_SUBMIT_OK;
}

static void model_close(kvt_dsa_portal *p) { kvt_dsa_model_destroy((kvt_dsa_model *)p); }

static const kvt_dsa_portal_ops MODEL_OPS = {model_submit, model_close};

kvt_dsa_model *kvt_dsa_model_create(const kvt_dsa_model_config *cfg)
{
    kvt_dsa_model *m = calloc(1, sizeof *m);
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    if (cfg)
        m->cfg = *cfg;
    if (m->cfg.size == 0)
        m->cfg.size = 32;
    if (m->cfg.max_transfer_size == 0)
        m->cfg.max_transfer_size = 2u << 20;
    if (m->cfg.max_transfer_size > 0xFFFFFFFFu) {
        free(m);
        errno = EINVAL;
        return NULL;
    }
    if (!cfg)
        m->cfg.gen_cap = KVT_DSA_GENCAP_CACHE_CONTROL | KVT_DSA_GENCAP_BLOCK_ON_FAULT;
    m->ring = calloc(m->cfg.size, sizeof *m->ring);
    if (!m->ring) {
        free(m);
        errno = ENOMEM;
        return NULL;
    }
    m->base.ops = &MODEL_OPS;
    m->base.kind = "model";
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    int rc = pthread_create(&m->thread, NULL, model_thread, m);
    if (rc) {
        free(m->ring);
        free(m);
        errno = rc;
        return NULL;
    }
    return m;
}

void kvt_dsa_model_destroy(kvt_dsa_model *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->stop = 1;
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->mu);
    pthread_join(m->thread, NULL);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m->ring);
    free(m);
}

kvt_dsa_portal *kvt_dsa_model_portal(kvt_dsa_model *m) { return &m->base; }

void kvt_dsa_model_wq_info(const kvt_dsa_model *m, kvt_dsa_wq_info *w)
{
    memset(w, 0, sizeof *w);
    strcpy(w->name, "model");
    strcpy(w->device, "model");
    strcpy(w->path, "(software model)");
    strcpy(w->state, "enabled");
    strcpy(w->type, "user");
    strcpy(w->mode, m->cfg.shared ? "shared" : "dedicated");
    w->dedicated = !m->cfg.shared;
    w->size = m->cfg.size;
    w->max_transfer_size = m->cfg.max_transfer_size;
    w->block_on_fault = m->cfg.block_on_fault;
    w->gen_cap = m->cfg.gen_cap;
    w->usable = 1;
}

int kvt_dsa_model_inject(kvt_dsa_model *m, int kind, uint64_t count, uint64_t param)
{
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    switch (kind) {
    case KVT_DSA_FAULT_ENQCMD_RETRY: m->f_enqcmd = count; break;
    case KVT_DSA_FAULT_PAGE_FAULT: m->f_pf_count = count; m->f_pf_offset = param; break;
    case KVT_DSA_FAULT_BOF_FLAG: m->f_bof = count; break;
    case KVT_DSA_FAULT_CC_FLAG: m->f_cc = count; break;
    case KVT_DSA_FAULT_STALE_RESERVED: m->f_stale = count; break;
    case KVT_DSA_FAULT_XFER_ERANGE: m->f_xfer_count = count; m->f_xfer_max = param; break;
    case KVT_DSA_FAULT_REJECT_ALL:
        m->f_reject_count = count;
        m->f_reject_status = param ? (int)(param & 0x7f) : DSA_COMP_INVALID_FLAGS;
        break;
    case KVT_DSA_FAULT_HANG: m->f_hang_count = count; m->f_hang_late_ns = param; break;
    default: rc = -1; errno = EINVAL; break;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

void kvt_dsa_model_clear_faults(kvt_dsa_model *m)
{
    pthread_mutex_lock(&m->mu);
    m->f_enqcmd = m->f_pf_count = m->f_bof = m->f_cc = m->f_stale = 0;
    m->f_xfer_count = m->f_reject_count = m->f_hang_count = 0;
    pthread_mutex_unlock(&m->mu);
}

void kvt_dsa_model_get_stats(kvt_dsa_model *m, kvt_dsa_model_stats *out)
{
    pthread_mutex_lock(&m->mu);
    *out = m->st;
    out->faults_injected = __atomic_load_n(&m->st.faults_injected, __ATOMIC_RELAXED);
    out->faults_resolved = __atomic_load_n(&m->st.faults_resolved, __ATOMIC_RELAXED);
    out->hung = __atomic_load_n(&m->st.hung, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&m->mu);
}

static const char *const FAULT_NAMES[] = {
    [KVT_DSA_FAULT_ENQCMD_RETRY] = "enqcmd_retry",
    [KVT_DSA_FAULT_PAGE_FAULT] = "page_fault",
    [KVT_DSA_FAULT_BOF_FLAG] = "bof_flag",
    [KVT_DSA_FAULT_CC_FLAG] = "cc_flag",
    [KVT_DSA_FAULT_STALE_RESERVED] = "stale_reserved",
    [KVT_DSA_FAULT_XFER_ERANGE] = "xfer_erange",
    [KVT_DSA_FAULT_REJECT_ALL] = "reject_all",
    [KVT_DSA_FAULT_HANG] = "hang",
};

const char *kvt_dsa_fault_name(int kind)
{
    if (kind <= 0 || kind >= (int)(sizeof FAULT_NAMES / sizeof FAULT_NAMES[0]))
        return NULL;
    return FAULT_NAMES[kind];
}

int kvt_dsa_fault_from_name(const char *name)
{
    for (int i = 1; i < (int)(sizeof FAULT_NAMES / sizeof FAULT_NAMES[0]); i++)
        if (strcmp(FAULT_NAMES[i], name) == 0)
            return i;
    return -1;
}
