/* libFuzzer harness: differential fuzz of every CRC32C backend compiled in
 * (kvt_crc32c_backends(): isal, sse42, armv8, table, and dsa ones when built)
 * against the bit-at-a-time reference kvt_crc32c_bitwise (csrc/crc32c/ref.c).
 *
 * Input layout: [seed:4][split:2][shift:1][data...]
 *   seed  chained-from CRC value (also tried with 0 and 0xFFFFFFFF)
 *   split split point inside data (mod len+1): crc(crc(seed, A), B) and
 *         kvt_crc32c_combine(crc(seed, A), crc(0, B), |B|) must both equal
 *         the reference over A||B
 *   shift the data is copied to a fresh heap block at offset shift%64, and a
 *         second copy flush against the end of its allocation, so ASan sees
 *         any read past the buffer and odd alignments are covered
 * Any mismatch aborts with the backend, length and values.
 *
 * With -DKVT_FUZZ_DSA_MODEL (and the csrc/dsa sources linked) the "dsa-model" backend
 * (the software DSA device executing real CRCGEN descriptors) is enabled at
 * start with its size gate at 1 byte, so every input goes through it too.
 *
 * Built and run by tests/test_fuzz.py:
 *   clang -fsanitize=fuzzer,address,undefined -Icsrc/crc32c csrc/crc32c/[a-z]*.c \
 *         tests/fuzz/fuzz_crc32c.c [-DKVTIER_HAVE_ISAL ... -lisal]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"

#ifdef KVT_FUZZ_DSA_MODEL
#include "dsa.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("KVTIER_DSA_MIN_SIZE", "1", 1); /* offload every length, not just >= 16 KiB */
    kvt_dsa_register_backends(); /* as the module's import does */
    if (!kvt_dsa_enable_model(NULL, 0)) {
        fprintf(stderr, "fuzz_crc32c: could not enable the dsa-model backend\n");
        abort();
    }
    const kvt_crc32c_backend *b = kvt_crc32c_find("dsa-model");
    if (!b || !b->available()) {
        fprintf(stderr, "fuzz_crc32c: dsa-model backend not available after enabling\n");
        abort();
    }
    return 0;
}
#endif

static void fail(const char *what, const char *backend, size_t len, size_t split, uint32_t seed,
                 uint32_t got, uint32_t want)
{
    fprintf(stderr, "CRC32C MISMATCH (%s) backend=%s len=%zu split=%zu seed=0x%08x got=0x%08x want=0x%08x\n",
            what, backend, len, split, seed, got, want);
    abort();
}

static void check(const kvt_crc32c_backend *b, const uint8_t *d, size_t len, size_t split, uint32_t seed)
{
    uint32_t want = kvt_crc32c_bitwise(seed, d, len);
    uint32_t got = b->fn(seed, d, len);
    if (got != want)
        fail("whole", b->name, len, split, seed, got, want);
    uint32_t a = b->fn(seed, d, split);
    uint32_t chained = b->fn(a, d + split, len - split);
    if (chained != want)
        fail("chained", b->name, len, split, seed, chained, want);
    uint32_t tail = b->fn(0, d + split, len - split);
    uint32_t comb = kvt_crc32c_combine(a, tail, (uint64_t)(len - split));
    if (comb != want)
        fail("combine", b->name, len, split, seed, comb, want);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 7)
        return 0;
    uint32_t seed;
    memcpy(&seed, data, 4);
    size_t split_raw = (size_t)data[4] | ((size_t)data[5] << 8);
    size_t shift = data[6] % 64;
    data += 7;
    size -= 7;
    size_t split = split_raw % (size + 1);

    uint8_t *shifted = malloc(shift + size + 1);
    uint8_t *flush = malloc(size ? size : 1);
    if (!shifted || !flush)
        abort();
    memcpy(shifted + shift, data, size);
    memcpy(flush, data, size);

    size_t n;
    const kvt_crc32c_backend *bs = kvt_crc32c_backends(&n);
    const uint32_t seeds[3] = {seed, 0, 0xFFFFFFFFu};
    for (size_t i = 0; i < n; i++) {
        if (!bs[i].available())
            continue;
        for (int s = 0; s < 3; s++) {
            check(&bs[i], shifted + shift, size, split, seeds[s]);
            check(&bs[i], flush, size, split, seeds[s]);
        }
    }
    /* Once: the reference against the RFC 3720 check value, and the list of
     * backends under test on stderr (tests/test_fuzz.py checks it). */
    static int checked;
    if (!checked) {
        checked = 1;
        fprintf(stderr, "fuzz_crc32c: backends:");
        for (size_t i = 0; i < n; i++)
            if (bs[i].available())
                fprintf(stderr, " %s", bs[i].name);
        fprintf(stderr, "\n");
        if (kvt_crc32c_bitwise(0, "123456789", 9) != 0xE3069283u)
            fail("check value", "bitwise", 9, 0, 0, kvt_crc32c_bitwise(0, "123456789", 9), 0xE3069283u);
    }
    free(shifted);
    free(flush);
    return 0;
}
