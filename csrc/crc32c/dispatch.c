/* The CRC32C dispatch table: every backend compiled in, best first.
 * kvt_crc32c_select() runs once at module import (KVTIER_CRC32C_BACKEND or
 * the best available); kvt_crc32c() then calls through one pointer. */
#include <errno.h>
#include <string.h>

#include "crc32c.h"

static int always(void) { return 1; }
#ifdef KVTIER_HAVE_ISAL
static int isal_available(void) { return 1; }
#endif

/* DSA (csrc/dsa/dsa.h): "dsa" (a real WQ
 * enabled and self-checked) and "dsa-model" (the software model, enabled
 * only explicitly). Weak references so a build of csrc/crc32c alone (e.g.
 * tests/c/Makefile) links without csrc/dsa; the entries are then unavailable.
 * Their available() may run discovery and the 1 MiB self-check the first
 * time (seconds on a slow WQ): a caller holding the Python GIL releases it
 * first (module.c backend_available). */
uint32_t kvt_crc32c_dsa(uint32_t crc, const void *buf, size_t len) __attribute__((weak));
uint32_t kvt_crc32c_dsa_model(uint32_t crc, const void *buf, size_t len) __attribute__((weak));
int kvt_dsa_backend_available(void) __attribute__((weak));
int kvt_dsa_model_backend_available(void) __attribute__((weak));
static int dsa_available(void) { return kvt_dsa_backend_available ? kvt_dsa_backend_available() : 0; }
static int dsa_model_available(void)
{
    return kvt_dsa_model_backend_available ? kvt_dsa_model_backend_available() : 0;
}

/* Order = auto-selection preference, measured (docs/crc32c.md,
 * `python benchmarks/crc32c_bench.py`): isal (ISA-L picks its own
 * AVX-512/PCLMUL folding kernel at run time) ran ~2x sse42 from 4 KiB to
 * 16 MiB, warm and cold; sse42 ~2.9x a serial crc32q loop with a warm
 * cache (cold, memory-bound: ~2x); table (slicing-by-16) ~7.4x a
 * byte-at-a-time table. */
static const kvt_crc32c_backend BACKENDS[] = {
#ifdef KVTIER_HAVE_ISAL
    {"isal", kvt_crc32c_isal, isal_available, "ISA-L crc32_iscsi"},
#endif
#if defined(KVT_CRC32C_HAVE_SSE42)
    {"sse42", kvt_crc32c_sse42, kvt_crc32c_sse42_available, "sse4.2 crc32, 3 streams"},
#endif
#if defined(KVT_CRC32C_HAVE_ARMV8)
    {"armv8", kvt_crc32c_armv8, kvt_crc32c_armv8_available, "armv8 crc32c"},
#endif
    {"table", kvt_crc32c_table, always, "slicing-by-16 table"},
    /* After "table" (always available), so the best-first scan for a
     * CPU backend never reaches them: neither is ever auto-selected. */
    {"dsa", kvt_crc32c_dsa, dsa_available, "Intel DSA CRCGEN (work queue)"},
    {"dsa-model", kvt_crc32c_dsa_model, dsa_model_available, "software model of Intel DSA (not hardware)"},
};
#define N_BACKENDS (sizeof(BACKENDS) / sizeof(BACKENDS[0]))
#define TABLE_INDEX (N_BACKENDS - 3) /* "table" is last before the two DSA entries */

static const kvt_crc32c_backend *active = &BACKENDS[TABLE_INDEX];
static kvt_crc32c_fn active_fn = kvt_crc32c_table;

const kvt_crc32c_backend *kvt_crc32c_backends(size_t *count)
{
    *count = N_BACKENDS;
    return BACKENDS;
}

const kvt_crc32c_backend *kvt_crc32c_find(const char *name)
{
    for (size_t i = 0; i < N_BACKENDS; i++)
        if (strcmp(BACKENDS[i].name, name) == 0)
            return &BACKENDS[i];
    return NULL;
}

const kvt_crc32c_backend *kvt_crc32c_best_cpu(void)
{
    for (size_t i = 0; i < N_BACKENDS; i++)
        if (BACKENDS[i].available())
            return &BACKENDS[i];
    return &BACKENDS[TABLE_INDEX];
}

int kvt_crc32c_select(const char *name)
{
    const kvt_crc32c_backend *b;
    if (name == NULL || name[0] == '\0') {
        b = kvt_crc32c_best_cpu();
    } else {
        b = kvt_crc32c_find(name);
        if (b == NULL) {
            errno = EINVAL;
            return -1;
        }
        if (!b->available()) {
            errno = ENODEV;
            return -1;
        }
    }
    active = b;
    active_fn = b->fn;
    return 0;
}

const kvt_crc32c_backend *kvt_crc32c_active(void) { return active; }

uint32_t kvt_crc32c(uint32_t crc, const void *buf, size_t len)
{
    return active_fn(crc, buf, len);
}
