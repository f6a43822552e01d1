/* SSE4.2 CRC32C (placeholder serial loop; 3-stream version to come). */
#if defined(__x86_64__)
#include <nmmintrin.h>
#include <string.h>

#include "crc32c.h"

int kvt_crc32c_sse42_available(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}

__attribute__((target("sse4.2")))
uint32_t kvt_crc32c_sse42(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    uint64_t c = ~crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}
#endif
