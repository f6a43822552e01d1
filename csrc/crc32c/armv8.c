/* ARMv8 CRC32C: the CRC32CX/CW/CH/CB instructions (ACLE __crc32cd etc.),
 * compiled per function for +crc so the module still loads on an aarch64
 * core without the (optional in ARMv8.0) CRC extension; available() asks
 * the kernel through getauxval(AT_HWCAP) & HWCAP_CRC32. Built only on
 * aarch64; tested by cross-compiling tests/c with aarch64-linux-gnu-gcc and
 * running under qemu-aarch64 (tests/test_c_engine.py). */
#include "crc32c.h"
#if defined(KVT_CRC32C_HAVE_ARMV8)
#include <arm_acle.h>
#include <string.h>
#include <sys/auxv.h>

#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7) /* linux/arch/arm64/include/uapi/asm/hwcap.h */
#endif

#define ARMCRC __attribute__((target("+crc")))

int kvt_crc32c_armv8_available(void)
{
    return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
}

ARMCRC uint32_t kvt_crc32c_armv8(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = (const unsigned char *)buf;
    uint32_t c = ~crc;
    while (len >= 32) { /* unrolled; one chain (the core merges nothing) */
        uint64_t w[4];
        memcpy(w, p, 32);
        c = __crc32cd(c, w[0]);
        c = __crc32cd(c, w[1]);
        c = __crc32cd(c, w[2]);
        c = __crc32cd(c, w[3]);
        p += 32;
        len -= 32;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __crc32cd(c, w);
        p += 8;
        len -= 8;
    }
    if (len >= 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        c = __crc32cw(c, w);
        p += 4;
        len -= 4;
    }
    if (len >= 2) {
        uint16_t w;
        memcpy(&w, p, 2);
        c = __crc32ch(c, w);
        p += 2;
        len -= 2;
    }
    if (len)
        c = __crc32cb(c, *p);
    return ~c;
}
#endif
