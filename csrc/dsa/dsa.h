/* kvtier Intel DSA (Data Streaming Accelerator) offload of CRC32C.
 *
 *   wq.c      work queue (WQ) discovery from sysfs (/sys/bus/dsa/devices)
 *   submit.c  portals: mmap'd WQ portal with MOVDIR64B (dedicated WQ) or
 *             ENQCMD (shared WQ), write(fd, desc, 64) where mmap is refused
 *   engine.c  engine: CRCGEN / COPY_CRC descriptors, completion polling,
 *             page-fault resume, CPU redo, min-size gate, self-check, counters
 *   backend.c the process-wide engines behind the "dsa" / "dsa-model" CRC32C
 *             backends, KVTIER_DSA*, their registration (crc32c.h)
 *   model.c   software device model: consumes the same struct dsa_hw_desc
 *             through the portal abstraction, executes on its own thread
 *
 * Descriptor and completion record layouts come from the kernel uapi header
 * <linux/idxd.h> (struct dsa_hw_desc, struct dsa_completion_record,
 * DSA_OPCODE_*, IDXD_OP_FLAG_*, DSA_COMP_*).
 *
 * CRC convention (DSA, as the DML software model computes it):
 *     crc_val = ~raw(data, init = ~crc_seed)
 * so crc_seed = previous standard CRC32C (0 to start) yields the standard
 * value and chains exactly like kvt_crc32c(). "123456789", seed 0 -> 0xE3069283.
 *
 * Plain C11 + POSIX, no Python.
 */
#ifndef KVTIER_DSA_H
#define KVTIER_DSA_H

#include <stddef.h>
#include <stdint.h>
#include <linux/idxd.h>

#include "crc32c.h" /* kvt_crc32c_fn */

#ifdef __cplusplus
extern "C" {
#endif

/* gen_cap bit for "cache control support (memory)": the CC flag is only
 * legal when the device reports it (DSA spec, GENCAP register bit 2). */
#define KVT_DSA_GENCAP_CACHE_CONTROL 0x4ull
/* gen_cap bit 0: block-on-fault support. */
#define KVT_DSA_GENCAP_BLOCK_ON_FAULT 0x1ull

#define KVT_DSA_PORTAL_SIZE 4096
#define KVT_DSA_MIN_SIZE_DEFAULT (16 * 1024)      /* CacheLib's measured break-even */
#define KVT_DSA_SELFCHECK_SIZE (1024 * 1024)
#define KVT_DSA_ENQCMD_RETRY_MAX 256
#define KVT_DSA_MAX_WQS 64

/* ------------------------------------------------------------------ */
/* Discovery (wq.c)                                                    */
/* ------------------------------------------------------------------ */

typedef struct kvt_dsa_wq_info {
    char name[32];            /* "wq0.0" */
    char device[32];          /* parent device, "dsa0" */
    char path[300];           /* device node, "/dev/dsa/wq0.0" */
    char state[16];           /* sysfs "state" */
    char type[16];            /* sysfs "type": user, kernel, none */
    char mode[16];            /* sysfs "mode": dedicated, shared */
    int dedicated;            /* 1 dedicated, 0 shared */
    unsigned size;            /* WQ size (descriptor slots) */
    uint64_t max_transfer_size; /* bytes */
    int block_on_fault;       /* 0/1 */
    uint64_t gen_cap;         /* parent device gen_cap (hex in sysfs) */
    int usable;
    char reason[200];         /* why skipped ("" when usable) */
} kvt_dsa_wq_info;

typedef struct kvt_dsa_discovery {
    char devices_dir[300];    /* <sysfs_root>/bus/dsa/devices */
    char dev_dir[300];        /* <dev_root>/dsa */
    int devices_dir_present;
    size_t n;
    kvt_dsa_wq_info wqs[KVT_DSA_MAX_WQS];
    int chosen;               /* index into wqs of the preferred usable WQ, or -1 */
} kvt_dsa_discovery;

/* Scan <sysfs_root>/bus/dsa/devices for WQs. sysfs_root NULL -> env
 * KVTIER_DSA_SYSFS or "/sys"; dev_root NULL -> env KVTIER_DSA_DEV or "/dev";
 * want NULL -> env KVTIER_DSA_WQ (a name like "wq0.0") or any.
 * Usable: state=enabled, type=user, mode dedicated/shared, size > 0,
 * max_transfer_size > 0, device node present and read-write.
 * Preference among usable WQs: shared (many processes can share it) over
 * dedicated, then block_on_fault=1, then larger size, then name order.
 * Returns 0 (even when nothing is found; see devices_dir_present/chosen). */
int kvt_dsa_discover(const char *sysfs_root, const char *dev_root, const char *want,
                     kvt_dsa_discovery *out);
/* Candidate order for opening: indices of usable WQs, preferred first. */
size_t kvt_dsa_candidates(const kvt_dsa_discovery *d, int *idx, size_t max);

/* ------------------------------------------------------------------ */
/* Portals (submit.c, model.c)                                         */
/* ------------------------------------------------------------------ */

typedef struct kvt_dsa_portal kvt_dsa_portal;

enum { KVT_DSA_SUBMIT_OK = 0, KVT_DSA_SUBMIT_RETRY = 1, KVT_DSA_SUBMIT_ERROR = -1 };

typedef struct kvt_dsa_portal_ops {
    /* Hand one 64-byte descriptor to the WQ. Returns KVT_DSA_SUBMIT_OK,
     * KVT_DSA_SUBMIT_RETRY (shared WQ full: ENQCMD ZF=1, or EAGAIN from
     * write), or KVT_DSA_SUBMIT_ERROR with errno set. The descriptor memory
     * may be reused as soon as this returns (the device copies it). */
    int (*submit)(kvt_dsa_portal *p, const struct dsa_hw_desc *desc);
    void (*close)(kvt_dsa_portal *p);
} kvt_dsa_portal_ops;

struct kvt_dsa_portal {
    const kvt_dsa_portal_ops *ops;
    const char *kind;         /* "movdir64b", "enqcmd", "write", "model" */
};

int kvt_dsa_cpu_has_movdir64b(void); /* CPUID.(EAX=7,ECX=0):ECX[28] */
int kvt_dsa_cpu_has_enqcmd(void);    /* CPUID.(EAX=7,ECX=0):ECX[29] */

/* Open a real WQ's device node: mmap the 4 KiB portal (MAP_SHARED,
 * PROT_WRITE) and submit with MOVDIR64B (dedicated) or ENQCMD (shared)
 * when CPUID has them, else write(fd, desc, 64). NULL with errno on failure. */
kvt_dsa_portal *kvt_dsa_portal_open(const kvt_dsa_wq_info *wq);

/* ------------------------------------------------------------------ */
/* Software device model (model.c)                                     */
/* ------------------------------------------------------------------ */

typedef struct kvt_dsa_model kvt_dsa_model;

typedef struct kvt_dsa_model_config {
    int shared;                 /* 0: dedicated WQ (MOVDIR64B), 1: shared (ENQCMD) */
    unsigned size;              /* WQ size; default 32 */
    uint64_t max_transfer_size; /* bytes; default 2 MiB */
    int block_on_fault;         /* WQ block_on_fault */
    uint64_t gen_cap;           /* default KVT_DSA_GENCAP_CACHE_CONTROL|BLOCK_ON_FAULT */
    unsigned latency_ns;        /* extra per-descriptor delay, 0 = none */
} kvt_dsa_model_config;

enum kvt_dsa_fault {
    KVT_DSA_FAULT_ENQCMD_RETRY = 1, /* next `count` ENQCMDs rejected (ZF=1); shared WQ */
    KVT_DSA_FAULT_PAGE_FAULT,       /* next `count` descriptors fault at byte `param`
                                       (read fault on src for CRCGEN, write fault on
                                       dst with DSA_COMP_STATUS_WRITE for COPY_CRC);
                                       resolved by the device if BOF is set */
    KVT_DSA_FAULT_BOF_FLAG,         /* next `count` descriptors arrive with BOF set
                                       (INVALID_FLAGS on a WQ without block_on_fault) */
    KVT_DSA_FAULT_CC_FLAG,          /* next `count` descriptors arrive with CC set
                                       (INVALID_FLAGS on CRCGEN / without gen_cap 0x4) */
    KVT_DSA_FAULT_STALE_RESERVED,   /* next `count` descriptors arrive with a nonzero
                                       crc_rsvd (NOZERO_RESERVE) */
    KVT_DSA_FAULT_XFER_ERANGE,      /* next `count` descriptors are checked against a
                                       device max transfer size of `param` bytes */
    KVT_DSA_FAULT_REJECT_ALL,       /* next `count` descriptors complete with status
                                       `param` (0 -> DSA_COMP_INVALID_FLAGS), no work */
    KVT_DSA_FAULT_HANG,             /* next `count` descriptors are accepted and never
                                       executed (a WQ the admin disabled, a hung
                                       device); param > 0: `param` ns later the model
                                       writes their completion record anyway (status
                                       success, no data touched): a late device */
};

typedef struct kvt_dsa_model_stats {
    uint64_t executed;          /* descriptors that reached the execution unit */
    uint64_t dropped;           /* dedicated WQ overflow: descriptor lost (must stay 0) */
    uint64_t enqcmd_rejected;   /* ENQCMD answered ZF=1 */
    uint64_t faults_injected;   /* page faults reported to software */
    uint64_t faults_resolved;   /* page faults resolved by the device (BOF) */
    uint64_t hung;              /* descriptors swallowed by the "hang" fault */
} kvt_dsa_model_stats;

kvt_dsa_model *kvt_dsa_model_create(const kvt_dsa_model_config *cfg); /* NULL + errno */
void kvt_dsa_model_destroy(kvt_dsa_model *m); /* joins the thread; queue must be idle */
kvt_dsa_portal *kvt_dsa_model_portal(kvt_dsa_model *m);
/* WQ description the model advertises (as discovery would read it). */
void kvt_dsa_model_wq_info(const kvt_dsa_model *m, kvt_dsa_wq_info *out);
int kvt_dsa_model_inject(kvt_dsa_model *m, int kind, uint64_t count, uint64_t param);
void kvt_dsa_model_clear_faults(kvt_dsa_model *m);
void kvt_dsa_model_get_stats(kvt_dsa_model *m, kvt_dsa_model_stats *out);
const char *kvt_dsa_fault_name(int kind);
int kvt_dsa_fault_from_name(const char *name); /* -1 if unknown */

/* ------------------------------------------------------------------ */
/* Engine and operations (engine.c)                                    */
/* ------------------------------------------------------------------ */

enum kvt_dsa_wait_mode { KVT_DSA_WAIT_SPIN = 0, KVT_DSA_WAIT_YIELD, KVT_DSA_WAIT_SLEEP };

typedef struct kvt_dsa_counters {
    uint64_t descriptors_submitted;
    uint64_t completed_on_device;  /* descriptors with status SUCCESS */
    uint64_t page_fault_resumes;
    uint64_t enqcmd_retries;
    uint64_t wait_ns;              /* time spent waiting for completions */
    uint64_t bytes_on_device;
    uint64_t below_min_size;       /* ops the gate kept on the CPU */
    uint64_t submit_failures;      /* portal error / retries exhausted -> CPU */
    uint64_t cpu_redo_total;       /* descriptors redone on the CPU (any status) */
    uint64_t timeouts;             /* descriptors not completed within the timeout
                                      (record quarantined, CPU redo, engine disabled) */
    uint64_t commit_ops;           /* block I/O commit copies done with COPY_CRC ops
                                      (kvt_dsa_commit_copy_crc) */
    uint64_t commit_bytes_on_device; /* bytes of them the device copied and checksummed */
    uint64_t commit_bytes_cpu;     /* bytes of them the CPU did instead (refused,
                                      timed out or failed descriptors) */
    uint64_t cpu_redo_by_status[128]; /* indexed by status & 0x7f */
} kvt_dsa_counters;

typedef struct kvt_dsa_selfcheck {
    int ran;
    int crcgen_on_device, crcgen_match;
    int copy_on_device, copy_match;
    int crcgen_status, copy_status; /* last device status seen (0 = none) */
} kvt_dsa_selfcheck;

typedef struct kvt_dsa_engine kvt_dsa_engine;

/* Engine over a portal with a WQ description (size, max_transfer_size,
 * block_on_fault, gen_cap, mode). `name` is "dsa" or "dsa-model". Takes
 * ownership of the portal. `cpu` computes what the device does not (CPU
 * redo, the size gate) and the self-check's reference. min_size 16 KiB,
 * wait yield, timeout 1 s, self-check timeout 2 s (backend.c applies the
 * KVTIER_DSA* settings to the process-wide engines). */
kvt_dsa_engine *kvt_dsa_engine_create(const char *name, kvt_dsa_portal *portal,
                                      const kvt_dsa_wq_info *wq, kvt_crc32c_fn cpu);
void kvt_dsa_engine_destroy(kvt_dsa_engine *e);
/* Runs the 1 MiB self-check for CRCGEN and COPY_CRC; returns 1 and marks the
 * engine enabled only if both completed on the device and matched the CPU.
 * Otherwise 0 and the reason is kept (kvt_dsa_engine_reason). */
int kvt_dsa_engine_selfcheck(kvt_dsa_engine *e);
int kvt_dsa_engine_enabled(const kvt_dsa_engine *e);
const char *kvt_dsa_engine_name(const kvt_dsa_engine *e);
const char *kvt_dsa_engine_reason(const kvt_dsa_engine *e);
const char *kvt_dsa_engine_portal_kind(const kvt_dsa_engine *e);
void kvt_dsa_engine_wq(const kvt_dsa_engine *e, kvt_dsa_wq_info *out);
void kvt_dsa_engine_get_selfcheck(const kvt_dsa_engine *e, kvt_dsa_selfcheck *out);
void kvt_dsa_engine_set_min_size(kvt_dsa_engine *e, size_t min_size);
size_t kvt_dsa_engine_min_size(const kvt_dsa_engine *e);
void kvt_dsa_engine_set_wait(kvt_dsa_engine *e, int mode, long sleep_ns);
int kvt_dsa_engine_wait_mode(const kvt_dsa_engine *e);
void kvt_dsa_engine_set_cache_control(kvt_dsa_engine *e, int on);
/* Per-descriptor completion deadline in ns (> 0), counted from the start of
 * the wait for that descriptor. Default 1 s, env KVTIER_DSA_TIMEOUT_MS. */
void kvt_dsa_engine_set_timeout(kvt_dsa_engine *e, uint64_t timeout_ns);
uint64_t kvt_dsa_engine_timeout(const kvt_dsa_engine *e);
/* How long the self-check waits for each of its descriptors, ns (> 0). */
void kvt_dsa_engine_set_selfcheck_timeout(kvt_dsa_engine *e, uint64_t timeout_ns);
/* 1 once a descriptor timed out (the engine disabled itself; its reason says so). */
int kvt_dsa_engine_dead(const kvt_dsa_engine *e);
void kvt_dsa_engine_get_counters(const kvt_dsa_engine *e, kvt_dsa_counters *out);
void kvt_dsa_engine_reset_counters(kvt_dsa_engine *e);
const char *kvt_dsa_status_name(int status); /* "success", "invalid_flags", ... */
const char *kvt_dsa_wait_name(int mode);
int kvt_dsa_wait_from_name(const char *name); /* -1 if unknown */

/* One operation. The struct itself may live on the caller's stack: the
 * device only reads the descriptor at submission (MOVDIR64B / ENQCMD copy
 * it) and writes the completion record, which is engine-owned heap memory
 * (`comp`, 32-B aligned, from a per-engine pool). kvt_dsa_wait() returns
 * within the engine's timeout per descriptor; when the device has not
 * answered by then, the completion record is quarantined (never freed, never
 * reused, because the device may still write it), the rest of the CRC is
 * redone on the CPU, counter `timeouts` grows and the engine is disabled
 * ("device stopped completing descriptors"). The caller's buffers stay the
 * caller's: after a timeout a late device may still read src (CRCGEN) and,
 * for COPY_CRC, write dst with the same bytes the CPU copied there. */
typedef struct kvt_dsa_op {
    _Alignas(64) struct dsa_hw_desc desc;
    struct dsa_completion_record *comp; /* engine-owned, NULL when none held */
    kvt_dsa_engine *e;
    const uint8_t *src;
    uint8_t *dst;              /* COPY_CRC only */
    size_t len, done, chunk;   /* bytes: total, finished, in the in-flight descriptor */
    uint32_t crc;              /* standard CRC32C of src[0:done] chained from seed */
    int opcode;                /* DSA_OPCODE_CRCGEN or DSA_OPCODE_COPY_CRC */
    int state;                 /* 0 idle/done, 1 in flight */
    int on_device;             /* 1 iff every byte was processed by the device */
    size_t dev_bytes;          /* bytes the device completed (SUCCESS / resumed page fault) */
    int last_status;           /* last device status (status & 0x7f), 0 if none */
    unsigned pf_no_progress;   /* consecutive page faults without progress */
} kvt_dsa_op;

/* Asynchronous API (for the block I/O core). submit() never fails: below the
 * min-size gate, or when the engine is NULL/disabled, the work is done on the
 * CPU right away; wait() then returns immediately. */
void kvt_dsa_crc_submit(kvt_dsa_engine *e, kvt_dsa_op *op, const void *buf, size_t len,
                        uint32_t seed);
void kvt_dsa_copy_crc_submit(kvt_dsa_engine *e, kvt_dsa_op *op, void *dst, const void *src,
                             size_t len, uint32_t seed);
/* Waits for every descriptor of the op (resuming page faults, splitting at
 * max_transfer_size, redoing failures and timeouts on the CPU); returns the
 * standard CRC32C. Bounded: at most the engine timeout per descriptor.
 * COPY_CRC with overlapping dst/src is done on the CPU (CRC of src first,
 * then memmove); the Python binding rejects overlap with ValueError. */
uint32_t kvt_dsa_wait(kvt_dsa_op *op);
/* The block I/O core's commit copy (the copy_crc hook of the "dsa" and
 * "dsa-model" backends, backend.c): when len >= the engine's min size, copy
 * src into dst and chain *crc over src with COPY_CRC descriptors, counting the
 * bytes the device did (commit_bytes_on_device) and those the CPU redid
 * (commit_bytes_cpu); returns 1. Otherwise 0, nothing done: the caller copies
 * on the CPU (and its CRC goes through the active backend). */
int kvt_dsa_commit_copy_crc(kvt_dsa_engine *e, void *dst, const void *src, size_t len, uint32_t *crc);
/* Synchronous helpers. */
uint32_t kvt_dsa_crc(kvt_dsa_engine *e, uint32_t seed, const void *buf, size_t len);
uint32_t kvt_dsa_copy_crc(kvt_dsa_engine *e, void *dst, const void *src, size_t len,
                          uint32_t seed);

/* ------------------------------------------------------------------ */
/* Process-wide engines behind the "dsa" and "dsa-model" CRC backends  */
/* (backend.c)                                                          */
/* ------------------------------------------------------------------ */

enum { KVT_DSA_DEVICE = 0, KVT_DSA_MODEL = 1 };

/* Try to enable the real device once per call: discovery, open, self-check.
 * Returns 1 when enabled. The outcome and reason stay readable through
 * kvt_dsa_global_reason(KVT_DSA_DEVICE). */
int kvt_dsa_enable_device(const char *sysfs_root, const char *dev_root, const char *want);
/* Enable the software model (cfg NULL: defaults; the implicit enable via
 * KVTIER_DSA=model / KVTIER_CRC32C_BACKEND=dsa-model takes its per-descriptor
 * latency from env KVTIER_DSA_MODEL_LATENCY_NS, < 1e9) with optional faults
 * injected before the self-check (reject_status != 0 -> REJECT_ALL with it).
 * Returns 1 when the self-check passed. */
int kvt_dsa_enable_model(const kvt_dsa_model_config *cfg, int reject_status);
void kvt_dsa_disable(int which);
/* Engine read-locked for use (NULL when none exists); release with
 * kvt_dsa_release(). Holding it keeps the engine from being destroyed. */
kvt_dsa_engine *kvt_dsa_acquire(int which);
void kvt_dsa_release(kvt_dsa_engine *e);
kvt_dsa_model *kvt_dsa_global_model(void); /* under kvt_dsa_acquire(KVT_DSA_MODEL) */
int kvt_dsa_global_tried(int which);
/* Last enable outcome / reason (copied into buf), or "<name> disabled:
 * device stopped completing descriptors (...)" once a descriptor timed out. */
void kvt_dsa_global_reason(int which, char *buf, size_t n);

/* Add "dsa" and "dsa-model" to the CRC32C dispatch table
 * (kvt_crc32c_register, with their copy_crc hook); once per process, before
 * kvt_crc32c_select (module import; test programs call it in main). */
void kvt_dsa_register_backends(void);
/* The registered backends' functions. Synchronous; below the min size, or
 * when not enabled, the CPU computes. */
uint32_t kvt_crc32c_dsa(uint32_t crc, const void *buf, size_t len);
uint32_t kvt_crc32c_dsa_model(uint32_t crc, const void *buf, size_t len);
int kvt_dsa_backend_available(void);       /* real WQ enabled + self-check passed;
                                              first call tries discovery once
                                              unless KVTIER_DSA=off */
int kvt_dsa_model_backend_available(void); /* model enabled + self-check passed;
                                              first call enables it when
                                              KVTIER_DSA=model or
                                              KVTIER_CRC32C_BACKEND=dsa-model */

#ifdef __cplusplus
}
#endif
#endif
