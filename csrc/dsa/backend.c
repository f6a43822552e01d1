/* The process-wide DSA engines behind the "dsa" (a real WQ, discovered,
 * opened and self-checked) and "dsa-model" (the software model, enabled only
 * explicitly) CRC32C backends: their enable/disable, fork handling, the
 * KVTIER_DSA* settings, and their registration in the CRC32C dispatch table
 * (kvt_dsa_register_backends) with a copy_crc hook, through which the block
 * I/O engine's commit copy reaches DSA without knowing it by name.
 * Plain C11 + POSIX, no Python. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dsa.h"
#include "env.h"

/* ------------------------------------------------------------------ */
/* Process-wide engines                                                */
/* ------------------------------------------------------------------ */

static pthread_rwlock_t g_lock = PTHREAD_RWLOCK_INITIALIZER;
static pthread_mutex_t g_enable_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_dsa_engine *g_eng[2];
static kvt_dsa_model *g_model;
static int g_tried[2];
static char g_reason[2][1200];

/* fork(): the child has no model thread and no right to the parent's WQ
 * (its PASID / dedicated-WQ ownership belong to the parent), and the locks
 * may have been held by another thread. The child forgets the engines
 * (leaked, never used) and computes on the CPU. */
static void atfork_child(void)
{
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER;
    pthread_mutex_t fresh_mu = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&g_lock, &fresh, sizeof fresh);
    memcpy(&g_enable_mu, &fresh_mu, sizeof fresh_mu);
    for (int i = 0; i < 2; i++) {
        if (g_eng[i]) {
            g_eng[i] = NULL;
            snprintf(g_reason[i], sizeof g_reason[i], "%s: disabled in a fork()ed child (CPU computes)",
                     i == KVT_DSA_MODEL ? "dsa-model" : "dsa");
        }
    }
    g_model = NULL;
}

static pthread_once_t once_atfork = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

static void install(int which, kvt_dsa_engine *e, kvt_dsa_model *m)
{
    pthread_once(&once_atfork, register_atfork);
    pthread_rwlock_wrlock(&g_lock);
    kvt_dsa_engine *old = g_eng[which];
    g_eng[which] = e;
    if (which == KVT_DSA_MODEL)
        g_model = m;
    pthread_rwlock_unlock(&g_lock);
    kvt_dsa_engine_destroy(old); /* no reader holds it any more */
}

/* KVTIER_DSA_TIMEOUT_MS, KVTIER_DSA_MIN_SIZE, KVTIER_DSA_WAIT and
 * KVTIER_DSA_SELFCHECK_TIMEOUT_MS on a new engine (env.h: a value that does
 * not parse leaves the default; kvtier._blockio.env refuses it at import). */
static kvt_dsa_engine *engine_new(const char *name, kvt_dsa_portal *p, const kvt_dsa_wq_info *w)
{
    kvt_dsa_engine *e = kvt_dsa_engine_create(name, p, w, kvt_crc32c_best_cpu()->fn);
    if (!e)
        return NULL;
    uint64_t v;
    if (kvt_env_uint("KVTIER_DSA_TIMEOUT_MS", &v) == 1)
        kvt_dsa_engine_set_timeout(e, v * 1000000ull);
    if (kvt_env_uint("KVTIER_DSA_MIN_SIZE", &v) == 1)
        kvt_dsa_engine_set_min_size(e, (size_t)v);
    int mode = kvt_env_choice("KVTIER_DSA_WAIT") /* KVT_DSA_WAIT_* order */;
    if (mode >= 0)
        kvt_dsa_engine_set_wait(e, mode, 0);
    if (kvt_env_uint("KVTIER_DSA_SELFCHECK_TIMEOUT_MS", &v) == 1)
        kvt_dsa_engine_set_selfcheck_timeout(e, v * 1000000ull);
    return e;
}

static void set_reason(int which, const char *s)
{
    pthread_rwlock_wrlock(&g_lock);
    snprintf(g_reason[which], sizeof g_reason[which], "%s", s);
    g_tried[which] = 1;
    pthread_rwlock_unlock(&g_lock);
}

int kvt_dsa_enable_device(const char *sysfs_root, const char *dev_root, const char *want)
{
    static kvt_dsa_discovery d; /* large; guarded by g_enable_mu */
    char why[1200];
    int ok = 0;
    pthread_mutex_lock(&g_enable_mu);
    kvt_dsa_discover(sysfs_root, dev_root, want, &d);
    if (!d.devices_dir_present) {
        snprintf(why, sizeof why, "no DSA devices found (%s absent)", d.devices_dir);
        goto out;
    }
    int idx[KVT_DSA_MAX_WQS];
    size_t k = kvt_dsa_candidates(&d, idx, KVT_DSA_MAX_WQS);
    if (d.n == 0) {
        snprintf(why, sizeof why, "no DSA devices found (no WQs under %s)", d.devices_dir);
        goto out;
    }
    size_t used = (size_t)snprintf(why, sizeof why, "WQ found but not usable:");
    for (size_t i = 0; i < d.n && used < sizeof why; i++)
        if (!d.wqs[i].usable)
            used += (size_t)snprintf(why + used, sizeof why - used, " %s: %s;", d.wqs[i].name,
                                     d.wqs[i].reason);
    for (size_t j = 0; j < k; j++) {
        const kvt_dsa_wq_info *w = &d.wqs[idx[j]];
        kvt_dsa_portal *p = kvt_dsa_portal_open(w);
        if (!p) {
            if (used < sizeof why)
                used += (size_t)snprintf(why + used, sizeof why - used, " %s: open %s: %s;",
                                         w->name, w->path, strerror(errno));
            continue;
        }
        kvt_dsa_engine *e = engine_new("dsa", p, w);
        if (!e) {
            p->ops->close(p);
            continue;
        }
        if (kvt_dsa_engine_selfcheck(e)) {
            install(KVT_DSA_DEVICE, e, NULL);
            snprintf(why, sizeof why, "enabled: dsa (%s %s size %u max_transfer_size %llu bof %d, %s)",
                     w->name, w->mode, w->size, (unsigned long long)w->max_transfer_size,
                     w->block_on_fault, p->kind);
            ok = 1;
            goto out;
        }
        if (used < sizeof why)
            used += (size_t)snprintf(why + used, sizeof why - used, " %s: %s;", w->name,
                                     kvt_dsa_engine_reason(e));
        kvt_dsa_engine_destroy(e);
    }
out:
    set_reason(KVT_DSA_DEVICE, why);
    pthread_mutex_unlock(&g_enable_mu);
    return ok;
}

int kvt_dsa_enable_model(const kvt_dsa_model_config *cfg, int reject_status)
{
    char why[1200];
    pthread_mutex_lock(&g_enable_mu);
    kvt_dsa_model *m = kvt_dsa_model_create(cfg);
    if (!m) {
        snprintf(why, sizeof why, "dsa-model: cannot create the model: %s", strerror(errno));
        set_reason(KVT_DSA_MODEL, why);
        pthread_mutex_unlock(&g_enable_mu);
        return 0;
    }
    if (reject_status)
        kvt_dsa_model_inject(m, KVT_DSA_FAULT_REJECT_ALL, UINT64_MAX, (uint64_t)reject_status);
    kvt_dsa_wq_info w;
    kvt_dsa_model_wq_info(m, &w);
    kvt_dsa_engine *e = engine_new("dsa-model", kvt_dsa_model_portal(m), &w);
    if (!e) {
        kvt_dsa_model_destroy(m);
        set_reason(KVT_DSA_MODEL, "dsa-model: out of memory");
        pthread_mutex_unlock(&g_enable_mu);
        return 0;
    }
    int ok = kvt_dsa_engine_selfcheck(e);
    /* Kept installed either way so status and counters stay readable;
     * the backend is available only when the self-check passed. */
    install(KVT_DSA_MODEL, e, m);
    if (ok)
        snprintf(why, sizeof why, "enabled: dsa-model (software model, %s size %u max_transfer_size %llu bof %d)",
                 w.mode, w.size, (unsigned long long)w.max_transfer_size, w.block_on_fault);
    else
        snprintf(why, sizeof why, "dsa-model not enabled: %s", kvt_dsa_engine_reason(e));
    set_reason(KVT_DSA_MODEL, why);
    pthread_mutex_unlock(&g_enable_mu);
    return ok;
}

void kvt_dsa_disable(int which)
{
    pthread_mutex_lock(&g_enable_mu);
    install(which, NULL, NULL);
    set_reason(which, which == KVT_DSA_MODEL ? "dsa-model disabled" : "dsa disabled");
    pthread_mutex_unlock(&g_enable_mu);
}

kvt_dsa_engine *kvt_dsa_acquire(int which)
{
    pthread_rwlock_rdlock(&g_lock);
    kvt_dsa_engine *e = g_eng[which];
    if (!e)
        pthread_rwlock_unlock(&g_lock);
    return e;
}

void kvt_dsa_release(kvt_dsa_engine *e)
{
    if (e)
        pthread_rwlock_unlock(&g_lock);
}

kvt_dsa_model *kvt_dsa_global_model(void) { return g_model; }

int kvt_dsa_global_tried(int which)
{
    pthread_rwlock_rdlock(&g_lock);
    int t = g_tried[which];
    pthread_rwlock_unlock(&g_lock);
    return t;
}

void kvt_dsa_global_reason(int which, char *buf, size_t n)
{
    pthread_rwlock_rdlock(&g_lock);
    kvt_dsa_engine *e = g_eng[which];
    if (e && kvt_dsa_engine_dead(e))
        snprintf(buf, n, "%s disabled: %s", kvt_dsa_engine_name(e), kvt_dsa_engine_reason(e));
    else
        snprintf(buf, n, "%s", g_reason[which]);
    pthread_rwlock_unlock(&g_lock);
}

static uint32_t backend_crc(int which, uint32_t crc, const void *buf, size_t len)
{
    kvt_dsa_engine *e = kvt_dsa_acquire(which);
    if (!e)
        return kvt_crc32c_best_cpu()->fn(crc, buf, len);
    uint32_t r = kvt_dsa_crc(e, crc, buf, len);
    kvt_dsa_release(e);
    return r;
}

/* The copy_crc hook (crc32c.h): the engine read-locked and enabled, or 0
 * (the caller copies and checksums on the CPU). */
static int backend_copy_crc(int which, void *dst, const void *src, size_t len, uint32_t *crc)
{
    kvt_dsa_engine *e = kvt_dsa_acquire(which);
    if (e == NULL)
        return 0;
    int done = kvt_dsa_engine_enabled(e) && kvt_dsa_commit_copy_crc(e, dst, src, len, crc);
    kvt_dsa_release(e);
    return done;
}

static int dsa_copy_crc(void *dst, const void *src, size_t len, uint32_t *crc)
{
    return backend_copy_crc(KVT_DSA_DEVICE, dst, src, len, crc);
}

static int dsa_model_copy_crc(void *dst, const void *src, size_t len, uint32_t *crc)
{
    return backend_copy_crc(KVT_DSA_MODEL, dst, src, len, crc);
}

uint32_t kvt_crc32c_dsa(uint32_t crc, const void *buf, size_t len)
{
    return backend_crc(KVT_DSA_DEVICE, crc, buf, len);
}

uint32_t kvt_crc32c_dsa_model(uint32_t crc, const void *buf, size_t len)
{
    return backend_crc(KVT_DSA_MODEL, crc, buf, len);
}

static int engine_enabled(int which)
{
    pthread_rwlock_rdlock(&g_lock);
    int r = kvt_dsa_engine_enabled(g_eng[which]);
    pthread_rwlock_unlock(&g_lock);
    return r;
}

static pthread_once_t once_device = PTHREAD_ONCE_INIT;
static pthread_once_t once_model = PTHREAD_ONCE_INIT;

enum { DSA_MODE_MODEL = 0, DSA_MODE_OFF = 1 }; /* KVTIER_DSA's words (env.c) */

static void try_device_once(void)
{
    if (kvt_env_choice("KVTIER_DSA") == DSA_MODE_OFF) {
        set_reason(KVT_DSA_DEVICE, "dsa: not probed (KVTIER_DSA=off)");
        return;
    }
    if (!kvt_dsa_global_tried(KVT_DSA_DEVICE))
        kvt_dsa_enable_device(NULL, NULL, NULL);
}

static void try_model_once(void)
{
    /* The model is only ever enabled explicitly. */
    const char *forced = getenv("KVTIER_CRC32C_BACKEND");
    if ((kvt_env_choice("KVTIER_DSA") == DSA_MODE_MODEL || (forced && strcmp(forced, "dsa-model") == 0)) &&
        !kvt_dsa_global_tried(KVT_DSA_MODEL)) {
        uint64_t lat;
        if (kvt_env_uint("KVTIER_DSA_MODEL_LATENCY_NS", &lat) == 1) {
            kvt_dsa_model_config cfg = {.size = 32, .max_transfer_size = 2u << 20,
                                        .gen_cap = KVT_DSA_GENCAP_CACHE_CONTROL | KVT_DSA_GENCAP_BLOCK_ON_FAULT,
                                        .latency_ns = (unsigned)lat};
            kvt_dsa_enable_model(&cfg, 0);
            return;
        }
        kvt_dsa_enable_model(NULL, 0);
    }
}

int kvt_dsa_backend_available(void)
{
    pthread_once(&once_device, try_device_once);
    return engine_enabled(KVT_DSA_DEVICE);
}

int kvt_dsa_model_backend_available(void)
{
    pthread_once(&once_model, try_model_once);
    return engine_enabled(KVT_DSA_MODEL);
}

/* Listed after the CPU backends, never auto-selected; available() may run
 * discovery and the 1 MiB self-check the first time (slow_probe). */
static const kvt_crc32c_backend DSA_BACKENDS[] = {
    {"dsa", kvt_crc32c_dsa, kvt_dsa_backend_available, "Intel DSA CRCGEN (work queue)", dsa_copy_crc, 1},
    {"dsa-model", kvt_crc32c_dsa_model, kvt_dsa_model_backend_available,
     "software model of Intel DSA (not hardware)", dsa_model_copy_crc, 1},
};

static pthread_once_t once_register = PTHREAD_ONCE_INIT;

static void register_backends(void)
{
    for (size_t i = 0; i < sizeof DSA_BACKENDS / sizeof DSA_BACKENDS[0]; i++)
        kvt_crc32c_register(&DSA_BACKENDS[i]);
}

void kvt_dsa_register_backends(void)
{
    pthread_once(&once_register, register_backends);
}
