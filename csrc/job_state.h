/* Job state word: the one atomic that decides whether a job's bytes may still
 * enter the caller's buffer (loads) or be published (stores).
 *
 * A 32-bit word in a small buffer the caller owns (kvtier.io.JobState):
 *   LIVE -> COMMITTING   a load about to copy a piece into the caller's view,
 *                        a store about to rename its temp onto the block path
 *   COMMITTING -> LIVE   that copy / rename is done
 *   LIVE -> EXPIRED      the caller gave up (deadline): spins while COMMITTING,
 *                        so once it succeeds no byte enters the view and no
 *                        block is published by this job any more
 *   COMMITTING -> EXPIRED  a store's rename outlived the deadline (a hung
 *                        filesystem can hold it forever, so JobState.expire
 *                        does not wait for a store): the rename may still
 *                        publish that block (written and checksummed before
 *                        the deadline); the section's end then fails and the
 *                        store stops there
 *   LIVE -> DONE         the job finished (caller's bookkeeping)
 * Plain C11 atomics, sequentially consistent: the copy happens-after the CAS
 * that took COMMITTING and happens-before the store that gives it back. */
#ifndef KVTIER_JOB_STATE_H
#define KVTIER_JOB_STATE_H

#include <stdatomic.h>
#include <stdint.h>

enum { KVT_JOB_LIVE = 0, KVT_JOB_COMMITTING = 1, KVT_JOB_EXPIRED = 2, KVT_JOB_DONE = 3 };

typedef _Atomic uint32_t kvt_job_state;

/* CAS *js from `old` to `new`: 1 if it held `old` (now `new`), else 0. */
static inline int kvt_job_cas(kvt_job_state *js, uint32_t old, uint32_t new_)
{
    return atomic_compare_exchange_strong(js, &old, new_);
}

/* Enter a commit section: 1 if the job was LIVE (now COMMITTING), 0 if it
 * expired or finished (nothing may be written). A NULL state always commits. */
static inline int kvt_job_commit_begin(kvt_job_state *js)
{
    return js == NULL || kvt_job_cas(js, KVT_JOB_LIVE, KVT_JOB_COMMITTING);
}

/* Leave a commit section: 1 if the job is LIVE again, 0 if it was expired
 * during the section (COMMITTING -> EXPIRED, stores only): stop there. */
static inline int kvt_job_commit_end(kvt_job_state *js)
{
    return js == NULL || kvt_job_cas(js, KVT_JOB_COMMITTING, KVT_JOB_LIVE);
}

/* 1 while the job is LIVE (a cheap look before starting work). */
static inline int kvt_job_live(kvt_job_state *js)
{
    return js == NULL || atomic_load_explicit(js, memory_order_acquire) == KVT_JOB_LIVE;
}

#endif
