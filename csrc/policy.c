/* kvtier error policy: retries of transient errors, block identity, counters
 * (policy.h; the table is docs/design.md "Error policy"). */
#define _GNU_SOURCE
#include "policy.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

__thread kvt_counts *kvt_tl_counts;

int kvt_policy_retry(int err, int attempt)
{
    int which;
    if (err == EAGAIN || err == EWOULDBLOCK)
        which = KVT_C_RETRY_EAGAIN;
    else if (err == ESTALE)
        which = KVT_C_RETRY_ESTALE;
    else
        return 0;
    if (attempt >= KVT_RETRY_TRANSIENT)
        return 0;
    kvt_count(which);
    uint64_t us = (uint64_t)KVT_RETRY_BACKOFF_US << attempt;
    struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
    return 1;
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
     * fourth-last '/' (the whole path if shorter), as always: no allocation,
     * no syscall; getcwd only for a relative path of fewer than four
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

static _Atomic uint64_t totals[KVT_NCOUNTS];

void kvt_policy_add_totals(const kvt_counts *c)
{
    for (int i = 0; i < KVT_NCOUNTS; i++)
        if (c->v[i])
            atomic_fetch_add_explicit(&totals[i], c->v[i], memory_order_relaxed);
}

void kvt_policy_totals(kvt_counts *out)
{
    for (int i = 0; i < KVT_NCOUNTS; i++)
        out->v[i] = atomic_load_explicit(&totals[i], memory_order_relaxed);
}
