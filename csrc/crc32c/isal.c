/* ISA-L backend: crc32_iscsi(buf, int len, init) returns the raw register,
 * so standard = ~crc32_iscsi(buf, len, ~crc); len is an int: split. */
#include "crc32c.h"

#ifdef KVTIER_HAVE_ISAL
#include <isa-l/crc.h>
#include <limits.h>

#ifndef KVTIER_ISAL_VERSION
#define KVTIER_ISAL_VERSION "unknown"
#endif

uint32_t kvt_crc32c_isal(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    uint32_t raw = ~crc;
    const size_t chunk = (size_t)1 << 30; /* < INT_MAX */
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
