/* kvtier error policy: retries of transient errors, counters and their
 * process-wide totals (policy.h; the table is docs/design.md "Error policy"). */
#define _GNU_SOURCE
#include "policy.h"

#include <errno.h>
#include <stdatomic.h>
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
