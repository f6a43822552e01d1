/* kvtier's on-disk records (records.h): the identity hash and the xattr
 * record parsers of the load path, pure functions fuzzed on their own by
 * tests/fuzz/fuzz_xattr_record.c. */
#define _GNU_SOURCE
#include "records.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* See records.h. */
int kvt_xattr_parse(const void *rec, long r, int err, uint32_t *crc)
{
    if (r < 0) {
        if (err == ENODATA)
            return KVT_REC_ABSENT;
        if (err == ERANGE)
            return KVT_REC_MALFORMED;
        return KVT_REC_ERROR;
    }
    if (r != KVT_XATTR_LEN)
        return KVT_REC_MALFORMED;
    *crc = kvt_get_be32((const uint8_t *)rec);
    return KVT_REC_OK;
}

/* See records.h. */
int kvt_id_parse(const void *rec, long r, int err, const uint8_t id[KVT_ID_LEN], uint32_t *crc)
{
    if (r < 0) {
        if (err == ENODATA)
            return KVT_ID_ABSENT;
        if (err == ERANGE)
            return KVT_ID_DAMAGED;
        return KVT_ID_ERROR;
    }
    if (r != KVT_ID_REC_LEN)
        return KVT_ID_DAMAGED;
    if (memcmp(rec, id, KVT_ID_LEN) != 0) {
        int bits = 0;
        for (int i = 0; i < KVT_ID_LEN; i++)
            for (unsigned x = ((const uint8_t *)rec)[i] ^ id[i]; x; x &= x - 1)
                bits++;
        return bits <= KVT_ID_DAMAGED_BITS ? KVT_ID_DAMAGED : KVT_ID_MISMATCH;
    }
    *crc = kvt_get_be32((const uint8_t *)rec + KVT_ID_LEN);
    return KVT_ID_CRC;
}

/* Scans the components of s[0..n) from the end, lexically: empty ones and "."
 * skipped, each ".." cancels the nearest real component before it (*skip
 * counts the pending ones); collects up to four real components into c/cl
 * (last first, *nc of them). */
static void id_scan(const char *s, size_t n, const char *c[4], size_t cl[4], int *nc, size_t *skip)
{
    size_t end = n;
    while (end > 0 && *nc < 4) {
        size_t b = end;
        while (b > 0 && s[b - 1] != '/')
            b--;
        size_t len = end - b;
        if (len == 0 || (len == 1 && s[b] == '.')) {
            /* empty or "." */
        } else if (len == 2 && s[b] == '.' && s[b + 1] == '.') {
            (*skip)++;
        } else if (*skip) {
            (*skip)--;
        } else {
            c[*nc] = s + b;
            cl[*nc] = len;
            (*nc)++;
        }
        end = b ? b - 1 : 0;
    }
}

void kvt_block_identity(const char *path, uint64_t len, uint8_t out[KVT_ID_LEN])
{
    /* The last four components of the path after lexical normalisation (as
     * os.path.normpath: "//" and "." dropped, ".." pops), a relative path taken
     * against the working directory, joined by '/'; fewer than four: '/' and
     * all of them. A clean absolute path hashes its own bytes after its
     * fourth-last '/' (the whole path if shorter): no allocation, no
     * syscall; getcwd only for a relative path of fewer than four
     * components after normalisation. */
    const char *c[4];
    size_t cl[4], skip = 0;
    int nc = 0;
    id_scan(path, strlen(path), c, cl, &nc, &skip);
    char cwd[4096 + 1], *wd = NULL;
    if (nc < 4 && path[0] != '/') {
        if (getcwd(cwd, sizeof cwd) != NULL)
            id_scan(cwd, strlen(cwd), c, cl, &nc, &skip);
        else if (errno == ERANGE && (wd = getcwd(NULL, 0)) != NULL) /* longer than PATH_MAX */
            id_scan(wd, strlen(wd), c, cl, &nc, &skip);
        /* unreadable (removed): as if at "/" */
    }
    uint64_t h = 1469598103934665603ull;
    static const char tag[] = "kvtier.id.v1";
    for (size_t i = 0; i < sizeof tag; i++) /* includes the NUL */
        h = (h ^ (uint8_t)tag[i]) * 1099511628211ull;
    if (nc < 4)
        h = (h ^ (uint8_t)'/') * 1099511628211ull;
    for (int j = nc - 1; j >= 0; j--) {
        for (size_t i = 0; i < cl[j]; i++)
            h = (h ^ (uint8_t)c[j][i]) * 1099511628211ull;
        if (j)
            h = (h ^ (uint8_t)'/') * 1099511628211ull;
    }
    h = (h ^ 0u) * 1099511628211ull;
    char num[24]; /* len in decimal, most significant digit first (no printf: per block) */
    int k = (int)sizeof num;
    do {
        num[--k] = (char)('0' + len % 10);
        len /= 10;
    } while (len);
    for (; k < (int)sizeof num; k++)
        h = (h ^ (uint8_t)num[k]) * 1099511628211ull;
    for (int i = 0; i < KVT_ID_LEN; i++)
        out[i] = (uint8_t)(h >> (56 - 8 * i));
    free(wd);
}
