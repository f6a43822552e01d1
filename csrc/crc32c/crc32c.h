/* kvtier CRC32C engine: one file per backend behind one dispatch table.
 *
 * CRC-32C (Castagnoli), reflected polynomial 0x82F63B78 (RFC 3720 B.4).
 * Every function here uses the standard presentation: init 0xFFFFFFFF and
 * final xor 0xFFFFFFFF are applied inside, so `crc` is the previous standard
 * value (0 to start) and calls chain:
 *     kvt_crc32c(kvt_crc32c(0, a, na), b, nb) == kvt_crc32c(0, a||b, na+nb)
 * Check value: "123456789" -> 0xE3069283.
 *
 * Plain C11, no Python: callable from the C test programs.
 */
#ifndef KVTIER_CRC32C_H
#define KVTIER_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_CRC32C_POLY 0x82F63B78u /* reflected Castagnoli, RFC 3720 B.4 */

/* Which CPU backends this build compiles (armv8 needs little-endian). */
#if defined(__x86_64__)
#define KVT_CRC32C_HAVE_SSE42 1
#endif
#if defined(__aarch64__) && !defined(__AARCH64EB__)
#define KVT_CRC32C_HAVE_ARMV8 1
#endif

/* One backend: standard presentation, chainable, any length (size_t). */
typedef uint32_t (*kvt_crc32c_fn)(uint32_t crc, const void *buf, size_t len);

typedef struct kvt_crc32c_backend {
    const char *name;        /* "isal", "sse42", "armv8", "table"; registered: "dsa", "dsa-model" */
    kvt_crc32c_fn fn;
    int (*available)(void);  /* 1 when usable on this host/build now */
    const char *features;    /* CPU features / device it uses, for `kvtier info` */
    /* Optional (NULL / 0 for the CPU backends). copy_crc: copy len bytes src
     * -> dst and chain *crc over them in one operation of this backend (the
     * block I/O engine's commit copy, csrc/block/engine.c); 1 when done, 0 when not
     * (below its size gate, not enabled): the caller then checksums and
     * copies on the CPU. slow_probe: available() may take seconds the first
     * time (device discovery and self-check): a caller holding a lock (the
     * Python GIL) releases it around the call. */
    int (*copy_crc)(void *dst, const void *src, size_t len, uint32_t *crc);
    int slow_probe;
} kvt_crc32c_backend;

/* Each backend file defines exactly one of these (only those compiled in). */
uint32_t kvt_crc32c_table(uint32_t crc, const void *buf, size_t len);  /* table.c */
uint32_t kvt_crc32c_sse42(uint32_t crc, const void *buf, size_t len);  /* sse42.c, x86-64 */
uint32_t kvt_crc32c_isal(uint32_t crc, const void *buf, size_t len);   /* isal.c, KVTIER_HAVE_ISAL */
uint32_t kvt_crc32c_armv8(uint32_t crc, const void *buf, size_t len);  /* armv8.c, aarch64 */
int kvt_crc32c_sse42_available(void);
int kvt_crc32c_armv8_available(void);
const char *kvt_isal_version(void);  /* isal.c: version string, or NULL without ISA-L */

/* Bit-at-a-time reference (ref.c): the oracle for tests and fuzzers. */
uint32_t kvt_crc32c_bitwise(uint32_t crc, const void *buf, size_t len);

/* Not dispatched: peers for benchmarks and variants for tests. Same
 * presentation as the backends.
 *   kvt_crc32c_bytewise      byte-at-a-time table (table.c)
 *   kvt_crc32c_slice8/16     slicing-by-8 / -16 (table.c; "table" = slice16)
 *   kvt_crc32c_sse42_serial  one serial crc32q chain (sse42.c, x86-64 only,
 *                            call only when kvt_crc32c_sse42_available()) */
uint32_t kvt_crc32c_bytewise(uint32_t crc, const void *buf, size_t len);
uint32_t kvt_crc32c_slice8(uint32_t crc, const void *buf, size_t len);
uint32_t kvt_crc32c_slice16(uint32_t crc, const void *buf, size_t len);
uint32_t kvt_crc32c_sse42_serial(uint32_t crc, const void *buf, size_t len);
/* Number of wrong entries in the generated tables (0 = tables.h is right). */
int kvt_crc32c_table_check(void);

/* crc32c(A||B) from crc1 = crc32c(A), crc2 = crc32c(B), len2 = |B| (combine.c).
 * GF(2) shift by len2 zero bytes, O(log len2). */
uint32_t kvt_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

/* Fused CRC32C + copy (copy.c): copies len bytes src -> dst (no overlap) and
 * returns crc continued over them (standard presentation, chains like
 * kvt_crc32c). The x86 kernels write dst with non-temporal stores: the bytes
 * go to memory, not into this core's cache. */
typedef uint32_t (*kvt_crc32c_copy_fn)(uint32_t crc, void *dst, const void *src, size_t len);
typedef struct kvt_crc32c_copy_kernel {
    const char *name;       /* "avx512-vpclmulqdq", "pclmulqdq", "generic" */
    kvt_crc32c_copy_fn fn;
    int (*available)(void); /* NULL: always */
    int fused;              /* 1: one pass (folds while it copies); 0: "generic", memcpy then the CRC */
} kvt_crc32c_copy_kernel;
const kvt_crc32c_copy_kernel *kvt_crc32c_copy_kernels(size_t *count); /* best first */
const kvt_crc32c_copy_kernel *kvt_crc32c_copy_best(void);            /* first available */
uint32_t kvt_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len); /* best */
uint32_t kvt_crc32c_copy_generic(uint32_t crc, void *dst, const void *src, size_t len);
#if defined(KVT_CRC32C_HAVE_SSE42)
uint32_t kvt_crc32c_copy_avx512(uint32_t crc, void *dst, const void *src, size_t len);
uint32_t kvt_crc32c_copy_pclmul(uint32_t crc, void *dst, const void *src, size_t len);
int kvt_crc32c_copy_avx512_available(void);
int kvt_crc32c_copy_pclmul_available(void);
#endif

/* Dispatch (dispatch.c). The table lists every CPU backend compiled in,
 * best first, then the registered ones (never auto-selected);
 * kvt_crc32c_select() is called once at module import. */
const kvt_crc32c_backend *kvt_crc32c_backends(size_t *count);
/* Add a backend defined elsewhere (csrc/dsa registers "dsa" and "dsa-model"):
 * *b is copied. Call before kvt_crc32c_select, from one thread (module
 * import, a test's main). 0, or -1 with errno EEXIST (the name is taken) or
 * ENOSPC (KVT_CRC32C_MAX_REGISTERED reached). */
#define KVT_CRC32C_MAX_REGISTERED 4
int kvt_crc32c_register(const kvt_crc32c_backend *b);
const kvt_crc32c_backend *kvt_crc32c_find(const char *name); /* NULL if not compiled in */
/* name == NULL or "": best available. Returns 0, or -1 when the name is
 * unknown (errno EINVAL) or not available on this host (errno ENODEV). */
int kvt_crc32c_select(const char *name);
const kvt_crc32c_backend *kvt_crc32c_active(void);
/* Best available CPU (software) backend: never a registered one. Used for
 * CPU redo. Found once (CPU features do not change), then one load. */
const kvt_crc32c_backend *kvt_crc32c_best_cpu(void);
/* CRC through the active backend. */
uint32_t kvt_crc32c(uint32_t crc, const void *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
