/* Bit-at-a-time CRC32C: the reference oracle (RFC 3720 B.4 polynomial). */
#include "crc32c.h"

uint32_t kvt_crc32c_bitwise(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    crc = ~crc;
    while (len--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (KVT_CRC32C_POLY & (0u - (crc & 1u)));
    }
    return ~crc;
}
