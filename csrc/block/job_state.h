/* Job state word: the one atomic that decides whether a job's bytes may still
 * enter the caller's buffer (loads) or be published (stores), and how many of
 * a load's blocks count as loaded.
 *
 * A 32-bit word in a small buffer the caller owns (kvtier.io.JobState): the
 * phase in the low 2 bits, the blocks loaded while live above them
 * (word = blocks << 2 | phase). Phases:
 *   LIVE -> COMMITTING   a load about to copy a piece into the caller's view,
 *                        a store about to rename its temp onto the block path
 *   COMMITTING -> LIVE   that copy / rename is done
 *   LIVE -> LIVE, blocks + 1   a load's block is whole in the caller's view and
 *                        verified (kvt_job_block_done): it counts as loaded; a
 *                        store's block is stored (published or found there):
 *                        counted too, so the count names the block in flight
 *   LIVE -> EXPIRED      the caller gave up (deadline): spins while COMMITTING,
 *                        so once it succeeds no byte enters the view and no
 *                        block is published by this job any more, and the
 *                        count it keeps is final: exactly the blocks whose
 *                        every piece was committed, and which were counted,
 *                        while the job was live
 *   COMMITTING -> EXPIRED  a store's rename outlived the deadline (a hung
 *                        filesystem can hold it forever, so JobState.expire
 *                        does not wait for a store): the rename may still
 *                        publish that block (written and checksummed before
 *                        the deadline); the section's end then fails and the
 *                        store stops there
 *   LIVE -> DONE         the job finished (caller's bookkeeping)
 * Every change keeps the count (only kvt_job_block_done adds to it). Plain C11
 * atomics, sequentially consistent: the copy happens-after the CAS that took
 * COMMITTING and happens-before the store that gives it back. */
#ifndef KVTIER_JOB_STATE_H
#define KVTIER_JOB_STATE_H

#include <stdatomic.h>
#include <stdint.h>

enum { KVT_JOB_LIVE = 0, KVT_JOB_COMMITTING = 1, KVT_JOB_EXPIRED = 2, KVT_JOB_DONE = 3 };
#define KVT_JOB_PHASE 3u /* mask of the phase; the blocks loaded are word >> 2 */
#define KVT_JOB_BLOCK 4u /* one loaded block */

typedef _Atomic uint32_t kvt_job_state;

/* CAS *js from `old` to `new`: 1 if it held `old` (now `new`), else 0. */
static inline int kvt_job_cas(kvt_job_state *js, uint32_t old, uint32_t new_)
{
    return atomic_compare_exchange_strong(js, &old, new_);
}

/* Change the phase from `from` to `to` (+ `add` to the word), keeping the
 * count: 1 if the phase was `from`, else 0. Only the phase changes under us
 * (the count is the I/O thread's), so a failed CAS is a change of phase. */
static inline int kvt_job_step(kvt_job_state *js, uint32_t from, uint32_t to, uint32_t add)
{
    uint32_t w = atomic_load(js);
    while ((w & KVT_JOB_PHASE) == from) {
        if (atomic_compare_exchange_strong(js, &w, ((w & ~KVT_JOB_PHASE) | to) + add))
            return 1;
    }
    return 0;
}

/* Enter a commit section: 1 if the job was LIVE (now COMMITTING), 0 if it
 * expired or finished (nothing may be written). A NULL state always commits. */
static inline int kvt_job_commit_begin(kvt_job_state *js)
{
    return js == NULL || kvt_job_step(js, KVT_JOB_LIVE, KVT_JOB_COMMITTING, 0);
}

/* Leave a commit section: 1 if the job is LIVE again, 0 if it was expired
 * during the section (COMMITTING -> EXPIRED): stop there. */
static inline int kvt_job_commit_end(kvt_job_state *js)
{
    return js == NULL || kvt_job_step(js, KVT_JOB_COMMITTING, KVT_JOB_LIVE, 0);
}

/* A load's block is whole in the caller's view and verified, or a store's block
 * is stored: count it, if the job is still LIVE (1); 0 if it expired (the block
 * does not count). */
static inline int kvt_job_block_done(kvt_job_state *js)
{
    return js == NULL || kvt_job_step(js, KVT_JOB_LIVE, KVT_JOB_LIVE, KVT_JOB_BLOCK);
}

/* 1 while the job is LIVE (a cheap look before starting work). */
static inline int kvt_job_live(kvt_job_state *js)
{
    return js == NULL || (atomic_load_explicit(js, memory_order_acquire) & KVT_JOB_PHASE) == KVT_JOB_LIVE;
}

#endif
