/*
 * step_relay_host.c: step_relay.h built for the host, for the tests that hold every
 * follower to the steps the leader sent (dpu_frontend/gpu/step_relay.py loads it).
 * The leader and each follower run on a thread of their own, pausing at random as
 * GPUs drift apart; a follower may stop taking steps (its kernel stalled), and the
 * leader's host, seeing the leader fail, sets every follower's stop word.
 */
#define _GNU_SOURCE
#include "step_relay.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct run {
    dpuf_relay relay[DPUF_RELAY_MAX_FOLLOWERS + 1]; /* each rank's view */
    uint32_t steps;
    const uint8_t *payloads; /* [steps][capacity] */
    const uint32_t *sizes;   /* [steps] */
    const int32_t *graphs;   /* [steps] */
    uint8_t *received;       /* [followers][steps][capacity] */
    dpuf_relay_header *headers; /* [followers][steps] */
    int32_t *taken;          /* [followers] */
    int32_t stalled;         /* a follower that takes no step past stall_after; 0: none */
    uint32_t stall_after;
    uint32_t stops[DPUF_RELAY_MAX_FOLLOWERS + 1];
    uint8_t *scratch[DPUF_RELAY_MAX_FOLLOWERS + 1]; /* a follower's copy of a step past the last */
    int result;
} run;

typedef struct rank_arg {
    run *run;
    int32_t rank;
    uint32_t seed;
} rank_arg;

static void drift(uint32_t *seed) {
    if (*seed != 0 && rand_r(seed) % 3 == 0) usleep((useconds_t)(rand_r(seed) % 200));
}

static void *leader(void *arg) {
    rank_arg *a = (rank_arg *)arg;
    run *rn = a->run;
    const dpuf_relay *r = &rn->relay[0];
    int verdict = 0;
    rn->result = 0;
    for (uint32_t s = 1; s <= rn->steps; s++) {
        drift(&a->seed);
        const uint32_t kind = s == rn->steps ? DPUF_RELAY_STOP : DPUF_RELAY_STEP;
        const int rc = dpuf_relay_send(r, s, kind, rn->graphs[s - 1], rn->payloads + (uint64_t)(s - 1) * r->capacity,
                                       rn->sizes[s - 1], &verdict);
        if (rc != 0) {
            rn->result = rc;
            break;
        }
    }
    if (rn->steps == 0) usleep(20000); /* nothing to send: the followers wait */
    if (rn->result != 0 || rn->steps == 0)
        /* The leader failed (or never ran): its host stops every follower. */
        for (int32_t f = 1; f <= r->followers; f++) __atomic_store_n(&rn->stops[f], 1u, __ATOMIC_RELEASE);
    return NULL;
}

static void *follower(void *arg) {
    rank_arg *a = (rank_arg *)arg;
    run *rn = a->run;
    const int32_t f = a->rank;
    const dpuf_relay *r = &rn->relay[f];
    int verdict = 0;
    int32_t taken = 0;
    for (uint32_t s = 1;; s++) {
        if (f == rn->stalled && s > rn->stall_after) {
            /* Its kernel stalled: it takes nothing more, until its host stops it. */
            while (__atomic_load_n(&rn->stops[f], __ATOMIC_ACQUIRE) == 0) usleep(1000);
            break;
        }
        drift(&a->seed);
        dpuf_relay_header got;
        if (s > rn->steps) {
            /* No step is coming (a leader that sent none): only the stop word
             * ends this wait. */
            if (dpuf_relay_receive(r, s, rn->scratch[f], &got, &verdict)) abort();
            break;
        }
        const uint64_t at = (uint64_t)(f - 1) * rn->steps + (s - 1);
        if (!dpuf_relay_receive(r, s, rn->received + at * r->capacity, &got, &verdict)) break;
        rn->headers[at] = got;
        taken++;
        if (got.kind == DPUF_RELAY_STOP) break;
    }
    rn->taken[f - 1] = taken;
    return NULL;
}

/* `steps` steps from the leader to `followers` followers through boxes of
 * `capacity` payload bytes (a multiple of 16): step s's payload is
 * payloads[s - 1] (sizes[s - 1] bytes, graphs[s - 1]), the last one a STOP.
 * Each follower's copy of each step goes to received and headers, and the count
 * it took to taken. Follower `stalled` (0: none) takes no step past
 * `stall_after`. The leader's fault word goes to *fault. 0; -1 for a shape it
 * does not take; -2 where the leader faulted; -3 for a payload past the
 * capacity. */
EXPORT int dpuf_relay_host_run(int32_t followers, uint64_t capacity, uint32_t steps, const uint8_t *payloads,
                               const uint32_t *sizes, const int32_t *graphs, uint8_t *received,
                               dpuf_relay_header *headers, int32_t *taken, uint64_t patience_ns, int32_t stalled,
                               uint32_t stall_after, uint32_t seed, uint32_t *fault) {
    if (followers < 1 || followers > DPUF_RELAY_MAX_FOLLOWERS || capacity % 16 || stalled < 0 || stalled > followers)
        return -1;
    run *rn = calloc(1, sizeof *rn);
    uint8_t *boxes = aligned_alloc(16, (size_t)followers * DPUF_RELAY_BOXES * dpuf_relay_box_bytes(capacity));
    uint32_t *acks = calloc((size_t)followers, sizeof *acks);
    if (rn == NULL || boxes == NULL || acks == NULL) abort();
    memset(boxes, 0, (size_t)followers * DPUF_RELAY_BOXES * dpuf_relay_box_bytes(capacity));
    *fault = 0;
    rn->steps = steps;
    rn->payloads = payloads;
    rn->sizes = sizes;
    rn->graphs = graphs;
    rn->received = received;
    rn->headers = headers;
    rn->taken = taken;
    rn->stalled = stalled;
    rn->stall_after = stall_after;
    for (int32_t rank = 0; rank <= followers; rank++) {
        rn->scratch[rank] = aligned_alloc(16, capacity ? capacity : 16);
        if (rn->scratch[rank] == NULL) abort();
        dpuf_relay *r = &rn->relay[rank];
        r->rank = rank;
        r->followers = followers;
        r->capacity = capacity;
        for (int32_t f = 1; f <= followers; f++)
            r->boxes[f - 1] = boxes + (size_t)(f - 1) * DPUF_RELAY_BOXES * dpuf_relay_box_bytes(capacity);
        r->acks = acks;
        r->fault = fault;
        r->stop = &rn->stops[rank];
        r->patience_ns = patience_ns;
    }
    pthread_t threads[DPUF_RELAY_MAX_FOLLOWERS + 1];
    rank_arg args[DPUF_RELAY_MAX_FOLLOWERS + 1];
    for (int32_t rank = 0; rank <= followers; rank++) {
        args[rank] = (rank_arg){rn, rank, seed ? seed * 131u + (uint32_t)rank : 0};
        if (pthread_create(&threads[rank], NULL, rank == 0 ? leader : follower, &args[rank]) != 0) abort();
    }
    for (int32_t rank = 0; rank <= followers; rank++) pthread_join(threads[rank], NULL);
    const int result = rn->result == -2 ? -3 : rn->result == -1 ? -2 : 0;
    for (int32_t rank = 0; rank <= followers; rank++) free(rn->scratch[rank]);
    free(rn);
    free(boxes);
    free(acks);
    return result;
}
