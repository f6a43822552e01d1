/* crc32c_combine: CRC of A||B from CRC(A), CRC(B) and |B|.
 *
 * Appending len2 zero bytes to A multiplies its (raw) register by x^(8*len2)
 * mod P in GF(2); the init/final xor terms cancel because CRC is affine:
 *   crc(A||B) = shift(crc(A), len2) ^ crc(B)
 * where shift() multiplies the reflected value by x^(8*len2) mod P.
 * x^(2^k) mod P are computed by squaring; O(log len2) multiplications. */
#include "crc32c.h"

/* a*b mod P, reflected representation (bit 31 = x^0). */
static uint32_t gf2_mulmod(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    if (a == 0) /* the loop below stops at a's lowest set bit: none (found by tests/fuzz) */
        return 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ KVT_CRC32C_POLY : b >> 1;
    }
    return p;
}

uint32_t kvt_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    if (len2 == 0)
        return crc1;
    /* x^(8*len2) = product over set bits k of len2 of x^(8*2^k). */
    uint32_t xpow = 1u << 23;          /* x^8 in reflected form */
    uint32_t acc = 1u << 31;           /* x^0 */
    while (len2) {
        if (len2 & 1)
            acc = gf2_mulmod(acc, xpow);
        len2 >>= 1;
        if (len2)
            xpow = gf2_mulmod(xpow, xpow);
    }
    return gf2_mulmod(acc, crc1) ^ crc2; /* acc != 0 */
}
