/*
 * sched_host.c: sched_core.h built for the host, for the tests that hold it
 * to the Python scheduler (dpu_frontend/model/device/sched_core.py loads it). The GPU
 * runs the same functions inside its scheduler kernel (scheduler.cu).
 */
#include <stdlib.h>
#include <string.h>

#include "sched_core.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct dpuf_sched_host {
    dpuf_sched s;
    uint8_t *arena;
    dpuf_sched_span *at; /* [max_seqs]: the last step's layout */
    dpuf_sched_span total;
    uint8_t *inputs[DPUF_SCHED_MAX_GRAPHS];
    dpuf_sched_need *needs;                 /* [max_seqs]: part 1 spread, as the kernel */
    int32_t counts[DPUF_SCHED_MAX_CHANNELS];
    int64_t spread_steps;                   /* steps whose part 1 ran spread */
} dpuf_sched_host;

EXPORT dpuf_sched_host *dpuf_sched_host_new(const dpuf_sched_config *c) {
    dpuf_sched_host *h = calloc(1, sizeof *h);
    if (h == NULL) return NULL;
    h->arena = calloc(1, dpuf_sched_arena_bytes(c));
    h->at = calloc((size_t)c->max_seqs, sizeof *h->at);
    h->needs = calloc((size_t)c->max_seqs, sizeof *h->needs);
    if (h->arena == NULL || h->at == NULL || h->needs == NULL) {
        free(h->arena);
        free(h->at);
        free(h->needs);
        free(h);
        return NULL;
    }
    dpuf_sched_init(&h->s, c, h->arena);
    return h;
}

EXPORT void dpuf_sched_host_free(dpuf_sched_host *h) {
    if (h == NULL) return;
    for (int32_t g = 0; g < h->s.n_graphs; g++) free(h->inputs[g]);
    free(h->arena);
    free(h->at);
    free(h->needs);
    free(h);
}

/* A graph's sizes; its input buffer (`bytes`, zeroed) is the host's. */
EXPORT int32_t dpuf_sched_host_add_graph(dpuf_sched_host *h, int32_t tokens, int32_t seqs,
                                         int32_t tiles, int32_t samples, uint64_t bytes) {
    if (h->s.n_graphs == DPUF_SCHED_MAX_GRAPHS) return DPUF_SCHED_FULL;
    int32_t g = h->s.n_graphs++;
    h->inputs[g] = calloc(1, bytes);
    dpuf_sched_graph *gr = &h->s.graphs[g];
    gr->tokens = tokens;
    gr->seqs = seqs;
    gr->tiles = tiles;
    gr->samples = samples;
    gr->inputs = h->inputs[g];
    return g;
}

EXPORT const uint8_t *dpuf_sched_host_inputs(dpuf_sched_host *h, int32_t g) { return h->inputs[g]; }

EXPORT int32_t dpuf_sched_host_add(dpuf_sched_host *h, int64_t seq_id, int32_t prompt_len,
                                   int64_t max_tokens, int32_t channel) {
    return dpuf_sched_add(&h->s, seq_id, prompt_len, max_tokens, channel);
}

EXPORT int dpuf_sched_host_finish(dpuf_sched_host *h, int32_t e) { return dpuf_sched_finish(&h->s, e); }

EXPORT void dpuf_sched_host_set_credit(dpuf_sched_host *h, int32_t channel, int64_t left) {
    h->s.credits[channel] = left;
}

/* The schedule as the kernel runs it (part 1 spread where it can be), then the
 * step's layout. */
EXPORT void dpuf_sched_host_schedule(dpuf_sched_host *h) {
    h->spread_steps += dpuf_sched_schedule_spread(&h->s, h->needs, h->counts);
    h->total = dpuf_sched_layout(&h->s, h->at);
}

/* The schedule by the serial loop alone (dpuf_sched_schedule), then the layout. */
EXPORT void dpuf_sched_host_schedule_serial(dpuf_sched_host *h) {
    dpuf_sched_schedule(&h->s);
    h->total = dpuf_sched_layout(&h->s, h->at);
}

EXPORT int64_t dpuf_sched_host_spread_steps(dpuf_sched_host *h) { return h->spread_steps; }

EXPORT uint64_t dpuf_sched_host_commit(dpuf_sched_host *h) { return dpuf_sched_commit(&h->s); }

EXPORT int32_t dpuf_sched_host_graph_for(dpuf_sched_host *h) { return dpuf_sched_graph_for(&h->s, h->total); }

EXPORT int32_t dpuf_sched_host_fill(dpuf_sched_host *h, int32_t g) { return dpuf_sched_fill(&h->s, g, h->at, h->total); }

/* The last step: counts[0..3] = works, admitted, preempted, free blocks;
 * works as (entry, start, count, sample) rows; held channels as a mask. */
EXPORT uint64_t dpuf_sched_host_batch(dpuf_sched_host *h, int32_t *counts, int32_t *works,
                                      int32_t *admitted, int32_t *preempted) {
    const dpuf_sched *s = &h->s;
    counts[0] = s->n_works;
    counts[1] = s->n_admitted;
    counts[2] = s->n_preempted;
    counts[3] = s->pool_free;
    memcpy(works, s->works, sizeof(dpuf_sched_work) * (size_t)s->n_works);
    memcpy(admitted, s->admitted, 4 * (size_t)s->n_admitted);
    memcpy(preempted, s->preempted, 4 * (size_t)s->n_preempted);
    return s->held;
}

/* One entry's state (dpuf_sched_seq) and its blocks. */
EXPORT int32_t dpuf_sched_host_seq(dpuf_sched_host *h, int32_t e, dpuf_sched_seq *out, int32_t *blocks) {
    const dpuf_sched *s = &h->s;
    *out = s->seqs[e];
    if (out->slot >= 0)
        memcpy(blocks, s->tables + (int64_t)out->slot * s->max_blocks, 4 * (size_t)out->n_blocks);
    return out->n_blocks;
}
