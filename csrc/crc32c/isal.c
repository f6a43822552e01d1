/* ISA-L backend: crc32_iscsi(buf, int len, init) returns the raw register,
 * so standard = ~crc32_iscsi(buf, len, ~crc); len is an int: split. */
#include "crc32c.h"

#ifdef KVTIER_HAVE_ISAL
#include <isa-l/crc.h>
#include <limits.h>

#ifndef KVTIER_ISAL_VERSION
#define KVTIER_ISAL_VERSION "unknown"
#endif

/* Largest length passed to one crc32_iscsi call: must fit its `int len`.
 * The C tests rebuild this file with a tiny chunk (-DKVT_ISAL_CHUNK=13) so
 * the split is exercised on every test length without 2 GiB buffers. */
#ifndef KVT_ISAL_CHUNK
#define KVT_ISAL_CHUNK ((size_t)1 << 30)
#endif
_Static_assert(KVT_ISAL_CHUNK > 0 && KVT_ISAL_CHUNK <= INT_MAX, "chunk must fit crc32_iscsi's int len");

uint32_t kvt_crc32c_isal(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    uint32_t raw = ~crc;
    const size_t chunk = KVT_ISAL_CHUNK;
    while (len) {
        size_t n = len < chunk ? len : chunk;
        raw = crc32_iscsi((unsigned char *)p, (int)n, raw);
        p += n;
        len -= n;
    }
    return ~raw;
}

const char *kvt_isal_version(void) { return KVTIER_ISAL_VERSION; }
#else
const char *kvt_isal_version(void) { return 0; }
#endif
