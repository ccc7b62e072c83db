/*
 * allreduce.h: tensor parallelism's all-reduce over the ranks' peer memory, in C
 * for both sides (DPUF_AR_FN): the arithmetic and the flags of one rank's part of
 * a call, block by block. The GPU runs it over NVLink peer mappings of every
 * rank's buffers (allreduce.cu); CI builds it for the host with the ranks as
 * threads (allreduce_host.c, bound by allreduce.py) and holds it to
 * model/layers/collective.py's sum_in_rank_order, bit for bit.
 *
 * Batch-invariant, as GatheredGroup is: every element is the float32 sum of the
 * ranks' values in rank order (rank 0's value, plus rank 1's, ...), rounded once
 * to the dtype, so its bits depend on the values alone, never on the message's
 * size or cut, and every rank ends with the same bits. (NCCL's ring all-reduce
 * starts each chunk's sum at another rank.)
 *
 * Each rank r holds, in memory every rank can reach:
 *   buf[r]:   its input (the caller writes it before the call), n elements;
 *   flags[r]: the signal words other ranks write to it, [3 phases][blocks][ranks].
 * A call, on every rank with the same n, dtype, blocks and epoch (a number that
 * differs from the last call's), each block b of each rank:
 *   one-shot (small messages): READY, then block b's elements of every rank's
 *   buf summed in rank order into out; DONE.
 *   two-shot (large ones): READY, then block b's part of slice r (the slices:
 *   [s n / R, (s + 1) n / R)) summed in rank order into buf[r] itself (no other
 *   rank reads slice r of buf[r]); MID; then block b's part of every slice s
 *   copied from buf[s] into out; DONE.
 * A phase: the block writes `epoch` into word [phase][b][r] of every rank's
 * flags (a release: its writes before it are seen by whoever sees the flag),
 * then waits until word [phase][b][q] of its own flags holds `epoch` for every
 * q (an acquire). READY: every buf holds its input. MID: every slice is summed.
 * DONE: no rank still reads a buf, which the next call's input may overwrite.
 * A block waits only for the same block of the other ranks, on other devices:
 * no block waits for another of its own grid, so a grid need not be resident
 * at once.
 *
 * A stalled rank (its kernel stopped, its process hung) never hangs the others:
 * a wait that lasts past the call's patience gives up and raises the rank's
 * fault word (DPUF_AR_FAULT, the phase and the peer waited for; the first one
 * stays), and from then on this rank's waits return at once, so its calls end,
 * with wrong sums. The caller reads the word (the host a mapped copy, after its
 * step) and fails the step: a fault is for good, the group is not used again.
 */
#ifndef DPUF_ALLREDUCE_H
#define DPUF_ALLREDUCE_H

#include <stdint.h>

#include "peer_order.h"

#define DPUF_AR_FN DPUF_PEER_FN /* peer_order.h's */

#define DPUF_AR_MAX_RANKS 8
#define DPUF_AR_PHASES 3
/* A fault word: 0, or DPUF_AR_FAULT | phase << 8 | the peer waited for. */
#define DPUF_AR_FAULT 0x80000000u
enum { DPUF_AR_READY = 0, DPUF_AR_MID = 1, DPUF_AR_DONE = 2 };
enum { DPUF_AR_F32 = 0, DPUF_AR_BF16 = 1 };

/* One rank's view of a call. */
typedef struct dpuf_ar_call {
    int32_t rank, ranks;
    int32_t dtype;        /* DPUF_AR_* */
    int32_t two_shot;     /* 0: one-shot */
    int64_t n;            /* elements */
    int32_t blocks;       /* the grid: each block its share of the elements */
    uint32_t epoch;       /* this call's: not the last call's */
    void *buf[DPUF_AR_MAX_RANKS];        /* every rank's input, as this rank reaches it */
    uint32_t *flags[DPUF_AR_MAX_RANKS];  /* every rank's signal words, likewise */
    void *out;            /* this rank's result, n elements */
    uint32_t *fault;      /* this rank's fault word, shared by its blocks */
    uint32_t *fault_copy; /* where the first fault is copied for the host to read, or 0 */
    uint64_t patience_ns; /* a wait longer than this is a stalled peer */
} dpuf_ar_call;

/* Rank `rank`'s call over every rank's buffers and flags (as it reaches them). */
DPUF_AR_FN dpuf_ar_call dpuf_ar_call_of(int32_t rank, int32_t ranks, int32_t dtype, int32_t two_shot, int64_t n,
                                        int32_t blocks, uint32_t epoch, void *const *bufs, uint32_t *const *flags,
                                        void *out, uint32_t *fault, uint32_t *fault_copy, uint64_t patience_ns) {
    dpuf_ar_call c;
    c.rank = rank;
    c.ranks = ranks;
    c.dtype = dtype;
    c.two_shot = two_shot != 0;
    c.n = n;
    c.blocks = blocks;
    c.epoch = epoch;
    for (int32_t q = 0; q < DPUF_AR_MAX_RANKS; q++) {
        c.buf[q] = q < ranks ? bufs[q] : 0;
        c.flags[q] = q < ranks ? flags[q] : 0;
    }
    c.out = out;
    c.fault = fault;
    c.fault_copy = fault_copy;
    c.patience_ns = patience_ns;
    return c;
}

/* The signal words a rank holds for a grid of `blocks`. */
DPUF_AR_FN int64_t dpuf_ar_flag_words(int32_t blocks, int32_t ranks) {
    return (int64_t)DPUF_AR_PHASES * blocks * ranks;
}

/* ---- the arithmetic ------------------------------------------------------ */

DPUF_AR_FN float dpuf_ar_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Round to nearest, ties to even (torch's float -> bfloat16); a NaN is the
 * one the GPU's conversion gives (cvt.rn.bf16.f32: 0x7fff). */
DPUF_AR_FN uint16_t dpuf_ar_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fffu;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

DPUF_AR_FN float dpuf_ar_load(const void *p, int32_t dtype, int64_t i) {
    return dtype == DPUF_AR_BF16 ? dpuf_ar_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

DPUF_AR_FN void dpuf_ar_store(void *p, int32_t dtype, int64_t i, float f) {
    if (dtype == DPUF_AR_BF16)
        ((uint16_t *)p)[i] = dpuf_ar_f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* Elements [lo, hi) of every rank's buf, summed in rank order into dst. */
DPUF_AR_FN void dpuf_ar_sum(const dpuf_ar_call *c, void *dst, int64_t lo, int64_t hi, int64_t first,
                            int64_t stride) {
    for (int64_t i = lo + first; i < hi; i += stride) {
        float total = dpuf_ar_load(c->buf[0], c->dtype, i);
        for (int32_t q = 1; q < c->ranks; q++) total = total + dpuf_ar_load(c->buf[q], c->dtype, i);
        dpuf_ar_store(dst, c->dtype, i, total);
    }
}

/* Elements [lo, hi) of src copied into dst. */
DPUF_AR_FN void dpuf_ar_copy(const dpuf_ar_call *c, void *dst, const void *src, int64_t lo, int64_t hi,
                             int64_t first, int64_t stride) {
    for (int64_t i = lo + first; i < hi; i += stride) {
        if (c->dtype == DPUF_AR_BF16)
            ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
        else
            ((float *)dst)[i] = ((const float *)src)[i];
    }
}

/* Part `k` of `parts` of [lo, hi): [lo + k (hi - lo) / parts, ...). */
DPUF_AR_FN int64_t dpuf_ar_cut(int64_t lo, int64_t hi, int64_t k, int64_t parts) {
    return lo + (hi - lo) * k / parts;
}

/* ---- the flags ------------------------------------------------------------- */

DPUF_AR_FN int64_t dpuf_ar_flag_index(const dpuf_ar_call *c, int32_t phase, int32_t block, int32_t from) {
    return ((int64_t)phase * c->blocks + block) * c->ranks + from;
}

#ifdef __CUDA_ARCH__
/* The first fault wins the word; its raiser copies it for the host. */
DPUF_AR_FN uint32_t dpuf_ar_raise_first(uint32_t *fault, uint32_t code) { return atomicCAS(fault, 0u, code); }
#else
DPUF_AR_FN uint32_t dpuf_ar_raise_first(uint32_t *fault, uint32_t code) {
    uint32_t was = 0;
    __atomic_compare_exchange_n(fault, &was, code, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return was;
}
#endif

/* A stall: the rank's fault word raised, if no fault came first (and the first
 * one copied for the host). */
DPUF_AR_FN void dpuf_ar_raise(const dpuf_ar_call *c, int32_t phase, int32_t peer) {
    const uint32_t code = DPUF_AR_FAULT | (uint32_t)phase << 8 | (uint32_t)peer;
    if (dpuf_ar_raise_first(c->fault, code) == 0 && c->fault_copy) dpuf_peer_release(c->fault_copy, code);
}

/* One thread of the block: `epoch` into word [phase][block][rank] of every
 * rank's flags. The block's writes before it (every thread's, after the
 * caller's barrier and fence) are seen by a rank that sees the flag. */
DPUF_AR_FN void dpuf_ar_signal(const dpuf_ar_call *c, int32_t phase, int32_t block) {
    const int64_t at = dpuf_ar_flag_index(c, phase, block, c->rank);
    for (int32_t q = 0; q < c->ranks; q++) dpuf_peer_release(c->flags[q] + at, c->epoch);
}

/* One thread of the block: wait until every rank's block `block` has signalled
 * `phase` of this call (its words in this rank's flags hold the epoch); past the
 * call's patience, or once this rank has a fault, no longer. */
DPUF_AR_FN void dpuf_ar_wait(const dpuf_ar_call *c, int32_t phase, int32_t block) {
    const uint32_t *own = c->flags[c->rank];
    const uint64_t since = dpuf_peer_now_ns();
    for (int32_t q = 0; q < c->ranks; q++)
        while (dpuf_peer_acquire(own + dpuf_ar_flag_index(c, phase, block, q)) != c->epoch) {
            if (dpuf_peer_acquire(c->fault) != 0) return; /* a stall seen already: no more waits */
            if (dpuf_peer_now_ns() - since > c->patience_ns) {
                dpuf_ar_raise(c, phase, q);
                return;
            }
            DPUF_PEER_PAUSE();
        }
}

/* ---- one block's part of a call, for both sides ---------------------------- */

/* A phase: the block's writes so far fenced and met, thread 0 signals and waits,
 * and the block meets again (its threads read what the peers wrote before it). */
DPUF_AR_FN void dpuf_ar_phase(const dpuf_ar_call *c, int32_t phase, int32_t block) {
    DPUF_PEER_MEET();
    if (DPUF_PEER_THREAD == 0) {
        dpuf_ar_signal(c, phase, block);
        dpuf_ar_wait(c, phase, block);
    }
    DPUF_PEER_MEET();
}

/* Block `block`'s part of the call, by every thread of the block: the kernel's
 * body, and the host build's. */
DPUF_AR_FN void dpuf_ar_block(const dpuf_ar_call *c, int32_t block) {
    const int64_t t = DPUF_PEER_THREAD, nt = DPUF_PEER_THREADS;
    dpuf_ar_phase(c, DPUF_AR_READY, block); /* the input was written before the call */
    if (!c->two_shot) {
        dpuf_ar_sum(c, c->out, dpuf_ar_cut(0, c->n, block, c->blocks), dpuf_ar_cut(0, c->n, block + 1, c->blocks),
                    t, nt);
    } else {
        const int64_t lo = dpuf_ar_cut(0, c->n, c->rank, c->ranks), hi = dpuf_ar_cut(0, c->n, c->rank + 1, c->ranks);
        dpuf_ar_sum(c, c->buf[c->rank], dpuf_ar_cut(lo, hi, block, c->blocks),
                    dpuf_ar_cut(lo, hi, block + 1, c->blocks), t, nt);
        dpuf_ar_phase(c, DPUF_AR_MID, block);
        for (int32_t s = 0; s < c->ranks; s++) {
            const int64_t slo = dpuf_ar_cut(0, c->n, s, c->ranks), shi = dpuf_ar_cut(0, c->n, s + 1, c->ranks);
            dpuf_ar_copy(c, c->out, c->buf[s], dpuf_ar_cut(slo, shi, block, c->blocks),
                         dpuf_ar_cut(slo, shi, block + 1, c->blocks), t, nt);
        }
    }
    dpuf_ar_phase(c, DPUF_AR_DONE, block); /* every read of the peers' buffers is done */
}

#endif /* DPUF_ALLREDUCE_H */
