/* The CRC32C dispatch table: every CPU backend compiled in, best first, then
 * the backends registered at run time (kvt_crc32c_register: csrc/dsa's
 * "dsa" and "dsa-model"), which this file does not know by name.
 * kvt_crc32c_select() runs once at module import (KVTIER_CRC32C_BACKEND or
 * the best CPU backend); kvt_crc32c() then calls through one pointer. */
#include <errno.h>
#include <string.h>

#include "crc32c.h"

static int always(void) { return 1; }
#ifdef KVTIER_HAVE_ISAL
static int isal_available(void) { return 1; }
#endif

/* Order = auto-selection preference, measured (docs/crc32c.md,
 * `python benchmarks/crc32c_bench.py`): isal (ISA-L picks its own
 * AVX-512/PCLMUL folding kernel at run time) ran ~2x sse42 from 4 KiB to
 * 16 MiB, warm and cold; sse42 ~2.9x a serial crc32q loop with a warm
 * cache (cold, memory-bound: ~2x); table (slicing-by-16) ~7.4x a
 * byte-at-a-time table. The empty slots after "table" take the registered
 * backends: the best-first scan for a CPU backend never reaches them, so
 * none is ever auto-selected. */
static kvt_crc32c_backend BACKENDS[] = {
#ifdef KVTIER_HAVE_ISAL
    {.name = "isal", .fn = kvt_crc32c_isal, .available = isal_available, .features = "ISA-L crc32_iscsi"},
#endif
#if defined(KVT_CRC32C_HAVE_SSE42)
    {.name = "sse42", .fn = kvt_crc32c_sse42, .available = kvt_crc32c_sse42_available, .features = "sse4.2 crc32, 3 streams"},
#endif
#if defined(KVT_CRC32C_HAVE_ARMV8)
    {.name = "armv8", .fn = kvt_crc32c_armv8, .available = kvt_crc32c_armv8_available, .features = "armv8 crc32c"},
#endif
    {.name = "table", .fn = kvt_crc32c_table, .available = always, .features = "slicing-by-16 table"},
    {0}, {0}, {0}, {0}, /* KVT_CRC32C_MAX_REGISTERED */
};
_Static_assert(KVT_CRC32C_MAX_REGISTERED == 4, "one empty slot per registered backend");
#define N_SLOTS (sizeof(BACKENDS) / sizeof(BACKENDS[0]))
#define N_CPU (N_SLOTS - KVT_CRC32C_MAX_REGISTERED)
#define TABLE_INDEX (N_CPU - 1) /* "table" is the last CPU backend */

static size_t n_backends = N_CPU;
static const kvt_crc32c_backend *active = &BACKENDS[TABLE_INDEX];
static kvt_crc32c_fn active_fn = kvt_crc32c_table;
static const kvt_crc32c_backend *_Atomic best_cpu; /* found once: an idempotent race */

const kvt_crc32c_backend *kvt_crc32c_backends(size_t *count)
{
    *count = n_backends;
    return BACKENDS;
}

const kvt_crc32c_backend *kvt_crc32c_find(const char *name)
{
    for (size_t i = 0; i < n_backends; i++)
        if (strcmp(BACKENDS[i].name, name) == 0)
            return &BACKENDS[i];
    return NULL;
}

int kvt_crc32c_register(const kvt_crc32c_backend *b)
{
    if (kvt_crc32c_find(b->name) != NULL) {
        errno = EEXIST;
        return -1;
    }
    if (n_backends == N_SLOTS) {
        errno = ENOSPC;
        return -1;
    }
    BACKENDS[n_backends++] = *b;
    return 0;
}

const kvt_crc32c_backend *kvt_crc32c_best_cpu(void)
{
    const kvt_crc32c_backend *b = best_cpu;
    if (b == NULL) {
        b = &BACKENDS[TABLE_INDEX];
        for (size_t i = 0; i < N_CPU; i++)
            if (BACKENDS[i].available()) {
                b = &BACKENDS[i];
                break;
            }
        best_cpu = b;
    }
    return b;
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
