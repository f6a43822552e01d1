/* kvtier error policy: retries of transient errors, block identity, counters
 * (policy.h; the table is docs/design.md "Error policy"). */
#define _GNU_SOURCE
#include "policy.h"

#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

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

void kvt_block_identity(const char *path, uint64_t len, uint8_t out[KVT_ID_LEN])
{
    /* start of the last four components */
    const char *start = path;
    int seen = 0;
    for (const char *p = path + strlen(path); p > path; p--) {
        if (p[-1] == '/' && ++seen == 4) {
            start = p;
            break;
        }
    }
    uint64_t h = 1469598103934665603ull;
    static const char tag[] = "kvtier.id.v1";
    for (size_t i = 0; i < sizeof tag; i++) /* includes the NUL */
        h = (h ^ (uint8_t)tag[i]) * 1099511628211ull;
    for (const char *s = start; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
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
