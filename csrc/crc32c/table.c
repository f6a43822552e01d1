/* Portable CRC32C, byte-at-a-time table (placeholder: slicing-by-8 to come). */
#include "crc32c.h"

static uint32_t T[256];
static int T_ready;

static void init_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (KVT_CRC32C_POLY & (0u - (c & 1u)));
        T[i] = c;
    }
    T_ready = 1;
}

uint32_t kvt_crc32c_table(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    if (!T_ready)
        init_table();
    crc = ~crc;
    while (len--)
        crc = T[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}
