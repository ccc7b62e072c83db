/*
 * allreduce_host.c: allreduce.h built for the host, for the tests that hold it to
 * the rank-order sum of model/layers/collective.py (dpu_frontend/gpu/allreduce.py
 * loads it). Every block of every rank runs on a thread of its own, all at once,
 * as a grid's blocks on several GPUs do: a block waits for the same block of the
 * other ranks only, through the flags.
 */
#define _GNU_SOURCE
#include "allreduce.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct worker {
    dpuf_ar_call call;
    int32_t block;
    uint32_t seed; /* 0: no delays */
} worker;

/* A pause of up to 200 us before a third of the steps, from `seed`: the ranks
 * and blocks drift apart as GPUs do. */
static void drift(uint32_t *seed) {
    if (*seed != 0 && rand_r(seed) % 3 == 0) usleep((useconds_t)(rand_r(seed) % 200));
}

static void *run_block(void *arg) {
    worker *w = (worker *)arg;
    drift(&w->seed);
    dpuf_ar_block(&w->call, w->block);
    return NULL;
}

/* Whether any of the ranks' fault words is raised. */
static int any_fault(const uint32_t *faults, int32_t ranks) {
    for (int32_t r = 0; r < ranks; r++)
        if (__atomic_load_n(&faults[r], __ATOMIC_ACQUIRE) != 0) return 1;
    return 0;
}

/* One call over `ranks` ranks: rank r's input in bufs[r], its signal words in
 * flags[r] (dpuf_ar_flag_words of them, left as the last call left them), its
 * fault word faults[r] (likewise), its result into outs[r]; a wait past
 * patience_ns raises a fault. Rank `absent` (-1: none) runs no block, as a rank
 * whose kernel stopped. 0; -1 for a shape it does not take; -2 where a rank's
 * fault word is raised (the results are then wrong). */
EXPORT int dpuf_ar_host_run(int32_t ranks, int32_t dtype, int32_t two_shot, int64_t n, int32_t blocks,
                            uint32_t epoch, void **bufs, uint32_t **flags, void **outs, uint32_t *faults,
                            uint64_t patience_ns, int32_t absent) {
    if (ranks < 1 || ranks > DPUF_AR_MAX_RANKS || blocks < 1) return -1;
    const int32_t count = ranks * blocks;
    worker *workers = calloc((size_t)count, sizeof *workers);
    pthread_t *threads = calloc((size_t)count, sizeof *threads);
    if (workers == NULL || threads == NULL) {
        free(workers);
        free(threads);
        return -1;
    }
    for (int32_t k = 0; k < count; k++) {
        const int32_t r = k / blocks;
        workers[k].call = dpuf_ar_call_of(r, ranks, dtype, two_shot, n, blocks, epoch, bufs, flags, outs[r],
                                          &faults[r], NULL, patience_ns);
        workers[k].block = k % blocks;
    }
    for (int32_t k = 0; k < count; k++)
        /* A block that cannot start leaves its peers waiting for it: the test's
         * process ends rather than waits out their patience. */
        if (k / blocks != absent && pthread_create(&threads[k], NULL, run_block, &workers[k]) != 0) abort();
    for (int32_t k = 0; k < count; k++)
        if (k / blocks != absent) pthread_join(threads[k], NULL);
    free(workers);
    free(threads);
    return any_fault(faults, ranks) ? -2 : 0;
}

typedef struct rank_stream {
    int32_t rank, ranks, dtype, blocks, calls;
    int64_t n;
    size_t width;
    void **bufs;
    uint32_t **flags;
    const uint8_t *inputs; /* [calls][ranks][n] */
    uint8_t *outs;         /* [calls][ranks][n] */
    uint32_t seed;
    uint32_t *fault;
    uint64_t patience_ns;
} rank_stream;

/* One rank's stream, as a GPU's stream runs it: each call's input copied into
 * its buffer, then its blocks at once (the kernel), all of them ended before the
 * next call's copy; nothing else orders it against the other ranks. */
static void *run_stream(void *arg) {
    rank_stream *rs = (rank_stream *)arg;
    worker *workers = calloc((size_t)rs->blocks, sizeof *workers);
    pthread_t *threads = calloc((size_t)rs->blocks, sizeof *threads);
    if (workers == NULL || threads == NULL) abort();
    const size_t bytes = (size_t)rs->n * rs->width;
    for (int32_t k = 0; k < rs->calls; k++) {
        drift(&rs->seed);
        memcpy(rs->bufs[rs->rank], rs->inputs + ((size_t)k * rs->ranks + rs->rank) * bytes, bytes);
        for (int32_t b = 0; b < rs->blocks; b++) {
            workers[b].call = dpuf_ar_call_of(rs->rank, rs->ranks, rs->dtype, k % 2, rs->n, rs->blocks,
                                              (uint32_t)k + 1u, rs->bufs, rs->flags,
                                              rs->outs + ((size_t)k * rs->ranks + rs->rank) * bytes, rs->fault,
                                              NULL, rs->patience_ns);
            workers[b].block = b;
            workers[b].seed = rs->seed ? rs->seed + (uint32_t)b + 1u : 0;
            if (pthread_create(&threads[b], NULL, run_block, &workers[b]) != 0) abort();
        }
        for (int32_t b = 0; b < rs->blocks; b++) pthread_join(threads[b], NULL);
    }
    free(workers);
    free(threads);
    return NULL;
}

/* `calls` calls on every rank, alternating one-shot and two-shot, each rank on a
 * stream of its own that drifts from the others' (seed 0: none): a rank may
 * start its next call while another is still in this one. The buffers, flags
 * and fault words are made here, zeroed. 0, -1 or -2 as dpuf_ar_host_run's. */
EXPORT int dpuf_ar_host_stream(int32_t ranks, int32_t dtype, int64_t n, int32_t blocks, int32_t calls,
                               const void *inputs, void *outs, uint32_t seed, uint64_t patience_ns) {
    if (ranks < 1 || ranks > DPUF_AR_MAX_RANKS || blocks < 1 || calls < 0 || n < 0) return -1;
    const size_t width = dtype == DPUF_AR_BF16 ? 2 : 4;
    void *bufs[DPUF_AR_MAX_RANKS];
    uint32_t *flags[DPUF_AR_MAX_RANKS];
    rank_stream streams[DPUF_AR_MAX_RANKS];
    pthread_t threads[DPUF_AR_MAX_RANKS];
    uint32_t faults[DPUF_AR_MAX_RANKS] = {0};
    for (int32_t r = 0; r < ranks; r++) {
        bufs[r] = calloc((size_t)n + 1, width);
        flags[r] = calloc((size_t)dpuf_ar_flag_words(blocks, ranks), sizeof(uint32_t));
        if (bufs[r] == NULL || flags[r] == NULL) abort();
    }
    for (int32_t r = 0; r < ranks; r++) {
        streams[r] = (rank_stream){r,
                                   ranks,
                                   dtype,
                                   blocks,
                                   calls,
                                   n,
                                   width,
                                   bufs,
                                   flags,
                                   (const uint8_t *)inputs,
                                   (uint8_t *)outs,
                                   seed ? seed * 977u + (uint32_t)r : 0,
                                   &faults[r],
                                   patience_ns};
        if (pthread_create(&threads[r], NULL, run_stream, &streams[r]) != 0) abort();
    }
    for (int32_t r = 0; r < ranks; r++) pthread_join(threads[r], NULL);
    for (int32_t r = 0; r < ranks; r++) {
        free(bufs[r]);
        free(flags[r]);
    }
    return any_fault(faults, ranks) ? -2 : 0;
}
