/*
 * step_relay.h: tensor parallelism's step relay, rank 0's scheduler handing each
 * step to the other ranks over peer memory, in C for both sides (DPUF_RELAY_FN),
 * as allreduce.h is: the GPU runs it over NVLink peer mappings; CI builds it for
 * the host with the ranks as threads (step_relay_host.c, bound by step_relay.py)
 * and holds every rank to the steps the leader sent, in order, byte for byte.
 *
 * Issue 27's scheduler across ranks: rank 0's persistent kernel owns the rings,
 * schedules, and publishes each step's inputs; the other ranks' kernels wait for
 * the step, take its inputs into their own copy of the step graph, and launch it.
 * What a step's bytes hold (the graph's static inputs, the tokens drawn by the
 * step before) is the scheduler's; the relay moves them and orders them.
 *
 * Each follower f (ranks 1 .. followers) holds, in memory the leader reaches:
 *   boxes[f]: two boxes (DPUF_RELAY_BOXES), step s in box s % 2: a header
 *     (seq, kind, graph, bytes) and up to `capacity` bytes of payload.
 * The leader holds, in memory every follower reaches:
 *   acks[f - 1]: the last step follower f has taken out of its box.
 * Step s (1, 2, ...; every rank counts the same steps):
 *   the leader waits until acks[f - 1] >= s - 2 for every follower (box s % 2
 *   is free: the follower took step s - 2 out of it), past its patience a fault
 *   (and nothing sent: a step goes to every follower or to none); then, for
 *   each, writes the payload and the header's kind, graph and bytes into the
 *   box, the block meets (its writes fenced at system scope), and stores s into
 *   the box's seq (a release).
 *   follower f: waits until its box s % 2 holds seq s (an acquire), or until its
 *   stop word is set (its host saw the leader go: 0 returned); copies the payload
 *   out; the block meets; stores s into acks[f - 1] in the leader's memory (a
 *   release): the box is free again.
 * The two boxes let the leader write step s + 1 while a follower still copies
 * step s. A follower never waits with a patience: a leader with no work sends
 * nothing for as long as the load is away.
 */
#ifndef DPUF_STEP_RELAY_H
#define DPUF_STEP_RELAY_H

#include <stdint.h>

#include "peer_order.h"

#define DPUF_RELAY_FN DPUF_PEER_FN /* peer_order.h's */

#define DPUF_RELAY_MAX_FOLLOWERS 7
#define DPUF_RELAY_BOXES 2
/* A step's kind: a step to run, or the last one (the followers' kernels end). */
enum { DPUF_RELAY_STEP = 1, DPUF_RELAY_STOP = 2 };
/* The leader's fault: DPUF_RELAY_FAULT | the follower that took no step in its
 * patience (its box stayed full). */
#define DPUF_RELAY_FAULT 0x40000000u

/* A box's header; the payload follows it, 16-byte aligned. */
typedef struct dpuf_relay_header {
    uint32_t seq; /* 0: empty; else the step in the box (written last) */
    uint32_t kind;
    int32_t graph;
    uint32_t bytes;
} dpuf_relay_header;

#define DPUF_RELAY_HEADER_BYTES 16u

/* A box's bytes for a payload of `capacity` (a multiple of 16). */
DPUF_RELAY_FN uint64_t dpuf_relay_box_bytes(uint64_t capacity) { return DPUF_RELAY_HEADER_BYTES + capacity; }

/* One rank's view of the relay. */
typedef struct dpuf_relay {
    int32_t rank;      /* 0: the leader */
    int32_t followers; /* ranks - 1 */
    uint64_t capacity; /* payload bytes a box holds */
    uint8_t *boxes[DPUF_RELAY_MAX_FOLLOWERS]; /* follower f's two boxes at boxes[f - 1] */
    uint32_t *acks;           /* the leader's, [followers] */
    uint32_t *fault;          /* the leader's fault word (0: none) */
    const uint32_t *stop;     /* a follower's stop word, set by its host */
    uint64_t patience_ns;     /* the leader's wait for a full box */
} dpuf_relay;

DPUF_RELAY_FN dpuf_relay_header *dpuf_relay_box(const dpuf_relay *r, int32_t follower, uint32_t seq) {
    return (dpuf_relay_header *)(r->boxes[follower - 1] + (uint64_t)(seq % DPUF_RELAY_BOXES) *
                                                              dpuf_relay_box_bytes(r->capacity));
}

DPUF_RELAY_FN uint8_t *dpuf_relay_payload(dpuf_relay_header *h) { return (uint8_t *)h + DPUF_RELAY_HEADER_BYTES; }


/* `bytes` from src to dst by the block's threads: 16 bytes a load and a store where
 * both are 16-byte aligned (peer memory over NVLink wants wide stores), the tail
 * and unaligned copies a byte at a time. */
typedef struct __attribute__((aligned(16))) dpuf_relay_w16 {
    uint32_t w[4];
} dpuf_relay_w16;

DPUF_RELAY_FN void dpuf_relay_copy(uint8_t *dst, const uint8_t *src, uint64_t bytes) {
    uint64_t done = 0;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) {
        const uint64_t words = bytes / 16u;
        for (uint64_t i = DPUF_PEER_THREAD; i < words; i += DPUF_PEER_THREADS)
            ((dpuf_relay_w16 *)dst)[i] = ((const dpuf_relay_w16 *)src)[i];
        done = words * 16u;
    }
    for (uint64_t i = done + DPUF_PEER_THREAD; i < bytes; i += DPUF_PEER_THREADS) dst[i] = src[i];
}

/* ---- the leader -------------------------------------------------------------- */

/* Thread 0: wait until follower f has taken step seq - 2 out of box seq % 2;
 * past the patience, raise the fault (the first stays). 0, or -1 on a fault
 * (this one's or an earlier one's: a faulted relay sends nothing more). */
DPUF_RELAY_FN int dpuf_relay_wait_box(const dpuf_relay *r, int32_t f, uint32_t seq) {
    const uint64_t since = dpuf_peer_now_ns();
    while (seq > DPUF_RELAY_BOXES && dpuf_peer_acquire(&r->acks[f - 1]) < seq - DPUF_RELAY_BOXES) {
        if (dpuf_peer_acquire(r->fault) != 0) return -1;
        if (dpuf_peer_now_ns() - since > r->patience_ns) {
            if (dpuf_peer_acquire(r->fault) == 0) dpuf_peer_release(r->fault, DPUF_RELAY_FAULT | (uint32_t)f);
            return -1;
        }
        DPUF_PEER_PAUSE();
    }
    return dpuf_peer_acquire(r->fault) != 0 ? -1 : 0;
}

/* Step `seq` of `kind` (graph, payload of `bytes`) into every follower's box, by
 * every thread of the block; `verdict` the block's shared word for thread 0's
 * waits. A step goes to every follower or to none: every box is waited for
 * before any is written. 0; -1 on a fault (nothing more is sent); -2 for a
 * payload past the boxes' capacity. */
DPUF_RELAY_FN int dpuf_relay_send(const dpuf_relay *r, uint32_t seq, uint32_t kind, int32_t graph,
                                  const uint8_t *payload, uint32_t bytes, int *verdict) {
    if (bytes > r->capacity) return -2;
    if (DPUF_PEER_THREAD == 0) {
        *verdict = 0;
        for (int32_t f = 1; f <= r->followers && *verdict == 0; f++) *verdict = dpuf_relay_wait_box(r, f, seq);
    }
    DPUF_PEER_SHARE();
    if (*verdict != 0) return -1;
    for (int32_t f = 1; f <= r->followers; f++) {
        dpuf_relay_header *h = dpuf_relay_box(r, f, seq);
        dpuf_relay_copy(dpuf_relay_payload(h), payload, bytes);
        if (DPUF_PEER_THREAD == 0) {
            h->kind = kind;
            h->graph = graph;
            h->bytes = bytes;
        }
        DPUF_PEER_MEET(); /* every thread's payload bytes before the seq */
        if (DPUF_PEER_THREAD == 0) dpuf_peer_release(&h->seq, seq);
    }
    return 0;
}

/* ---- a follower --------------------------------------------------------------- */

/* Step `seq` out of this follower's box, by every thread of the block: its payload
 * into `out` (at least `capacity` bytes), its header into *got. 1; 0 where the
 * stop word was set first (nothing taken). */
DPUF_RELAY_FN int dpuf_relay_receive(const dpuf_relay *r, uint32_t seq, uint8_t *out, dpuf_relay_header *got,
                                     int *verdict) {
    dpuf_relay_header *h = dpuf_relay_box(r, r->rank, seq);
    if (DPUF_PEER_THREAD == 0) {
        *verdict = 1;
        while (dpuf_peer_acquire(&h->seq) != seq) {
            if (dpuf_peer_acquire(r->stop) != 0) {
                *verdict = 0;
                break;
            }
            DPUF_PEER_PAUSE();
        }
    }
    DPUF_PEER_SHARE();
    if (*verdict == 0) return 0;
    const uint32_t bytes = h->bytes;
    dpuf_relay_copy(out, dpuf_relay_payload(h), bytes);
    if (DPUF_PEER_THREAD == 0) {
        got->seq = seq;
        got->kind = h->kind;
        got->graph = h->graph;
        got->bytes = bytes;
    }
    DPUF_PEER_MEET(); /* every thread's copy done before the box is given back */
    if (DPUF_PEER_THREAD == 0) dpuf_peer_release(&r->acks[r->rank - 1], seq);
    return 1;
}

#endif /* DPUF_STEP_RELAY_H */
