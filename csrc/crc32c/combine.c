/* crc32c_combine: CRC of A||B from CRC(A), CRC(B) and |B|.
 *
 * Appending len2 zero bytes to A multiplies its (raw) register by x^(8*len2)
 * mod P in GF(2); the init/final xor terms cancel because CRC is affine:
 *   crc(A||B) = shift(crc(A), len2) ^ crc(B)
 * where shift() multiplies the reflected value by x^(8*len2) mod P.
 * x^(8*2^k) mod P come from a table filled once by squaring; one
 * multiplication per set bit of len2. */
#include <stdatomic.h>

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

/* x8pow[k] = x^(8 * 2^k) mod P, k = 0..63, filled once (idempotent; atomics
 * so concurrent first callers do not race). */
static _Atomic uint32_t x8pow[64];
static _Atomic int x8pow_ready;

static void x8pow_init(void)
{
    uint32_t p = 1u << 23; /* x^8 in reflected form */
    for (int k = 0; k < 64; k++) {
        atomic_store_explicit(&x8pow[k], p, memory_order_relaxed);
        p = gf2_mulmod(p, p);
    }
    atomic_store_explicit(&x8pow_ready, 1, memory_order_release);
}

uint32_t kvt_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    if (len2 == 0)
        return crc1;
    if (!atomic_load_explicit(&x8pow_ready, memory_order_acquire))
        x8pow_init();
    /* x^(8*len2) = product over set bits k of len2 of x^(8*2^k). */
    uint32_t acc = 1u << 31; /* x^0 */
    for (int k = 0; len2; k++, len2 >>= 1)
        if (len2 & 1)
            acc = gf2_mulmod(acc, atomic_load_explicit(&x8pow[k], memory_order_relaxed));
    return gf2_mulmod(acc, crc1) ^ crc2; /* acc != 0 */
}
