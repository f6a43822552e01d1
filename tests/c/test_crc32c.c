/* C tests of the CRC32C engine (csrc/crc32c): every backend compiled in and
 * available here, plus the non-dispatched variants, against the bit-at-a-time
 * reference kvt_crc32c_bitwise.
 *
 *   test_crc32c [--require NAME]...
 *
 * --require NAME fails the run if backend NAME is not compiled in and
 * available (so a cross build under qemu proves the armv8 path really ran).
 * Last line of output: "N passed, N failed"; exit status 0 iff none failed.
 * Built and run by tests/test_c_engine.py (see tests/c/Makefile). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "crc32c.h"

typedef struct {
    const char *name;
    kvt_crc32c_fn fn;
} impl;

static impl impls[16];
static int n_impls;
static long passed, failed;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (cond) {                                                            \
            passed++;                                                          \
        } else {                                                               \
            failed++;                                                          \
            if (failed <= 30) {                                                \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                    \
                printf(__VA_ARGS__);                                           \
                printf("\n");                                                  \
            }                                                                  \
        }                                                                      \
    } while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) /* xorshift64*: deterministic test data */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static void fill(unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(rnd() >> 56);
}

static void add_impl(const char *name, kvt_crc32c_fn fn)
{
    impls[n_impls].name = name;
    impls[n_impls].fn = fn;
    n_impls++;
}

/* Compare every implementation with the oracle on one input. */
static void check_all(const void *buf, size_t len, uint32_t seed, const char *what)
{
    uint32_t want = kvt_crc32c_bitwise(seed, buf, len);
    for (int i = 0; i < n_impls; i++) {
        uint32_t got = impls[i].fn(seed, buf, len);
        CHECK(got == want, "%s %s len=%zu seed=%08" PRIx32 " got %08" PRIx32 " want %08" PRIx32,
              impls[i].name, what, len, seed, got, want);
    }
}

static void test_tables(void)
{
    int bad = kvt_crc32c_table_check();
    CHECK(bad == 0, "tables.h: %d wrong entries (regenerate with gen_tables.py)", bad);
}

static void test_check_values(void)
{
    static const struct {
        const char *what;
        unsigned char data[32];
        size_t len;
        uint32_t crc;
    } cv[] = {
        {"123456789", "123456789", 9, 0xE3069283u},
        {"32 x 0x00", {0}, 32, 0x8A9136AAu},
        {"32 x 0xFF", {0}, 32, 0x62A8AB43u},
        {"0..31", {0}, 32, 0x46DD794Eu},
        {"31..0", {0}, 32, 0x113FDB5Cu},
    };
    unsigned char v[5][32];
    for (int k = 0; k < 5; k++)
        memcpy(v[k], cv[k].data, 32);
    memset(v[2], 0xFF, 32);
    for (int i = 0; i < 32; i++) {
        v[3][i] = (unsigned char)i;
        v[4][i] = (unsigned char)(31 - i);
    }
    for (int k = 0; k < 5; k++) {
        CHECK(kvt_crc32c_bitwise(0, v[k], cv[k].len) == cv[k].crc, "bitwise check value %s", cv[k].what);
        for (int i = 0; i < n_impls; i++) {
            uint32_t got = impls[i].fn(0, v[k], cv[k].len);
            CHECK(got == cv[k].crc, "%s check value %s (RFC 3720 B.4): got %08" PRIx32 " want %08" PRIx32,
                  impls[i].name, cv[k].what, got, cv[k].crc);
        }
    }
}

static uint32_t seed_for(size_t i)
{
    switch (i % 3) {
    case 0: return 0;
    case 1: return 0xFFFFFFFFu;
    default: return (uint32_t)rnd();
    }
}

/* Lengths 0..4096: all 64 offsets for len <= 1024 (seeds rotating), one
 * offset per length above that with all three seed kinds. */
static void test_lengths_offsets(void)
{
    size_t cap = 4096 + 64 + 8;
    unsigned char *buf = malloc(cap);
    fill(buf, cap);
    for (size_t len = 0; len <= 4096; len++) {
        if (len <= 1024) {
            for (size_t off = 0; off < 64; off++)
                check_all(buf + off, len, seed_for(len + off), "len/offset");
        } else {
            for (int s = 0; s < 3; s++)
                check_all(buf + (len % 64), len, seed_for((size_t)s), "len");
        }
    }
    free(buf);
}

/* Large and odd lengths around the sse42 lane sizes (3*256, 3*8192). */
static void test_large(void)
{
    static const size_t lens[] = {
        767, 768, 769, 1535, 1536, 1537, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 3 * 8192 + 767,
        3 * 8192 + 768, 6 * 8192 + 3 * 256 + 7, 65535, 65536, 65537, 100003, 1048573, (1 << 20) + 3,
        4194311,
    };
    size_t cap = 4194311 + 16;
    unsigned char *buf = malloc(cap);
    fill(buf, cap);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
        for (size_t off = 0; off < 8; off += (lens[i] > 200000 ? 3 : 1))
            check_all(buf + off, lens[i], seed_for(i + off), "large");
    free(buf);
}

/* Data flush against a PROT_NONE guard page at the end (and at the start):
 * an over-read by any backend is a SIGSEGV, i.e. a failed run. */
static void test_guard_pages(void)
{
    long pg = sysconf(_SC_PAGESIZE);
    size_t data_pages = 64 * 1024 / (size_t)pg + 1;
    size_t total = (data_pages + 2) * (size_t)pg;
    unsigned char *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(map != MAP_FAILED, "mmap: %s", strerror(errno));
    if (map == MAP_FAILED)
        return;
    unsigned char *start = map + pg, *end = map + pg + data_pages * (size_t)pg;
    mprotect(map, (size_t)pg, PROT_NONE);
    mprotect(end, (size_t)pg, PROT_NONE);
    fill(start, (size_t)(end - start));
    static const size_t big[] = {3 * 256, 3 * 8192 + 5, 64 * 1024};
    for (size_t len = 0; len <= 800; len++) {
        check_all(end - len, len, seed_for(len), "flush-end");
        check_all(start, len, seed_for(len + 1), "flush-start");
    }
    for (size_t i = 0; i < 3; i++) {
        check_all(end - big[i], big[i], seed_for(i), "flush-end big");
        check_all(start, big[i], seed_for(i), "flush-start big");
    }
    munmap(map, total);
}

/* CRC of n zero bytes by double-and-add over combine, from 1 zero byte. */
static uint32_t zeros_crc(uint64_t n)
{
    unsigned char zero = 0;
    uint32_t acc = 0, pw = kvt_crc32c_bitwise(0, &zero, 1); /* acc = Z(0) = 0 */
    uint64_t pwlen = 1;
    while (n) {
        if (n & 1)
            acc = kvt_crc32c_combine(acc, pw, pwlen);
        n >>= 1;
        if (n) {
            pw = kvt_crc32c_combine(pw, pw, pwlen);
            pwlen *= 2;
        }
    }
    return acc;
}

/* Chaining at every split point of a short input, 3-way splits, and
 * kvt_crc32c_combine at every split point plus large lengths. */
static void test_chaining_combine(void)
{
    enum { N = 300 };
    unsigned char buf[N];
    fill(buf, N);
    uint32_t whole = kvt_crc32c_bitwise(0, buf, N);
    for (int i = 0; i < n_impls; i++) {
        kvt_crc32c_fn f = impls[i].fn;
        for (size_t k = 0; k <= N; k++) {
            uint32_t a = f(0, buf, k);
            CHECK(f(a, buf + k, N - k) == whole, "%s chain split %zu", impls[i].name, k);
            uint32_t b = f(0, buf + k, N - k);
            CHECK(kvt_crc32c_combine(a, b, N - k) == whole, "%s combine split %zu", impls[i].name, k);
        }
        for (size_t k = 0; k <= N; k += 7)
            for (size_t j = k; j <= N; j += 13) {
                uint32_t c = f(f(f(0, buf, k), buf + k, j - k), buf + j, N - j);
                CHECK(c == whole, "%s 3-way split %zu/%zu", impls[i].name, k, j);
            }
    }
    CHECK(kvt_crc32c_combine(0x12345678u, 0, 0) == 0x12345678u, "combine len2=0");
    /* Large len2 (> 4 GiB): combine(crc(A), crc(Z), |Z|) for zeros Z built by
     * doubling must equal the direct CRC on a 1 MiB input and agree at 2^33. */
    size_t big = 1u << 20;
    unsigned char *z = calloc(big, 1);
    uint32_t z1 = kvt_crc32c_bitwise(0, z, big);
    uint32_t z512 = kvt_crc32c_bitwise(0, z, big / 2);
    CHECK(kvt_crc32c_combine(z512, z512, big / 2) == z1, "combine zeros 512K+512K");
    uint32_t a = kvt_crc32c_bitwise(0, buf, N);
    CHECK(kvt_crc32c_combine(a, z1, big) == kvt_crc32c_bitwise(a, z, big), "combine A+1MiB zeros");
    uint64_t n = big;
    uint32_t zn = z1;
    while (n < (1ull << 33)) { /* zn = crc of n zero bytes, by doubling 1 MiB */
        zn = kvt_crc32c_combine(zn, zn, n);
        n *= 2;
    }
    CHECK(zeros_crc(big) == z1, "combine double-and-add 1 MiB zeros");
    CHECK(zeros_crc(1ull << 33) == zn, "combine 8 GiB of zeros, two associations");
    CHECK(kvt_crc32c_combine(zeros_crc((1ull << 32) + 12345), zeros_crc((1ull << 32) - 12345),
                             (1ull << 32) - 12345) == zn, "combine 8 GiB of zeros, odd split");
    free(z);
}

static void test_dispatch(void)
{
    errno = 0;
    CHECK(kvt_crc32c_select("no-such-backend") == -1 && errno == EINVAL, "select unknown -> EINVAL");
    CHECK(kvt_crc32c_find("no-such-backend") == NULL, "find unknown -> NULL");
    CHECK(kvt_crc32c_select(NULL) == 0, "select best");
    CHECK(kvt_crc32c_active() == kvt_crc32c_best_cpu(), "best is active");
    size_t n;
    const kvt_crc32c_backend *b = kvt_crc32c_backends(&n);
    const kvt_crc32c_backend *t = kvt_crc32c_find("table");
    CHECK(t != NULL && t->available(), "table compiled in and available");
    for (size_t i = 0; i < n; i++) {
        if (!b[i].available())
            continue;
        CHECK(kvt_crc32c_select(b[i].name) == 0, "select %s", b[i].name);
        CHECK(kvt_crc32c_active() == &b[i], "active %s", b[i].name);
        CHECK(kvt_crc32c(0, "123456789", 9) == 0xE3069283u, "kvt_crc32c via %s", b[i].name);
    }
    kvt_crc32c_select(NULL);
}

/* Fused CRC32C + copy (copy.c): every kernel available here against the
 * bit-at-a-time reference; dst holds exactly src's bytes and nothing around
 * dst is written. */
static void check_copy(const kvt_crc32c_copy_kernel *k, unsigned char *dst, const unsigned char *src, size_t len,
                       uint32_t seed, const char *what)
{
    memset(dst - 64, 0xA5, len + 128);
    uint32_t got = k->fn(seed, dst, src, len);
    uint32_t want = kvt_crc32c_bitwise(seed, src, len);
    CHECK(got == want, "copy %s %s len %zu: %08x != %08x", k->name, what, len, got, want);
    CHECK(memcmp(dst, src, len) == 0, "copy %s %s len %zu: bytes differ", k->name, what, len);
    int clean = 1;
    for (size_t i = 0; i < 64; i++)
        clean &= dst[-1 - (ptrdiff_t)i] == 0xA5 && dst[len + i] == 0xA5;
    CHECK(clean, "copy %s %s len %zu: wrote outside dst", k->name, what, len);
}

static void test_copy_kernels(void)
{
    size_t n;
    const kvt_crc32c_copy_kernel *k = kvt_crc32c_copy_kernels(&n);
    CHECK(n >= 1 && strcmp(k[n - 1].name, "generic") == 0 && k[n - 1].available == NULL, "generic kernel last");
    CHECK(kvt_crc32c_copy_best() != NULL && (!kvt_crc32c_copy_best()->available || kvt_crc32c_copy_best()->available()),
          "best copy kernel available");
#ifdef KVT_CRC32C_HAVE_SSE42
    CHECK(strcmp(kvt_crc32c_copy_best()->name, kvt_crc32c_copy_avx512_available() ? "avx512-vpclmulqdq"
                                               : kvt_crc32c_copy_pclmul_available() ? "pclmulqdq" : "generic") == 0,
          "best copy kernel is the first available: %s", kvt_crc32c_copy_best()->name);
#endif
    size_t big = (4u << 20) + 3, cap = big + 256;
    unsigned char *src = malloc(cap), *dbuf = malloc(cap + 256);
    fill(src, cap);
    printf("copy kernels:");
    for (size_t i = 0; i < n; i++) {
        if (k[i].available && !k[i].available()) {
            printf(" %s(unavailable)", k[i].name);
            continue;
        }
        printf(" %s", k[i].name);
        unsigned char out[9];
        CHECK(k[i].fn(0, out, "123456789", 9) == 0xE3069283u && memcmp(out, "123456789", 9) == 0,
              "copy %s check value", k[i].name);
        CHECK(k[i].fn(0x12345678u, out, src, 0) == 0x12345678u, "copy %s len 0 keeps crc", k[i].name);
        /* Every length to 1100 (several folds of both kernels) at every dst
         * alignment mod 64, src alignment rotating. */
        for (size_t len = 0; len <= 1100; len++)
            for (size_t doff = 0; doff < 64; doff++)
                check_copy(&k[i], dbuf + 64 + doff, src + (len + doff) % 64, len, seed_for(len + doff), "len/align");
        static const size_t lens[] = {4095, 4096, 65536, 65536 + 255, 262144, 262144 + 129, (1u << 20) + 3, (4u << 20) + 3};
        for (size_t j = 0; j < sizeof lens / sizeof lens[0]; j++)
            for (size_t doff = 0; doff < 64; doff += 21)
                check_copy(&k[i], dbuf + 64 + doff, src + j % 7, lens[j], seed_for(j), "large");
        /* Chaining: copy(copy(0, a), b) == crc(a || b), any split. */
        for (size_t split = 0; split <= 700; split += 7) {
            uint32_t c = k[i].fn(0, dbuf + 64, src, split);
            c = k[i].fn(c, dbuf + 64 + split, src + split, 700 - split);
            CHECK(c == kvt_crc32c_bitwise(0, src, 700), "copy %s chain split %zu", k[i].name, split);
        }
    }
    printf("\n");
    free(src);
    free(dbuf);
    /* Source and destination flush against PROT_NONE guard pages. */
    long pg = sysconf(_SC_PAGESIZE);
    size_t span = 16 * (size_t)pg, total = span + 2 * (size_t)pg;
    unsigned char *s = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    unsigned char *d = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(s != MAP_FAILED && d != MAP_FAILED, "mmap: %s", strerror(errno));
    if (s == MAP_FAILED || d == MAP_FAILED)
        return;
    mprotect(s, (size_t)pg, PROT_NONE);
    mprotect(s + pg + span, (size_t)pg, PROT_NONE);
    mprotect(d, (size_t)pg, PROT_NONE);
    mprotect(d + pg + span, (size_t)pg, PROT_NONE);
    fill(s + pg, span);
    for (size_t i = 0; i < n; i++) {
        if (k[i].available && !k[i].available())
            continue;
        for (size_t len = 0; len <= span; len += len < 600 ? 1 : 4093) {
            uint32_t want = kvt_crc32c_bitwise(7, s + pg + span - len, len);
            CHECK(k[i].fn(7, d + pg + span - len, s + pg + span - len, len) == want, "copy %s flush-end %zu", k[i].name, len);
            CHECK(k[i].fn(7, d + pg, s + pg + span - len, len) == want, "copy %s flush-start %zu", k[i].name, len);
        }
    }
    munmap(s, total);
    munmap(d, total);
}

int main(int argc, char **argv)
{
    size_t n;
    const kvt_crc32c_backend *b = kvt_crc32c_backends(&n);
    printf("backends compiled in:");
    for (size_t i = 0; i < n; i++) {
        int ok = b[i].available();
        printf(" %s%s", b[i].name, ok ? "" : "(unavailable)");
        if (ok)
            add_impl(b[i].name, b[i].fn);
    }
    printf("\nisal version: %s\n", kvt_isal_version() ? kvt_isal_version() : "(none)");
    add_impl("bytewise", kvt_crc32c_bytewise);
    add_impl("slice8", kvt_crc32c_slice8);
    add_impl("slice16", kvt_crc32c_slice16);
#ifdef KVT_CRC32C_HAVE_SSE42
    if (kvt_crc32c_sse42_available())
        add_impl("sse42_serial", kvt_crc32c_sse42_serial);
#endif
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--require") == 0 && i + 1 < argc) {
            const kvt_crc32c_backend *r = kvt_crc32c_find(argv[++i]);
            CHECK(r != NULL && r->available(), "required backend %s compiled in and available", argv[i]);
        } else {
            fprintf(stderr, "usage: %s [--require NAME]...\n", argv[0]);
            return 2;
        }
    }
    printf("testing:");
    for (int i = 0; i < n_impls; i++)
        printf(" %s", impls[i].name);
    printf("\n");
    fflush(stdout);

    test_tables();
    test_check_values();
    test_dispatch();
    test_chaining_combine();
    test_guard_pages();
    test_large();
    test_lengths_offsets();
    test_copy_kernels();

    printf("%ld passed, %ld failed\n", passed, failed);
    return failed ? 1 : 0;
}
