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

#define EXPORT __attribute__((visibility("default")))

typedef struct worker {
    dpuf_ar_call call;
    int32_t block;
} worker;

static void *run_block(void *arg) {
    const worker *w = (const worker *)arg;
    dpuf_ar_block(&w->call, w->block);
    return NULL;
}

/* One call over `ranks` ranks: rank r's input in bufs[r], its signal words in
 * flags[r] (dpuf_ar_flag_words of them, left as the last call left them), its
 * result into outs[r]. 0, or -1 for a shape it does not take. */
EXPORT int dpuf_ar_host_run(int32_t ranks, int32_t dtype, int32_t two_shot, int64_t n, int32_t blocks,
                            uint32_t epoch, void **bufs, uint32_t **flags, void **outs) {
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
        dpuf_ar_call *c = &workers[k].call;
        c->rank = k / blocks;
        c->ranks = ranks;
        c->dtype = dtype;
        c->two_shot = two_shot;
        c->n = n;
        c->blocks = blocks;
        c->epoch = epoch;
        for (int32_t q = 0; q < ranks; q++) {
            c->buf[q] = bufs[q];
            c->flags[q] = flags[q];
        }
        c->out = outs[c->rank];
        workers[k].block = k % blocks;
    }
    for (int32_t k = 0; k < count; k++)
        /* A block that cannot start leaves its peers waiting for it forever: the
         * test's process ends rather than hangs. */
        if (pthread_create(&threads[k], NULL, run_block, &workers[k]) != 0) abort();
    for (int32_t k = 0; k < count; k++) pthread_join(threads[k], NULL);
    free(workers);
    free(threads);
    return 0;
}
