/* C-level tests of the DSA path on the software device model and fake sysfs
 * trees. Built and run by tests/test_dsa.py; prints "N passed, N failed"
 * and exits non-zero on any failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "dsa.h"

/* Layout: the device reads these offsets (linux/idxd.h, DSA spec). */
_Static_assert(sizeof(struct dsa_hw_desc) == 64, "descriptor 64 B");
_Static_assert(sizeof(struct dsa_completion_record) == 32, "completion record 32 B");
_Static_assert(offsetof(struct dsa_hw_desc, completion_addr) == 8, "");
_Static_assert(offsetof(struct dsa_hw_desc, src_addr) == 16, "");
_Static_assert(offsetof(struct dsa_hw_desc, dst_addr) == 24, "");
_Static_assert(offsetof(struct dsa_hw_desc, xfer_size) == 32, "");
_Static_assert(offsetof(struct dsa_hw_desc, int_handle) == 36, "");
_Static_assert(offsetof(struct dsa_hw_desc, crc_seed) == 40, "");
_Static_assert(offsetof(struct dsa_hw_desc, crc_rsvd) == 44, "");
_Static_assert(offsetof(struct dsa_hw_desc, seed_addr) == 48, "");
_Static_assert(offsetof(struct dsa_completion_record, status) == 0, "");
_Static_assert(offsetof(struct dsa_completion_record, bytes_completed) == 4, "");
_Static_assert(offsetof(struct dsa_completion_record, fault_addr) == 8, "");
_Static_assert(offsetof(struct dsa_completion_record, crc_val) == 16, "");
_Static_assert(offsetof(kvt_dsa_op, desc) % 64 == 0, "");
_Static_assert(_Alignof(kvt_dsa_op) == 64, "");

static int passed, failed;
#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (cond) {                                                                   \
            passed++;                                                                 \
        } else {                                                                      \
            failed++;                                                                 \
            fprintf(stderr, "FAIL %s:%d: %s\n", __func__, __LINE__, #cond);           \
        }                                                                             \
    } while (0)
#define CHECK_EQ(a, b)                                                                \
    do {                                                                              \
        unsigned long long a_ = (unsigned long long)(a), b_ = (unsigned long long)(b); \
        if (a_ == b_) {                                                               \
            passed++;                                                                 \
        } else {                                                                      \
            failed++;                                                                 \
            fprintf(stderr, "FAIL %s:%d: %s == %s (0x%llx != 0x%llx)\n", __func__,     \
                    __LINE__, #a, #b, a_, b_);                                        \
        }                                                                             \
    } while (0)

static uint8_t *random_buf(size_t n, uint32_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    uint32_t x = seed | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (uint8_t)x;
    }
    return p;
}

typedef struct {
    kvt_dsa_model *m;
    kvt_dsa_engine *e;
} rig;

static rig make_rig(int shared, unsigned size, uint64_t max_xfer, int bof, uint64_t gen_cap)
{
    kvt_dsa_model_config cfg = {.shared = shared, .size = size, .max_transfer_size = max_xfer,
                                .block_on_fault = bof, .gen_cap = gen_cap};
    rig r;
    r.m = kvt_dsa_model_create(&cfg);
    kvt_dsa_wq_info w;
    kvt_dsa_model_wq_info(r.m, &w);
    r.e = kvt_dsa_engine_create("dsa-model", kvt_dsa_model_portal(r.m), &w, kvt_crc32c_best_cpu()->fn);
    return r;
}

static void free_rig(rig *r) { kvt_dsa_engine_destroy(r->e); /* closes the model */ }

static kvt_dsa_counters counters(kvt_dsa_engine *e)
{
    kvt_dsa_counters c;
    kvt_dsa_engine_get_counters(e, &c);
    return c;
}

#define GC (KVT_DSA_GENCAP_CACHE_CONTROL | KVT_DSA_GENCAP_BLOCK_ON_FAULT)

static void test_bitfields(void)
{
    struct dsa_hw_desc d;
    memset(&d, 0, sizeof d);
    d.opcode = DSA_OPCODE_COPY_CRC;
    d.flags = IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR;
    uint32_t w;
    memcpy(&w, (const uint8_t *)&d + 4, 4);
    CHECK_EQ(w, (0x11u << 24) | 0x0c);
    CHECK_EQ(DSA_OPCODE_CRCGEN, 0x10);
    CHECK_EQ(DSA_OPCODE_COPY_CRC, 0x11);
    CHECK_EQ(DSA_COMP_PAGE_FAULT_NOBOF, 3);
    CHECK_EQ(DSA_COMP_INVALID_FLAGS, 0x11);
}

static void test_check_value_and_chaining(void)
{
    rig r = make_rig(0, 16, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_set_min_size(r.e, 0);
    kvt_dsa_counters c0 = counters(r.e);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, "123456789", 9), 0xE3069283u);
    kvt_dsa_counters c1 = counters(r.e);
    CHECK_EQ(c1.descriptors_submitted - c0.descriptors_submitted, 1);
    CHECK_EQ(c1.completed_on_device - c0.completed_on_device, 1);
    /* RFC 3720 B.4 vectors */
    uint8_t z[32] = {0}, ff[32], inc[32], dec[32];
    memset(ff, 0xff, 32);
    for (int i = 0; i < 32; i++) {
        inc[i] = (uint8_t)i;
        dec[i] = (uint8_t)(31 - i);
    }
    CHECK_EQ(kvt_dsa_crc(r.e, 0, z, 32), 0x8A9136AAu);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, ff, 32), 0x62A8AB43u);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, inc, 32), 0x46DD794Eu);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, dec, 32), 0x113FDB5Cu);
    /* chaining at many split points against the bitwise reference */
    size_t n = 70001;
    uint8_t *b = random_buf(n, 7);
    uint32_t ref = kvt_crc32c_bitwise(0, b, n);
    size_t cuts[] = {0, 1, 9, 4096, 33333, 70000, 70001};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        uint32_t a = kvt_dsa_crc(r.e, 0, b, cuts[i]);
        CHECK_EQ(kvt_dsa_crc(r.e, a, b + cuts[i], n - cuts[i]), ref);
    }
    /* seeds: all-ones and random, odd lengths and alignments */
    for (size_t off = 0; off < 8; off++)
        for (size_t len = 1; len < 200; len += 37)
            CHECK_EQ(kvt_dsa_crc(r.e, 0xFFFFFFFFu, b + off, len),
                     kvt_crc32c_bitwise(0xFFFFFFFFu, b + off, len));
    /* COPY_CRC: value and bytes */
    uint8_t *dst = calloc(1, n);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, dst, b, n, 0), ref);
    CHECK(memcmp(dst, b, n) == 0);
    kvt_dsa_counters c2 = counters(r.e);
    CHECK_EQ(c2.cpu_redo_total, 0);
    free(dst);
    free(b);
    free_rig(&r);
}

static void test_split(void)
{
    rig r = make_rig(0, 4, 4096, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e)); /* 1 MiB in 256 descriptors through a 4-slot WQ */
    kvt_dsa_engine_reset_counters(r.e);
    kvt_dsa_engine_set_min_size(r.e, 0);
    size_t n = 100000;
    uint8_t *b = random_buf(n, 11), *dst = calloc(1, n);
    uint32_t ref = kvt_crc32c_bitwise(0x12345678u, b, n);
    CHECK_EQ(kvt_dsa_crc(r.e, 0x12345678u, b, n), ref);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.descriptors_submitted, (n + 4095) / 4096);
    CHECK_EQ(c.completed_on_device, (n + 4095) / 4096);
    CHECK_EQ(c.bytes_on_device, n);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, dst, b, n, 0x12345678u), ref);
    CHECK(memcmp(dst, b, n) == 0);
    kvt_dsa_model_stats st;
    kvt_dsa_model_get_stats(r.m, &st);
    CHECK_EQ(st.dropped, 0);
    free(b);
    free(dst);
    free_rig(&r);
}

/* Direct descriptors through the model portal: completion record fields. */
static void test_model_records(void)
{
    kvt_dsa_model_config cfg = {.shared = 0, .size = 4, .max_transfer_size = 1 << 16,
                                .block_on_fault = 0, .gen_cap = GC};
    kvt_dsa_model *m = kvt_dsa_model_create(&cfg);
    kvt_dsa_portal *p = kvt_dsa_model_portal(m);
    size_t n = 10000;
    uint8_t *src = random_buf(n, 3), *dst = calloc(1, n);
    kvt_dsa_op *op = aligned_alloc(64, sizeof *op);
    op->comp = aligned_alloc(32, sizeof *op->comp); /* the device requires 32-B alignment */

#define SUBMIT_AND_WAIT()                                                              \
    do {                                                                               \
        memset(op->comp, 0, sizeof *op->comp);                                         \
        CHECK_EQ(p->ops->submit(p, &op->desc), KVT_DSA_SUBMIT_OK);                     \
        while (__atomic_load_n((uint8_t *)op->comp, __ATOMIC_ACQUIRE) == 0)            \
            ;                                                                          \
    } while (0)
#define DESC(opc, fl, s, d, len, seed)                                                 \
    do {                                                                               \
        memset(&op->desc, 0, sizeof op->desc);                                         \
        op->desc.opcode = (opc);                                                       \
        op->desc.flags = (fl);                                                         \
        op->desc.completion_addr = (uintptr_t)op->comp;                                \
        op->desc.src_addr = (uintptr_t)(s);                                            \
        op->desc.dst_addr = (uintptr_t)(d);                                            \
        op->desc.xfer_size = (len);                                                    \
        op->desc.crc_seed = (seed);                                                    \
    } while (0)
    const uint32_t F = IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR;

    DESC(DSA_OPCODE_CRCGEN, F, "123456789", 0, 9, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_SUCCESS);
    CHECK_EQ((uint32_t)op->comp->crc_val, 0xE3069283u);

    /* page fault on the destination of COPY_CRC: write bit, partial CRC */
    kvt_dsa_model_inject(m, KVT_DSA_FAULT_PAGE_FAULT, 1, 5000);
    DESC(DSA_OPCODE_COPY_CRC, F, src, dst, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_PAGE_FAULT_NOBOF | DSA_COMP_STATUS_WRITE);
    CHECK_EQ(op->comp->bytes_completed, 5000);
    CHECK_EQ(op->comp->fault_addr, (uintptr_t)(dst + 5000));
    CHECK_EQ((uint32_t)op->comp->crc_val, kvt_crc32c_bitwise(0, src, 5000));
    CHECK(memcmp(dst, src, 5000) == 0);
    CHECK_EQ(dst[5000] == src[5000] && dst[5001] == src[5001] && dst[5002] == src[5002], 0);

    /* page fault on the source of CRCGEN: no write bit */
    kvt_dsa_model_inject(m, KVT_DSA_FAULT_PAGE_FAULT, 1, 100);
    DESC(DSA_OPCODE_CRCGEN, F, src, 0, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_PAGE_FAULT_NOBOF);
    CHECK_EQ(op->comp->fault_addr, (uintptr_t)(src + 100));

    /* flags validation */
    DESC(DSA_OPCODE_CRCGEN, F | IDXD_OP_FLAG_BOF, src, 0, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_INVALID_FLAGS);
    CHECK_EQ(op->comp->invalid_flags, IDXD_OP_FLAG_BOF);
    DESC(DSA_OPCODE_CRCGEN, F | IDXD_OP_FLAG_CC, src, 0, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_INVALID_FLAGS);
    CHECK_EQ(op->comp->invalid_flags, IDXD_OP_FLAG_CC);
    DESC(DSA_OPCODE_COPY_CRC, F | IDXD_OP_FLAG_CC, src, dst, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_SUCCESS);
    DESC(DSA_OPCODE_CRCGEN, F, src, 0, n, 0);
    op->desc.crc_rsvd = 1;
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_NOZERO_RESERVE);
    DESC(DSA_OPCODE_CRCGEN, F, src, 0, (1 << 16) + 1, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_XFER_ERANGE);
    DESC(0x3f, F, src, 0, 16, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_BAD_OPCODE);
    /* MEMMOVE */
    memset(dst, 0, n);
    DESC(DSA_OPCODE_MEMMOVE, F, src, dst, n, 0);
    SUBMIT_AND_WAIT();
    CHECK_EQ(op->comp->status, DSA_COMP_SUCCESS);
    CHECK_EQ(op->comp->bytes_completed, n);
    CHECK(memcmp(dst, src, n) == 0);

    free(op->comp);
    free(op);
    free(src);
    free(dst);
    kvt_dsa_model_destroy(m);
}

static void test_page_fault_resume(void)
{
    rig r = make_rig(0, 8, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 64 * 1024;
    uint8_t *b = random_buf(n, 5), *dst = calloc(1, n);
    uint32_t ref = kvt_crc32c_bitwise(0, b, n);

    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_PAGE_FAULT, 1, 1000);
    kvt_dsa_op op;
    kvt_dsa_crc_submit(r.e, &op, b, n, 0);
    CHECK_EQ(kvt_dsa_wait(&op), ref);
    CHECK(op.on_device);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.page_fault_resumes, 1);
    CHECK_EQ(c.descriptors_submitted, 2);
    CHECK_EQ(c.completed_on_device, 1);
    CHECK_EQ(c.cpu_redo_total, 0);

    /* COPY_CRC: write fault at 12345, resumed, every byte copied */
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_PAGE_FAULT, 3, 12345);
    kvt_dsa_copy_crc_submit(r.e, &op, dst, b, n, 0);
    CHECK_EQ(kvt_dsa_wait(&op), ref);
    CHECK(memcmp(dst, b, n) == 0);
    c = counters(r.e);
    /* 3 faults: at 12345 of 65536, then of 53191, then of 40846 */
    CHECK_EQ(c.page_fault_resumes, 4);
    CHECK_EQ(c.cpu_redo_total, 0);
    kvt_dsa_model_stats st;
    kvt_dsa_model_get_stats(r.m, &st);
    CHECK_EQ(st.faults_injected, 4);
    free_rig(&r);

    /* WQ with block_on_fault=1: BOF is set and the device resolves the fault */
    r = make_rig(0, 8, 1 << 20, 1, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_reset_counters(r.e);
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_PAGE_FAULT, 1, 1000);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n), ref);
    c = counters(r.e);
    CHECK_EQ(c.page_fault_resumes, 0);
    CHECK_EQ(c.completed_on_device, 1);
    kvt_dsa_model_get_stats(r.m, &st);
    CHECK_EQ(st.faults_resolved, 1);
    free_rig(&r);
    free(b);
    free(dst);
}

static void one_error(int kind, uint64_t param, int gen_cap, int expect_status, int copy)
{
    rig r = make_rig(0, 8, 1 << 20, 0, (uint64_t)gen_cap);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 256 * 1024;
    uint8_t *b = random_buf(n, (uint32_t)kind * 77), *dst = calloc(1, n);
    uint32_t ref = kvt_crc32c_bitwise(0xDEADBEEFu, b, n);
    kvt_dsa_model_inject(r.m, kind, 1, param);
    kvt_dsa_op op;
    if (copy)
        kvt_dsa_copy_crc_submit(r.e, &op, dst, b, n, 0xDEADBEEFu);
    else
        kvt_dsa_crc_submit(r.e, &op, b, n, 0xDEADBEEFu);
    CHECK_EQ(kvt_dsa_wait(&op), ref);
    if (copy)
        CHECK(memcmp(dst, b, n) == 0);
    CHECK_EQ(op.on_device, 0);
    CHECK_EQ(op.last_status, expect_status);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.cpu_redo_by_status[expect_status], 1);
    CHECK_EQ(c.cpu_redo_total, 1);
    CHECK_EQ(c.completed_on_device, 0);
    /* the fault was one-shot: the next op completes on the device */
    CHECK_EQ(kvt_dsa_crc(r.e, 0xDEADBEEFu, b, n), ref);
    c = counters(r.e);
    CHECK_EQ(c.completed_on_device, 1);
    free(b);
    free(dst);
    free_rig(&r);
}

static void test_injected_errors(void)
{
    one_error(KVT_DSA_FAULT_BOF_FLAG, 0, GC, DSA_COMP_INVALID_FLAGS, 0);
    one_error(KVT_DSA_FAULT_CC_FLAG, 0, GC, DSA_COMP_INVALID_FLAGS, 0);
    /* COPY_CRC with CC but a device without cache-control support */
    one_error(KVT_DSA_FAULT_CC_FLAG, 0, 0, DSA_COMP_INVALID_FLAGS, 1);
    one_error(KVT_DSA_FAULT_STALE_RESERVED, 0, GC, DSA_COMP_NOZERO_RESERVE, 0);
    one_error(KVT_DSA_FAULT_STALE_RESERVED, 0, GC, DSA_COMP_NOZERO_RESERVE, 1);
    one_error(KVT_DSA_FAULT_XFER_ERANGE, 4096, GC, DSA_COMP_XFER_ERANGE, 0);
    one_error(KVT_DSA_FAULT_XFER_ERANGE, 4096, GC, DSA_COMP_XFER_ERANGE, 1);
    one_error(KVT_DSA_FAULT_REJECT_ALL, 0, GC, DSA_COMP_INVALID_FLAGS, 1);
    one_error(KVT_DSA_FAULT_REJECT_ALL, DSA_COMP_HW_ERR1, GC, DSA_COMP_HW_ERR1, 0);
}

static void test_cc_flag_policy(void)
{
    /* CC is set on COPY_CRC only when gen_cap has 0x4; never on CRCGEN. */
    rig r = make_rig(0, 4, 1 << 20, 0, GC);
    kvt_dsa_engine_set_min_size(r.e, 0);
    r.e = r.e;
    uint8_t b[64] = {1}, d[64];
    kvt_dsa_op op;
    kvt_dsa_copy_crc_submit(r.e, &op, d, b, sizeof b, 0);
    /* not enabled (no self-check): CPU, no descriptor */
    CHECK_EQ(op.on_device, 0);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_copy_crc_submit(r.e, &op, d, b, sizeof b, 0);
    CHECK(op.desc.flags & IDXD_OP_FLAG_CC);
    CHECK(!(op.desc.flags & IDXD_OP_FLAG_BOF));
    CHECK_EQ(op.desc.flags & (IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR), IDXD_OP_FLAG_CRAV | IDXD_OP_FLAG_RCR);
    kvt_dsa_wait(&op);
    kvt_dsa_crc_submit(r.e, &op, b, sizeof b, 0);
    CHECK(!(op.desc.flags & IDXD_OP_FLAG_CC));
    kvt_dsa_wait(&op);
    free_rig(&r);
    r = make_rig(0, 4, 1 << 20, 1, KVT_DSA_GENCAP_BLOCK_ON_FAULT);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_set_min_size(r.e, 0);
    kvt_dsa_copy_crc_submit(r.e, &op, d, b, sizeof b, 0);
    CHECK(!(op.desc.flags & IDXD_OP_FLAG_CC));
    CHECK(op.desc.flags & IDXD_OP_FLAG_BOF);
    kvt_dsa_wait(&op);
    free_rig(&r);
}

static void test_enqcmd_retry(void)
{
    rig r = make_rig(1, 8, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 32 * 1024;
    uint8_t *b = random_buf(n, 9);
    uint32_t ref = kvt_crc32c_bitwise(0, b, n);
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_ENQCMD_RETRY, 5, 0);
    kvt_dsa_op op;
    kvt_dsa_crc_submit(r.e, &op, b, n, 0);
    CHECK_EQ(kvt_dsa_wait(&op), ref);
    CHECK(op.on_device);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.enqcmd_retries, 5);
    CHECK_EQ(c.completed_on_device, 1);
    /* more rejections than the bounded retry: CPU, counted */
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_ENQCMD_RETRY, 100000, 0);
    kvt_dsa_crc_submit(r.e, &op, b, n, 0);
    CHECK_EQ(kvt_dsa_wait(&op), ref);
    CHECK_EQ(op.on_device, 0);
    c = counters(r.e);
    CHECK_EQ(c.enqcmd_retries, 5 + KVT_DSA_ENQCMD_RETRY_MAX);
    CHECK_EQ(c.submit_failures, 1);
    kvt_dsa_model_clear_faults(r.m);
    free(b);
    free_rig(&r);
}

static void test_reject_everything(void)
{
    rig r = make_rig(0, 8, 1 << 20, 0, GC);
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_REJECT_ALL, UINT64_MAX, 0);
    CHECK_EQ(kvt_dsa_engine_selfcheck(r.e), 0);
    CHECK_EQ(kvt_dsa_engine_enabled(r.e), 0);
    kvt_dsa_selfcheck sc;
    kvt_dsa_engine_get_selfcheck(r.e, &sc);
    CHECK_EQ(sc.crcgen_on_device, 0);
    CHECK_EQ(sc.copy_on_device, 0);
    CHECK_EQ(sc.crcgen_match, 1); /* the CPU redo gave right answers */
    CHECK_EQ(sc.copy_match, 1);
    CHECK_EQ(sc.crcgen_status, DSA_COMP_INVALID_FLAGS);
    CHECK(strstr(kvt_dsa_engine_reason(r.e), "not completed on the device") != NULL);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.completed_on_device, 0);
    CHECK_EQ(c.cpu_redo_by_status[DSA_COMP_INVALID_FLAGS], 3);
    free_rig(&r);
}

static void test_min_size_gate(void)
{
    rig r = make_rig(0, 8, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    CHECK_EQ(kvt_dsa_engine_min_size(r.e), KVT_DSA_MIN_SIZE_DEFAULT);
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 16 * 1024;
    uint8_t *b = random_buf(n, 21);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n - 1), kvt_crc32c_bitwise(0, b, n - 1));
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.descriptors_submitted, 0);
    CHECK_EQ(c.completed_on_device, 0);
    CHECK_EQ(c.below_min_size, 1);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n), kvt_crc32c_bitwise(0, b, n));
    c = counters(r.e);
    CHECK_EQ(c.descriptors_submitted, 1);
    CHECK_EQ(c.completed_on_device, 1);
    kvt_dsa_engine_set_min_size(r.e, 1 << 20);
    CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n), kvt_crc32c_bitwise(0, b, n));
    CHECK_EQ(counters(r.e).descriptors_submitted, 1);
    free(b);
    free_rig(&r);
}

static void test_wait_modes(void)
{
    for (int mode = KVT_DSA_WAIT_SPIN; mode <= KVT_DSA_WAIT_SLEEP; mode++) {
        rig r = make_rig(0, 2, 8192, 0, GC);
        kvt_dsa_engine_set_wait(r.e, mode, 1000);
        CHECK(kvt_dsa_engine_selfcheck(r.e));
        CHECK_EQ(kvt_dsa_engine_wait_mode(r.e), mode);
        size_t n = 200000;
        uint8_t *b = random_buf(n, 33 + mode);
        CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n), kvt_crc32c_bitwise(0, b, n));
        CHECK(counters(r.e).wait_ns > 0);
        free(b);
        free_rig(&r);
    }
}

/* ------------------------------------------------------------------ */
/* Fake sysfs trees                                                    */
/* ------------------------------------------------------------------ */

static void put(const char *dir, const char *name, const char *val)
{
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fprintf(f, "%s\n", val);
    fclose(f);
}

static void fake_wq(const char *root, const char *name, const char *state, const char *type,
                    const char *mode, const char *size, const char *bof, int node)
{
    char d[600];
    snprintf(d, sizeof d, "%s/sys/bus/dsa/devices/%s", root, name);
    mkdir(d, 0755);
    put(d, "state", state);
    put(d, "type", type);
    put(d, "mode", mode);
    put(d, "size", size);
    put(d, "max_transfer_size", "2097152");
    put(d, "block_on_fault", bof);
    if (node == 1) {
        snprintf(d, sizeof d, "%s/dev/dsa/%s", root, name);
        close(open(d, O_CREAT | O_RDWR, 0600));
    } else if (node == 2) { /* unopenable read-write: a directory */
        snprintf(d, sizeof d, "%s/dev/dsa/%s", root, name);
        mkdir(d, 0755);
    }
}

/* A fresh fake sysfs+dev tree; the caller frees the returned path (and removes the tree). */
static char *make_tree(void)
{
    char tmpl[64];
    strcpy(tmpl, "/tmp/kvt-dsa-sysfs-XXXXXX");
    char *root = strdup(mkdtemp(tmpl));
    char d[600];
    snprintf(d, sizeof d, "%s/sys", root); mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/sys/bus", root); mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/sys/bus/dsa", root); mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/sys/bus/dsa/devices", root); mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/sys/bus/dsa/devices/dsa0", root); mkdir(d, 0755);
    put(d, "gen_cap", "0x40915f0107");
    snprintf(d, sizeof d, "%s/dev", root); mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/dev/dsa", root); mkdir(d, 0755);
    return root;
}

static const kvt_dsa_wq_info *find(const kvt_dsa_discovery *d, const char *name)
{
    for (size_t i = 0; i < d->n; i++)
        if (strcmp(d->wqs[i].name, name) == 0)
            return &d->wqs[i];
    return NULL;
}

static void test_discovery(void)
{
    static kvt_dsa_discovery d;
    char sys[600], dev[600];
    char *root = make_tree();
    snprintf(sys, sizeof sys, "%s/sys", root);
    snprintf(dev, sizeof dev, "%s/dev", root);
    fake_wq(root, "wq0.0", "enabled", "user", "dedicated", "16", "0", 1);
    fake_wq(root, "wq0.1", "enabled", "user", "shared", "32", "0", 1);
    fake_wq(root, "wq0.2", "enabled", "user", "shared", "32", "1", 1);
    fake_wq(root, "wq0.3", "disabled", "user", "dedicated", "16", "0", 1);
    fake_wq(root, "wq0.4", "enabled", "kernel", "dedicated", "16", "0", 1);
    fake_wq(root, "wq0.5", "enabled", "user", "shared", "16", "1", 0);
    CHECK_EQ(kvt_dsa_discover(sys, dev, "", &d), 0);
    CHECK(d.devices_dir_present);
    CHECK_EQ(d.n, 6);
    CHECK(d.chosen >= 0 && strcmp(d.wqs[d.chosen].name, "wq0.2") == 0); /* shared, bof=1 */
    const kvt_dsa_wq_info *w = find(&d, "wq0.0");
    CHECK(w && w->usable && w->dedicated && w->size == 16 && w->max_transfer_size == 2097152);
    CHECK(w && w->gen_cap == 0x40915f0107ull && strcmp(w->device, "dsa0") == 0);
    w = find(&d, "wq0.2");
    CHECK(w && w->usable && !w->dedicated && w->block_on_fault == 1);
    w = find(&d, "wq0.3");
    CHECK(w && !w->usable && strstr(w->reason, "state=disabled"));
    w = find(&d, "wq0.4");
    CHECK(w && !w->usable && strstr(w->reason, "type=kernel"));
    w = find(&d, "wq0.5");
    CHECK(w && !w->usable && strstr(w->reason, "device node") && strstr(w->reason, "missing"));
    int idx[8];
    CHECK_EQ(kvt_dsa_candidates(&d, idx, 8), 3);
    CHECK(strcmp(d.wqs[idx[1]].name, "wq0.1") == 0);
    CHECK(strcmp(d.wqs[idx[2]].name, "wq0.0") == 0);

    /* explicit WQ */
    kvt_dsa_discover(sys, dev, "wq0.0", &d);
    CHECK(d.chosen >= 0 && strcmp(d.wqs[d.chosen].name, "wq0.0") == 0);
    w = find(&d, "wq0.2");
    CHECK(w && !w->usable && strstr(w->reason, "KVTIER_DSA_WQ=wq0.0"));
    setenv("KVTIER_DSA_WQ", "wq0.1", 1);
    kvt_dsa_discover(sys, dev, NULL, &d);
    CHECK(d.chosen >= 0 && strcmp(d.wqs[d.chosen].name, "wq0.1") == 0);
    unsetenv("KVTIER_DSA_WQ");
    /* root from the environment */
    setenv("KVTIER_DSA_SYSFS", sys, 1);
    setenv("KVTIER_DSA_DEV", dev, 1);
    kvt_dsa_discover(NULL, NULL, NULL, &d);
    CHECK(d.chosen >= 0 && strcmp(d.wqs[d.chosen].name, "wq0.2") == 0);
    unsetenv("KVTIER_DSA_SYSFS");
    unsetenv("KVTIER_DSA_DEV");

    /* absent tree */
    kvt_dsa_discover("/nonexistent-kvt", dev, NULL, &d);
    CHECK_EQ(d.devices_dir_present, 0);
    CHECK_EQ(d.chosen, -1);
    CHECK(strcmp(d.devices_dir, "/nonexistent-kvt/bus/dsa/devices") == 0);
    CHECK_EQ(kvt_dsa_enable_device("/nonexistent-kvt", dev, NULL), 0);
    char why[1200];
    kvt_dsa_global_reason(KVT_DSA_DEVICE, why, sizeof why);
    CHECK(strcmp(why, "no DSA devices found (/nonexistent-kvt/bus/dsa/devices absent)") == 0);

    /* dedicated-only tree whose node cannot be opened read-write */
    char *root2 = make_tree();
    snprintf(sys, sizeof sys, "%s/sys", root2);
    snprintf(dev, sizeof dev, "%s/dev", root2);
    fake_wq(root2, "wq0.0", "enabled", "user", "dedicated", "8", "1", 2);
    fake_wq(root2, "wq0.1", "disabled", "user", "dedicated", "8", "1", 1);
    CHECK_EQ(kvt_dsa_enable_device(sys, dev, NULL), 0);
    kvt_dsa_global_reason(KVT_DSA_DEVICE, why, sizeof why);
    CHECK(strstr(why, "WQ found but not usable:") == why);
    CHECK(strstr(why, "wq0.1: state=disabled") != NULL);
    CHECK(strstr(why, "wq0.0: open") != NULL);
    /* a node that accepts descriptors but never completes (a plain file,
     * write() path): the self-check times out and the WQ is not enabled */
    char *root3 = make_tree();
    snprintf(sys, sizeof sys, "%s/sys", root3);
    snprintf(dev, sizeof dev, "%s/dev", root3);
    fake_wq(root3, "wq0.0", "enabled", "user", "shared", "8", "0", 1);
    setenv("KVTIER_DSA_SELFCHECK_TIMEOUT_MS", "100", 1);
    int have_enq = kvt_dsa_cpu_has_enqcmd();
    if (!have_enq) { /* with ENQCMD the instruction would target a file mapping */
        CHECK_EQ(kvt_dsa_enable_device(sys, dev, NULL), 0);
        kvt_dsa_global_reason(KVT_DSA_DEVICE, why, sizeof why);
        CHECK(strstr(why, "no completion within 100 ms") != NULL);
        char node[700];
        struct stat stt;
        snprintf(node, sizeof node, "%s/dsa/wq0.0", dev);
        CHECK(stat(node, &stt) == 0 && stt.st_size == 64); /* one descriptor written */
    }
    unsetenv("KVTIER_DSA_SELFCHECK_TIMEOUT_MS");
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s' '%s'", root, root2, root3);
    CHECK_EQ(system(cmd), 0);
    CHECK(access(root, F_OK) != 0 && access(root2, F_OK) != 0 && access(root3, F_OK) != 0);
    free(root);
    free(root2);
    free(root3);
}

static void test_global_model(void)
{
    kvt_dsa_model_config cfg = {.size = 8, .max_transfer_size = 65536, .gen_cap = GC};
    CHECK_EQ(kvt_dsa_model_backend_available(), 0); /* never enabled implicitly */
    CHECK_EQ(kvt_dsa_enable_model(&cfg, DSA_COMP_INVALID_FLAGS), 0);
    CHECK_EQ(kvt_dsa_model_backend_available(), 0);
    CHECK_EQ(kvt_dsa_enable_model(&cfg, 0), 1);
    CHECK_EQ(kvt_dsa_model_backend_available(), 1);
    size_t n = 300000;
    uint8_t *b = random_buf(n, 99);
    CHECK_EQ(kvt_crc32c_dsa_model(0, b, n), kvt_crc32c_bitwise(0, b, n));
    kvt_dsa_engine *e = kvt_dsa_acquire(KVT_DSA_MODEL);
    CHECK(e != NULL && strcmp(kvt_dsa_engine_name(e), "dsa-model") == 0);
    if (e) {
        CHECK_EQ(counters(e).descriptors_submitted, 16 + 1 + 16 + 5); /* self-check + ceil(300000/65536) */
        kvt_dsa_release(e);
    }
    CHECK(kvt_crc32c_find("dsa-model") != NULL);
    CHECK(kvt_crc32c_find("dsa") != NULL);
    kvt_dsa_disable(KVT_DSA_MODEL);
    CHECK_EQ(kvt_dsa_model_backend_available(), 0);
    CHECK_EQ(kvt_crc32c_dsa_model(0, b, n), kvt_crc32c_bitwise(0, b, n));
    free(b);
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A WQ that stops completing descriptors: the wait is bounded by the
 * engine timeout, the CRC is right (CPU), the engine disables itself. */
static void test_timeout_hang(void)
{
    rig r = make_rig(0, 4, 1 << 16, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    CHECK_EQ(kvt_dsa_engine_timeout(r.e), 1000000000ull); /* default 1 s */
    kvt_dsa_engine_set_min_size(r.e, 0);
    kvt_dsa_engine_set_timeout(r.e, 50000000ull); /* 50 ms */
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 300000; /* 5 descriptors of 64 KiB */
    uint8_t *b = random_buf(n, 77);
    /* the first descriptor is swallowed (a WQ the admin disabled) */
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_HANG, 1, 0);
    uint64_t t0 = mono_ns();
    CHECK_EQ(kvt_dsa_crc(r.e, 5, b, n), kvt_crc32c_bitwise(5, b, n));
    uint64_t dt = mono_ns() - t0;
    CHECK(dt >= 50000000ull);
    CHECK(dt < 50000000ull + 2000000000ull);
    kvt_dsa_counters c = counters(r.e);
    CHECK_EQ(c.timeouts, 1);
    CHECK_EQ(c.cpu_redo_total, 1);
    CHECK_EQ(c.descriptors_submitted, 1);
    CHECK_EQ(c.completed_on_device, 0);
    CHECK_EQ(kvt_dsa_engine_enabled(r.e), 0);
    CHECK(strstr(kvt_dsa_engine_reason(r.e), "device stopped completing descriptors") != NULL);
    kvt_dsa_model_stats st;
    kvt_dsa_model_get_stats(r.m, &st);
    CHECK_EQ(st.hung, 1);
    /* later ops: CPU at once, nothing submitted (the counters prove it; the clock only
     * catches a hang, since under valgrind on a loaded host the CPU CRC alone can take
     * longer than the 50 ms timeout) */
    uint32_t want = kvt_crc32c_bitwise(0, b, n);
    t0 = mono_ns();
    CHECK_EQ(kvt_dsa_crc(r.e, 0, b, n), want);
    CHECK(mono_ns() - t0 < 2000000000ull);
    CHECK_EQ(counters(r.e).descriptors_submitted, 1);
    CHECK_EQ(counters(r.e).timeouts, 1);
    uint8_t *dst = calloc(1, n);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, dst, b, n, 0), kvt_crc32c_bitwise(0, b, n));
    CHECK(memcmp(dst, b, n) == 0);
    free(dst);
    free(b);
    free_rig(&r);
}

/* A device that comes back late writes the completion record software gave
 * up on: the record is quarantined engine memory, so the late write lands on
 * valid memory no one reuses (ASan would flag a freed or pooled record). */
static void test_timeout_late_completion(void)
{
    rig r = make_rig(1, 8, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_set_min_size(r.e, 0);
    kvt_dsa_engine_set_timeout(r.e, 20000000ull); /* 20 ms */
    size_t n = 100000;
    uint8_t *b = random_buf(n, 78), *dst = calloc(1, n);
    /* completes 1 s late: far past the 20 ms timeout even on a loaded host under ASan */
    kvt_dsa_model_inject(r.m, KVT_DSA_FAULT_HANG, 1, 1000000000ull);
    kvt_dsa_op op;
    kvt_dsa_copy_crc_submit(r.e, &op, dst, b, n, 0);
    CHECK(op.comp != NULL); /* on the device: an engine-owned record */
    CHECK_EQ((uintptr_t)op.comp % 32, 0);
    CHECK_EQ(kvt_dsa_wait(&op), kvt_crc32c_bitwise(0, b, n));
    CHECK(op.comp == NULL); /* handed to the quarantine, not back to the pool */
    CHECK(memcmp(dst, b, n) == 0);
    CHECK_EQ(op.on_device, 0);
    CHECK_EQ(counters(r.e).timeouts, 1);
    free(b); /* the caller's buffers are the caller's (the late device touches no data here) */
    free(dst);
    struct timespec ts = {1, 200000000L};
    nanosleep(&ts, NULL); /* the late record write happens meanwhile */
    kvt_dsa_model_stats st;
    kvt_dsa_model_get_stats(r.m, &st);
    CHECK_EQ(st.hung, 1);
    CHECK_EQ(kvt_dsa_engine_enabled(r.e), 0);
    free_rig(&r);
}

/* COPY_CRC with overlapping dst/src: CRC of the source as it was, memmove
 * semantics, on the CPU (never a descriptor: OVERLAP_BUFFERS). */
static void test_copy_overlap(void)
{
    rig r = make_rig(0, 8, 1 << 20, 0, GC);
    CHECK(kvt_dsa_engine_selfcheck(r.e));
    kvt_dsa_engine_set_min_size(r.e, 0);
    kvt_dsa_engine_reset_counters(r.e);
    size_t n = 50000;
    uint8_t *orig = random_buf(n + 100, 79), *buf = malloc(n + 100);
    memcpy(buf, orig, n + 100);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, buf + 100, buf, n, 0), kvt_crc32c_bitwise(0, orig, n));
    CHECK(memcmp(buf + 100, orig, n) == 0);
    memcpy(buf, orig, n + 100);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, buf, buf + 100, n, 3), kvt_crc32c_bitwise(3, orig + 100, n));
    CHECK(memcmp(buf, orig + 100, n) == 0);
    CHECK_EQ(kvt_dsa_copy_crc(r.e, buf, buf, n, 0), kvt_crc32c_bitwise(0, buf, n));
    CHECK_EQ(counters(r.e).descriptors_submitted, 0);
    free(orig);
    free(buf);
    free_rig(&r);
}

int main(void)
{
    kvt_dsa_register_backends(); /* as the module's import does */
    unsetenv("KVTIER_DSA_MIN_SIZE");
    unsetenv("KVTIER_DSA_WAIT");
    test_bitfields();
    test_check_value_and_chaining();
    test_split();
    test_model_records();
    test_page_fault_resume();
    test_injected_errors();
    test_cc_flag_policy();
    test_enqcmd_retry();
    test_reject_everything();
    test_min_size_gate();
    test_wait_modes();
    test_discovery();
    test_global_model();
    test_timeout_hang();
    test_timeout_late_completion();
    test_copy_overlap();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
