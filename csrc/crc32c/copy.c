/* Fused CRC32C + copy: the copy of a checksummed buffered load.
 *
 * A buffered load is the kernel's copy out of the page cache. Checksumming
 * the copied bytes afterwards, even while they are still in cache, adds
 * ~16 us per MiB on one core (ISA-L at ~66 GB/s) to a ~55 us copy. Instead
 * the load reads each chunk into a small cache-resident bounce buffer and
 * kvt_crc32c_copy() moves it to the caller's buffer in one pass: every
 * 64-byte line is loaded once, written to dst with a non-temporal store (no
 * read-for-ownership of the cold destination line, which is what makes the
 * kernel's own copy slow) and folded into the CRC with carry-less multiplies
 * that run in the shadow of the stores.
 *
 * Folding (Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ Instruction", Intel, 2009), bit-reflected: a 128-bit lane X that
 * lies D bits ahead of lane Y is replaced by
 *     clmul(X.lo, K_lo) ^ clmul(X.hi, K_hi) ^ Y
 * with K_lo = x^(D+32) mod P and K_hi = x^(D-32) mod P, each bit-reflected
 * in 32 bits and shifted left by one (the 33-bit reflected form). P is the
 * CRC-32C polynomial 0x1EDC6F41 (normal form; reflected 0x82F63B78, RFC 3720
 * B.4). Folding keeps the message's residue mod P, so the lanes left at the
 * end are CRCed with the crc32 instruction from a zero register; the initial
 * register was xored into the first four bytes beforehand. The constants were
 * computed with exactly that recipe (x^n mod P by repeated shift-and-reduce);
 * tests/c/test_crc32c.c checks every kernel against the bit-at-a-time
 * reference (lengths 0..1100 at every dst alignment, large lengths, chaining,
 * guard pages) and that no byte outside dst is written.
 *
 * Kernels, best first (kvt_crc32c_copy dispatches once):
 *   avx512-vpclmulqdq  4 zmm accumulators, 256 bytes per step (D = 2048)
 *   pclmulqdq          8 xmm accumulators, 128 bytes per step (D = 1024),
 *                      any x86-64 with PCLMULQDQ + SSE4.2
 *   generic            memcpy + the best CPU backend (no fusion, no NT store)
 * The x86 kernels copy the unaligned head (until dst is 64/16-byte aligned)
 * and the short tail with memcpy + crc32, and end with an sfence so the
 * non-temporal stores are ordered before whatever the caller does next.
 * Compiled per function with target attributes, gated at run time. */
#include "crc32c.h"

#include <string.h>

#if defined(KVT_CRC32C_HAVE_SSE42)
#include <immintrin.h>

/* x^n mod P, reflected 33-bit form (see above). */
#define K2048_LO 0x0dcb17aa4ull /* x^2080 */
#define K2048_HI 0x0b9e02b86ull /* x^2016 */
#define K1024_LO 0x06992cea2ull /* x^1056 */
#define K1024_HI 0x00d3b6092ull /* x^992 */

#define SSE42 __attribute__((target("sse4.2")))
#define PCLMUL __attribute__((target("pclmul,sse4.2")))
#define AVX512 __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

/* Raw-register CRC of the `n` words of a finished fold (from 0). */
SSE42 static uint32_t finish_lanes(const uint64_t *w, size_t n)
{
    uint64_t c = 0;
    for (size_t i = 0; i < n; i++)
        c = _mm_crc32_u64(c, w[i]);
    return (uint32_t)c;
}

/* memcpy + CRC of a short range (head/tail), raw register in and out. */
static uint32_t copy_small(uint32_t raw, unsigned char *d, const unsigned char *s, size_t n)
{
    memcpy(d, s, n);
    return ~kvt_crc32c_sse42(~raw, s, n);
}

AVX512 static uint32_t fold_avx512(uint32_t raw, unsigned char *d, const unsigned char *s, size_t len)
{
    /* len: a multiple of 256, >= 256; d: 64-byte aligned. */
    const __m512i k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)K2048_HI, (long long)K2048_LO));
    __m512i a0 = _mm512_loadu_si512(s), a1 = _mm512_loadu_si512(s + 64);
    __m512i a2 = _mm512_loadu_si512(s + 128), a3 = _mm512_loadu_si512(s + 192);
    _mm512_stream_si512((void *)d, a0);
    _mm512_stream_si512((void *)(d + 64), a1);
    _mm512_stream_si512((void *)(d + 128), a2);
    _mm512_stream_si512((void *)(d + 192), a3);
    a0 = _mm512_xor_si512(a0, _mm512_castsi128_si512(_mm_cvtsi32_si128((int)raw)));
    for (size_t i = 256; i < len; i += 256) {
        __m512i b0 = _mm512_loadu_si512(s + i), b1 = _mm512_loadu_si512(s + i + 64);
        __m512i b2 = _mm512_loadu_si512(s + i + 128), b3 = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512((void *)(d + i), b0);
        _mm512_stream_si512((void *)(d + i + 64), b1);
        _mm512_stream_si512((void *)(d + i + 128), b2);
        _mm512_stream_si512((void *)(d + i + 192), b3);
        /* 0x96: three-way xor */
        a0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k, 0x00), _mm512_clmulepi64_epi128(a0, k, 0x11), b0, 0x96);
        a1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a1, k, 0x00), _mm512_clmulepi64_epi128(a1, k, 0x11), b1, 0x96);
        a2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a2, k, 0x00), _mm512_clmulepi64_epi128(a2, k, 0x11), b2, 0x96);
        a3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a3, k, 0x00), _mm512_clmulepi64_epi128(a3, k, 0x11), b3, 0x96);
    }
    uint64_t w[32] __attribute__((aligned(64)));
    _mm512_store_si512((void *)w, a0);
    _mm512_store_si512((void *)(w + 8), a1);
    _mm512_store_si512((void *)(w + 16), a2);
    _mm512_store_si512((void *)(w + 24), a3);
    return finish_lanes(w, 32);
}

PCLMUL static uint32_t fold_pclmul(uint32_t raw, unsigned char *d, const unsigned char *s, size_t len)
{
    /* len: a multiple of 128, >= 128; d: 16-byte aligned. */
    const __m128i k = _mm_set_epi64x((long long)K1024_HI, (long long)K1024_LO);
    __m128i a[8];
    for (int j = 0; j < 8; j++) {
        a[j] = _mm_loadu_si128((const __m128i *)(s + 16 * j));
        _mm_stream_si128((__m128i *)(d + 16 * j), a[j]);
    }
    a[0] = _mm_xor_si128(a[0], _mm_cvtsi32_si128((int)raw));
    for (size_t i = 128; i < len; i += 128) {
        for (int j = 0; j < 8; j++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16 * j));
            _mm_stream_si128((__m128i *)(d + i + 16 * j), b);
            a[j] = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a[j], k, 0x00), _mm_clmulepi64_si128(a[j], k, 0x11)), b);
        }
    }
    uint64_t w[16] __attribute__((aligned(16)));
    for (int j = 0; j < 8; j++)
        _mm_store_si128((__m128i *)(w + 2 * j), a[j]);
    return finish_lanes(w, 16);
}

/* Head until dst is `align`-aligned, the fold on whole `step`s, the tail. */
static uint32_t fused(uint32_t crc, void *dst, const void *src, size_t len, size_t align, size_t step,
                      uint32_t (*fold)(uint32_t, unsigned char *, const unsigned char *, size_t))
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    uint32_t raw = ~crc;
    size_t head = (size_t)(-(uintptr_t)d & (align - 1));
    if (head > len)
        head = len;
    if (head) {
        raw = copy_small(raw, d, s, head);
        d += head, s += head, len -= head;
    }
    size_t body = len / step * step;
    if (body) {
        raw = fold(raw, d, s, body);
        d += body, s += body, len -= body;
        _mm_sfence(); /* order the non-temporal stores */
    }
    if (len)
        raw = copy_small(raw, d, s, len);
    return ~raw;
}

uint32_t kvt_crc32c_copy_avx512(uint32_t crc, void *dst, const void *src, size_t len)
{
    return fused(crc, dst, src, len, 64, 256, fold_avx512);
}

uint32_t kvt_crc32c_copy_pclmul(uint32_t crc, void *dst, const void *src, size_t len)
{
    return fused(crc, dst, src, len, 16, 128, fold_pclmul);
}

int kvt_crc32c_copy_avx512_available(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
}

int kvt_crc32c_copy_pclmul_available(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
}
#endif /* KVT_CRC32C_HAVE_SSE42 */

uint32_t kvt_crc32c_copy_generic(uint32_t crc, void *dst, const void *src, size_t len)
{
    if (len)
        memcpy(dst, src, len);
    return kvt_crc32c_best_cpu()->fn(crc, src, len);
}

static const kvt_crc32c_copy_kernel kernels[] = {
#if defined(KVT_CRC32C_HAVE_SSE42)
    {"avx512-vpclmulqdq", kvt_crc32c_copy_avx512, kvt_crc32c_copy_avx512_available, 1},
    {"pclmulqdq", kvt_crc32c_copy_pclmul, kvt_crc32c_copy_pclmul_available, 1},
#endif
    {"generic", kvt_crc32c_copy_generic, NULL, 0},
};

const kvt_crc32c_copy_kernel *kvt_crc32c_copy_kernels(size_t *count)
{
    *count = sizeof kernels / sizeof kernels[0];
    return kernels;
}

const kvt_crc32c_copy_kernel *kvt_crc32c_copy_best(void)
{
    static const kvt_crc32c_copy_kernel *_Atomic best; /* idempotent race: same answer */
    const kvt_crc32c_copy_kernel *b = best;
    if (!b) {
        size_t n;
        const kvt_crc32c_copy_kernel *k = kvt_crc32c_copy_kernels(&n);
        for (size_t i = 0; i < n && !b; i++)
            if (!k[i].available || k[i].available())
                b = &k[i];
        best = b;
    }
    return b;
}

uint32_t kvt_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
{
    return kvt_crc32c_copy_best()->fn(crc, dst, src, len);
}
