/*
 * sched_core.h: continuous batching in C, for the scheduler inside the GPU.
 *
 * The same algorithm as dpu_frontend/model/scheduler.py (the host-driven
 * engine's), decision for decision, and the same step metadata as
 * dpu_frontend/model/metadata.py writes into a captured step graph's static
 * inputs. It is written once for both sides (DPUF_SCHED_FN): the GPU scheduler
 * kernel (scheduler.cu) runs it on one thread (its decodes spread over the
 * block where a step allows: dpuf_sched_schedule_spread), and CI builds it for
 * the host (sched_host.c) and holds it to the Python scheduler in property
 * tests (tests/model/test_sched_core.py).
 *
 * Each step the scheduler spends a token budget:
 *   1. every running sequence whose prompt is done decodes one token; one
 *      that needs a block and finds none preempts the youngest running
 *      sequence (blocks freed, back to the head of the queue, recomputed
 *      later: seeded draws make the recomputed tokens the same);
 *   2. running sequences still prefilling take chunks of what is left;
 *   3. waiting sequences are admitted in arrival order while a slot is free,
 *      the budget lasts and the free blocks hold what they know. When the
 *      head does not fit, admission waits: nothing is evicted for a newcomer.
 * A sequence samples in a step whose work reaches its last known token. The
 * room test (`credits`) holds a sampling sequence out of a step when the
 * ring its records go to has no free slot.
 *
 * All state lives in one arena (dpuf_sched_arena_bytes) that the caller
 * allocates: host memory for the tests, device memory for the kernel.
 * Nothing here allocates, blocks or fails silently: every entry point
 * returns a DPUF_SCHED_* code.
 *
 * Where the kernel spreads a step's work over its threads, this file offers
 * the per-work piece (dpuf_sched_commit_work, dpuf_sched_fill_work) and the
 * serial wrappers of the host build loop over the same pieces: the code CI
 * tests is the code the GPU runs, whichever loop calls it.
 */
#ifndef DPUF_SCHED_CORE_H
#define DPUF_SCHED_CORE_H

#include <stdint.h>

#ifdef __CUDACC__
#define DPUF_SCHED_FN static inline __host__ __device__
#else
#define DPUF_SCHED_FN static inline
#endif

#define DPUF_SCHED_OK 0
#define DPUF_SCHED_FULL -1        /* no free sequence entry */
#define DPUF_SCHED_BAD_PROMPT -2  /* prompt empty or leaves no room in the context */
#define DPUF_SCHED_BAD_ENTRY -3   /* an entry that is not a live sequence */
#define DPUF_SCHED_NO_GRAPH -4    /* no captured graph holds the step */

#define DPUF_SEQ_FREE 0
#define DPUF_SEQ_WAITING 1
#define DPUF_SEQ_RUNNING 2
#define DPUF_SEQ_FINISHED 3

#define DPUF_SCHED_MAX_CHANNELS 64
#define DPUF_SCHED_MAX_GRAPHS 64

typedef struct dpuf_sched_config {
    int32_t max_seqs;           /*  0 slots: sequences in a step at most */
    int32_t max_batched_tokens; /*  4 the token budget of a step */
    int32_t max_model_len;      /*  8 prompt + output at most */
    int32_t block_size;         /* 12 tokens per KV block */
    int32_t num_blocks;         /* 16 KV blocks in the pool */
    int32_t capacity;           /* 20 sequences known at once (waiting + running) */
    int32_t per_tile;           /* 24 query tokens per attention tile */
    int32_t scratch_slot;       /* 28 the cache slot padding rows write to */
} dpuf_sched_config;

typedef struct dpuf_sched_seq {
    int64_t seq_id;     /*  0 the caller's */
    int32_t prompt_len; /*  8 */
    int32_t limit;      /* 12 prompt + output may not pass this */
    int32_t slot;       /* 16 the runner's row; -1 until admitted */
    int32_t computed;   /* 20 positions whose K and V are in the cache */
    int32_t generated;  /* 24 */
    int32_t status;     /* 28 DPUF_SEQ_* */
    int32_t channel;    /* 32 whose ring room it needs; -1: none */
    int32_t n_blocks;   /* 36 its blocks: tables[slot * max_blocks ...] */
} dpuf_sched_seq;

typedef struct dpuf_sched_work {
    int32_t seq;    /* entry */
    int32_t start;  /* first position */
    int32_t count;  /* tokens */
    int32_t sample; /* draws a token */
} dpuf_sched_work;

/* A captured step graph's sizes and where its static inputs are. Fields of
 * the input buffer, in this order, each 8-byte aligned: slots, positions,
 * cache_slots (int64[tokens]), sample_rows (int64[samples]), tables
 * (int32[seqs][max_blocks]), tile_seq, tile_row (int32[tiles]), q_start,
 * q_len, ctx_start (int32[seqs]) -- graphs.StepGraph's layout. */
typedef struct dpuf_sched_graph {
    int32_t tokens;  /*  0 */
    int32_t seqs;    /*  4 */
    int32_t tiles;   /*  8 */
    int32_t samples; /* 12 -1: a decode graph (every row samples) */
    uint8_t *inputs; /* 16 */
} dpuf_sched_graph;

typedef struct dpuf_sched {
    dpuf_sched_config c;
    int32_t max_blocks; /* per sequence: blocks of one max_model_len context */
    int32_t n_free_entries, wait_head, wait_count, n_running, n_free_slots;
    int32_t pool_head, pool_free;
    int32_t n_works, n_admitted, n_preempted, n_graphs;
    int64_t preemptions;
    uint64_t held; /* channels whose ring held a sequence out of the last step */
    dpuf_sched_seq *seqs;       /* [capacity] */
    int32_t *free_entries;      /* [capacity] a stack */
    int32_t *waiting;           /* [capacity] a ring: head, count */
    int32_t *running;           /* [max_seqs] in admission order */
    int32_t *free_slots;        /* [max_seqs] a stack */
    int32_t *pool;              /* [num_blocks] a ring of free blocks */
    uint8_t *used;              /* [num_blocks] */
    int32_t *tables;            /* [max_seqs][max_blocks] by slot */
    int32_t *scratch;           /* [capacity] */
    dpuf_sched_work *works;     /* [max_seqs] */
    int32_t *admitted;          /* [max_seqs] */
    int32_t *preempted;         /* [capacity] */
    int64_t *credits;           /* [DPUF_SCHED_MAX_CHANNELS] records a channel's ring takes */
    dpuf_sched_graph graphs[DPUF_SCHED_MAX_GRAPHS]; /* decode graphs, then mixed, each smallest first */
} dpuf_sched;

DPUF_SCHED_FN uint64_t dpuf_sched_align(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

DPUF_SCHED_FN int32_t dpuf_sched_max_blocks(const dpuf_sched_config *c) {
    return (c->max_model_len + c->block_size - 1) / c->block_size;
}

/* The arena's size for `c`, every array 8-byte aligned. */
DPUF_SCHED_FN uint64_t dpuf_sched_arena_bytes(const dpuf_sched_config *c) {
    uint64_t q = (uint64_t)c->capacity, s = (uint64_t)c->max_seqs, b = (uint64_t)c->num_blocks;
    uint64_t mb = (uint64_t)dpuf_sched_max_blocks(c);
    return dpuf_sched_align(q * sizeof(dpuf_sched_seq)) + 4 * dpuf_sched_align(q * 4) +
           3 * dpuf_sched_align(s * 4) + dpuf_sched_align(b * 4) + dpuf_sched_align(b) +
           dpuf_sched_align(s * mb * 4) + dpuf_sched_align(s * sizeof(dpuf_sched_work)) +
           8 * DPUF_SCHED_MAX_CHANNELS;
}

DPUF_SCHED_FN uint8_t *dpuf_sched_take(uint8_t **at, uint64_t n) {
    uint8_t *p = *at;
    *at += dpuf_sched_align(n);
    return p;
}

/* Lay the state out in `arena` and empty it. Capacity and slots are the
 * caller's to size; `c` is checked by the caller (the Python side). */
DPUF_SCHED_FN void dpuf_sched_init(dpuf_sched *s, const dpuf_sched_config *c, uint8_t *arena) {
    s->c = *c;
    s->max_blocks = dpuf_sched_max_blocks(c);
    uint64_t q = (uint64_t)c->capacity, n = (uint64_t)c->max_seqs, b = (uint64_t)c->num_blocks;
    uint8_t *at = arena;
    s->seqs = (dpuf_sched_seq *)dpuf_sched_take(&at, q * sizeof(dpuf_sched_seq));
    s->free_entries = (int32_t *)dpuf_sched_take(&at, q * 4);
    s->waiting = (int32_t *)dpuf_sched_take(&at, q * 4);
    s->scratch = (int32_t *)dpuf_sched_take(&at, q * 4);
    s->preempted = (int32_t *)dpuf_sched_take(&at, q * 4);
    s->running = (int32_t *)dpuf_sched_take(&at, n * 4);
    s->free_slots = (int32_t *)dpuf_sched_take(&at, n * 4);
    s->admitted = (int32_t *)dpuf_sched_take(&at, n * 4);
    s->pool = (int32_t *)dpuf_sched_take(&at, b * 4);
    s->used = dpuf_sched_take(&at, b);
    s->tables = (int32_t *)dpuf_sched_take(&at, n * (uint64_t)s->max_blocks * 4);
    s->works = (dpuf_sched_work *)dpuf_sched_take(&at, n * sizeof(dpuf_sched_work));
    s->credits = (int64_t *)dpuf_sched_take(&at, 8 * DPUF_SCHED_MAX_CHANNELS);
    for (int32_t i = 0; i < c->capacity; i++) {
        s->seqs[i].status = DPUF_SEQ_FREE;
        s->free_entries[i] = c->capacity - 1 - i; /* entry 0 is taken first */
    }
    s->n_free_entries = c->capacity;
    /* Slot 0 is handed out first, as the Python scheduler's free list. */
    for (int32_t i = 0; i < c->max_seqs; i++) s->free_slots[i] = c->max_seqs - 1 - i;
    s->n_free_slots = c->max_seqs;
    for (int32_t i = 0; i < c->num_blocks; i++) {
        s->pool[i] = i;
        s->used[i] = 0;
    }
    s->pool_head = 0;
    s->pool_free = c->num_blocks;
    for (int32_t i = 0; i < DPUF_SCHED_MAX_CHANNELS; i++) s->credits[i] = INT64_MAX;
    s->wait_head = s->wait_count = s->n_running = 0;
    s->n_works = s->n_admitted = s->n_preempted = 0;
    s->preemptions = 0;
    s->held = 0;
    s->n_graphs = 0;
}

/* ---- the block pool: a FIFO ring, so a freed block is reused as late as possible */

DPUF_SCHED_FN int32_t dpuf_sched_blocks_for(const dpuf_sched *s, int32_t tokens) {
    return (tokens + s->c.block_size - 1) / s->c.block_size;
}

/* Hold blocks for `tokens` positions in all; 0 (nothing taken) when too few are free. */
DPUF_SCHED_FN int dpuf_sched_reserve(dpuf_sched *s, dpuf_sched_seq *q, int32_t tokens) {
    int32_t need = dpuf_sched_blocks_for(s, tokens) - q->n_blocks;
    if (need <= 0) return 1;
    if (need > s->pool_free) return 0;
    int32_t *table = s->tables + (int64_t)q->slot * s->max_blocks;
    for (int32_t i = 0; i < need; i++) {
        int32_t block = s->pool[s->pool_head];
        s->pool_head = (s->pool_head + 1) % s->c.num_blocks;
        s->used[block] = 1;
        table[q->n_blocks++] = block;
    }
    s->pool_free -= need;
    return 1;
}

DPUF_SCHED_FN void dpuf_sched_release(dpuf_sched *s, dpuf_sched_seq *q) {
    const int32_t *table = s->tables + (int64_t)q->slot * s->max_blocks;
    for (int32_t i = 0; i < q->n_blocks; i++) {
        int32_t tail = (s->pool_head + s->pool_free) % s->c.num_blocks;
        s->used[table[i]] = 0;
        s->pool[tail] = table[i];
        s->pool_free++;
    }
    q->n_blocks = 0;
}

/* ---- lists */

DPUF_SCHED_FN int32_t dpuf_sched_wait_at(const dpuf_sched *s, int32_t i) {
    return s->waiting[(s->wait_head + i) % s->c.capacity];
}

DPUF_SCHED_FN void dpuf_sched_push_back(dpuf_sched *s, int32_t e) {
    s->waiting[(s->wait_head + s->wait_count) % s->c.capacity] = e;
    s->wait_count++;
}

DPUF_SCHED_FN void dpuf_sched_push_front(dpuf_sched *s, int32_t e) {
    s->wait_head = (s->wait_head + s->c.capacity - 1) % s->c.capacity;
    s->waiting[s->wait_head] = e;
    s->wait_count++;
}

DPUF_SCHED_FN int32_t dpuf_sched_pop_front(dpuf_sched *s) {
    int32_t e = s->waiting[s->wait_head];
    s->wait_head = (s->wait_head + 1) % s->c.capacity;
    s->wait_count--;
    return e;
}

DPUF_SCHED_FN void dpuf_sched_unwait(dpuf_sched *s, int32_t e) {
    int32_t i = 0;
    while (i < s->wait_count && dpuf_sched_wait_at(s, i) != e) i++;
    for (; i + 1 < s->wait_count; i++)
        s->waiting[(s->wait_head + i) % s->c.capacity] = dpuf_sched_wait_at(s, i + 1);
    s->wait_count--;
}

DPUF_SCHED_FN void dpuf_sched_unrun(dpuf_sched *s, int32_t e) {
    int32_t i = 0;
    while (i < s->n_running && s->running[i] != e) i++;
    for (; i + 1 < s->n_running; i++) s->running[i] = s->running[i + 1];
    s->n_running--;
}

/* ---- sequences */

/* A new sequence at the back of the queue; its entry, or DPUF_SCHED_FULL /
 * DPUF_SCHED_BAD_PROMPT. */
DPUF_SCHED_FN int32_t dpuf_sched_add(dpuf_sched *s, int64_t seq_id, int32_t prompt_len,
                                     int64_t max_tokens, int32_t channel) {
    if (prompt_len < 1 || prompt_len >= s->c.max_model_len) return DPUF_SCHED_BAD_PROMPT;
    if (s->n_free_entries == 0) return DPUF_SCHED_FULL;
    int32_t e = s->free_entries[--s->n_free_entries];
    dpuf_sched_seq *q = &s->seqs[e];
    int64_t limit = (int64_t)prompt_len + (max_tokens > 0 ? max_tokens : 0);
    q->seq_id = seq_id;
    q->prompt_len = prompt_len;
    q->limit = limit < s->c.max_model_len ? (int32_t)limit : s->c.max_model_len;
    q->slot = -1;
    q->computed = q->generated = q->n_blocks = 0;
    q->status = DPUF_SEQ_WAITING;
    q->channel = channel;
    dpuf_sched_push_back(s, e);
    return e;
}

/* Retire a sequence (stopped, at its limit, cancelled): its blocks and slot go
 * to the next steps; its entry is free for a new sequence. */
DPUF_SCHED_FN int dpuf_sched_finish(dpuf_sched *s, int32_t e) {
    if (e < 0 || e >= s->c.capacity) return DPUF_SCHED_BAD_ENTRY;
    dpuf_sched_seq *q = &s->seqs[e];
    if (q->status == DPUF_SEQ_RUNNING) {
        dpuf_sched_unrun(s, e);
    } else if (q->status == DPUF_SEQ_WAITING) {
        dpuf_sched_unwait(s, e);
    } else {
        return DPUF_SCHED_BAD_ENTRY;
    }
    if (q->slot >= 0) {
        dpuf_sched_release(s, q);
        s->free_slots[s->n_free_slots++] = q->slot;
    }
    q->status = DPUF_SEQ_FREE;
    s->free_entries[s->n_free_entries++] = e;
    return DPUF_SCHED_OK;
}

/* ---- one step */

/* The room test before a sequence samples: its channel's ring takes one more
 * record this step. */
DPUF_SCHED_FN int dpuf_sched_room(dpuf_sched *s, const dpuf_sched_seq *q) {
    if (q->channel < 0) return 1;
    int64_t *left = &s->credits[q->channel];
    if (*left <= 0) {
        s->held |= (uint64_t)1 << q->channel;
        return 0;
    }
    --*left;
    return 1;
}

DPUF_SCHED_FN void dpuf_sched_put_work(dpuf_sched *s, int32_t e, int32_t start, int32_t count,
                                       int32_t sample) {
    dpuf_sched_work *w = &s->works[s->n_works++];
    w->seq = e;
    w->start = start;
    w->count = count;
    w->sample = sample;
}

DPUF_SCHED_FN void dpuf_sched_preempt(dpuf_sched *s, int32_t e) {
    dpuf_sched_seq *q = &s->seqs[e];
    dpuf_sched_unrun(s, e);
    dpuf_sched_release(s, q);
    q->computed = 0;
    q->status = DPUF_SEQ_WAITING;
    dpuf_sched_push_front(s, e);
    s->preempted[s->n_preempted++] = e;
    s->preemptions++;
}

/* Up to `budget` tokens of a prefill, as far as blocks allow; tokens taken. A
 * chunk that would end the prompt is held when `room` says so. */
DPUF_SCHED_FN int32_t dpuf_sched_chunk(dpuf_sched *s, int32_t e, int32_t budget, int room) {
    dpuf_sched_seq *q = &s->seqs[e];
    int32_t total = q->prompt_len + q->generated;
    int32_t count = total - q->computed < budget ? total - q->computed : budget;
    int64_t fits = (int64_t)q->n_blocks * s->c.block_size +
                   (int64_t)s->pool_free * s->c.block_size - q->computed;
    if (fits < count) count = (int32_t)fits;
    int sample = q->computed + count == total;
    if (count <= 0 || (sample && room && !dpuf_sched_room(s, q))) return 0;
    if (!dpuf_sched_reserve(s, q, q->computed + count)) return 0;
    dpuf_sched_put_work(s, e, q->computed, count, sample);
    return count;
}

/* A step's schedule in its three parts, each taking the token budget left and
 * returning what it leaves. dpuf_sched_begin empties the last step's batch. */
DPUF_SCHED_FN int32_t dpuf_sched_begin(dpuf_sched *s) {
    s->n_works = s->n_admitted = s->n_preempted = 0;
    s->held = 0;
    return s->c.max_batched_tokens;
}

/* 1. decodes, over the running list as it was (preemption shortens it) */
DPUF_SCHED_FN int32_t dpuf_sched_decodes(dpuf_sched *s, int32_t budget) {
    int32_t n = s->n_running;
    for (int32_t i = 0; i < n; i++) s->scratch[i] = s->running[i];
    for (int32_t i = 0; i < n && budget > 0; i++) {
        int32_t e = s->scratch[i];
        dpuf_sched_seq *q = &s->seqs[e];
        if (q->status != DPUF_SEQ_RUNNING || q->prompt_len + q->generated - q->computed != 1)
            continue;
        if (!dpuf_sched_room(s, q)) continue;
        while (!dpuf_sched_reserve(s, q, q->computed + 1)) {
            int32_t victim = s->running[s->n_running - 1];
            dpuf_sched_preempt(s, victim);
            if (victim == e) break;
        }
        if (q->status == DPUF_SEQ_RUNNING) {
            dpuf_sched_put_work(s, e, q->computed, 1, 1);
            budget -= 1;
        }
    }
    return budget;
}

/* Per index of the running list, what part 1 does with it where nothing is
 * preempted and every ring has room (dpuf_sched_decode_need), and whether a
 * sequence has prompt left for part 2. */
typedef struct dpuf_sched_need {
    int32_t decode;  /* running[i] decodes this step */
    int32_t blocks;  /* the pool's blocks its next position takes */
    int32_t prefill; /* it has prompt left: a chunk in part 2 */
    int32_t channel; /* whose ring room its decode takes; -1: none */
} dpuf_sched_need;

/* 2. prefill chunks of running sequences. `needs`: the running list's, taken
 * before part 1 spread its decodes (which leave the list and what each has
 * left as they were), so only the sequences with prompt left are looked at;
 * NULL: every running sequence is. */
DPUF_SCHED_FN int32_t dpuf_sched_prefills(dpuf_sched *s, int32_t budget,
                                          const dpuf_sched_need *needs) {
    for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
        if (needs != 0) {
            if (needs[i].prefill) budget -= dpuf_sched_chunk(s, s->running[i], budget, 1);
            continue;
        }
        dpuf_sched_seq *q = &s->seqs[s->running[i]];
        if (q->prompt_len + q->generated - q->computed > 1)
            budget -= dpuf_sched_chunk(s, s->running[i], budget, 1);
    }
    return budget;
}

/* 3. admission, in arrival order; a sequence whose ring is full steps aside */
DPUF_SCHED_FN void dpuf_sched_admit(dpuf_sched *s, int32_t budget) {
    int32_t n_held = 0;
    while (s->wait_count > 0 && budget > 0) {
        int32_t e = dpuf_sched_wait_at(s, 0);
        dpuf_sched_seq *q = &s->seqs[e];
        int32_t total = q->prompt_len + q->generated;
        if (q->slot < 0 && s->n_free_slots == 0) break;
        if (s->pool_free < dpuf_sched_blocks_for(s, total) - q->n_blocks) break;
        if (total - q->computed <= budget && !dpuf_sched_room(s, q)) {
            s->scratch[n_held++] = dpuf_sched_pop_front(s);
            continue;
        }
        dpuf_sched_pop_front(s);
        if (q->slot < 0) {
            q->slot = s->free_slots[--s->n_free_slots];
            s->admitted[s->n_admitted++] = e;
        }
        q->status = DPUF_SEQ_RUNNING;
        s->running[s->n_running++] = e;
        budget -= dpuf_sched_chunk(s, e, budget, 0);
    }
    for (int32_t i = n_held - 1; i >= 0; i--) dpuf_sched_push_front(s, s->scratch[i]);
}

/* The next step's batch: works, admitted, preempted; `credits` (set by the
 * caller before) bound each channel's sampling sequences. */
DPUF_SCHED_FN void dpuf_sched_schedule(dpuf_sched *s) {
    int32_t budget = dpuf_sched_begin(s);
    budget = dpuf_sched_decodes(s, budget);
    budget = dpuf_sched_prefills(s, budget, 0);
    dpuf_sched_admit(s, budget);
}

/* ---- part 1 spread over threads
 *
 * At a full batch part 1 is most of a schedule: for one thread, a few
 * dependent loads per running sequence. Where the step preempts nothing and
 * every channel's ring has room for all of its decodes (a full batch's usual
 * step), part 1 is a prefix sum: running[i] decodes into work number (the
 * decodes before i) and takes the pool's blocks from pool_head + (the blocks
 * taken before i), as the serial loop would. The kernel runs
 * dpuf_sched_decode_need and dpuf_sched_decode_take per index on its threads
 * and the sums as a block scan; dpuf_sched_schedule_spread is the same in
 * loops. Where dpuf_sched_decode_fits says no, the serial part 1 runs. */

DPUF_SCHED_FN dpuf_sched_need dpuf_sched_decode_need(const dpuf_sched *s, int32_t i) {
    const dpuf_sched_seq *q = &s->seqs[s->running[i]];
    const int32_t left = q->prompt_len + q->generated - q->computed;
    dpuf_sched_need need = {0, 0, 0, q->channel};
    if (q->status != DPUF_SEQ_RUNNING) return need;
    need.decode = left == 1;
    need.prefill = left > 1;
    if (need.decode) {
        const int32_t more = dpuf_sched_blocks_for(s, q->computed + 1) - q->n_blocks;
        need.blocks = more > 0 ? more : 0;
    }
    return need;
}

/* Whether the spread part 1 is the serial one: the budget holds every decode,
 * the pool every block they take, each channel's credits (`counts[c]`: its
 * decodes) all of its decodes. */
DPUF_SCHED_FN int dpuf_sched_decode_fits(const dpuf_sched *s, int32_t budget, int32_t decodes,
                                         int32_t blocks, const int32_t *counts) {
    if (decodes > budget || blocks > s->pool_free) return 0;
    for (int32_t c = 0; c < DPUF_SCHED_MAX_CHANNELS; c++)
        if (counts[c] > s->credits[c]) return 0;
    return 1;
}

/* running[i]'s decode as work number `work`, its blocks the pool's from
 * pool_head + `block`; nothing for an index that does not decode. Indices
 * touch their own sequence, table and work only: any thread, any order. */
DPUF_SCHED_FN void dpuf_sched_decode_take(dpuf_sched *s, int32_t i, dpuf_sched_need need,
                                          int32_t work, int32_t block) {
    if (!need.decode) return;
    const int32_t e = s->running[i];
    dpuf_sched_seq *q = &s->seqs[e];
    int32_t *table = s->tables + (int64_t)q->slot * s->max_blocks;
    for (int32_t j = 0; j < need.blocks; j++) {
        const int32_t b = s->pool[(s->pool_head + block + j) % s->c.num_blocks];
        s->used[b] = 1;
        table[q->n_blocks + j] = b;
    }
    q->n_blocks += need.blocks;
    dpuf_sched_work *w = &s->works[work];
    w->seq = e;
    w->start = q->computed;
    w->count = 1;
    w->sample = 1;
}

/* One thread, after every index took its part: the pool, the credits and the
 * works' count as the serial loop leaves them; the budget left. */
DPUF_SCHED_FN int32_t dpuf_sched_decode_commit(dpuf_sched *s, int32_t budget, int32_t decodes,
                                               int32_t blocks, const int32_t *counts) {
    s->n_works = decodes;
    s->pool_head = (s->pool_head + blocks) % s->c.num_blocks;
    s->pool_free -= blocks;
    for (int32_t c = 0; c < DPUF_SCHED_MAX_CHANNELS; c++) s->credits[c] -= counts[c];
    return budget - decodes;
}

/* dpuf_sched_schedule with part 1 spread, in loops (the host build's form of
 * the kernel's; the same outcome as dpuf_sched_schedule). `needs`: room for
 * max_seqs; `counts`: for DPUF_SCHED_MAX_CHANNELS. Returns 1 where part 1 had
 * decodes and ran spread, 0 where it had none or ran serial. */
DPUF_SCHED_FN int dpuf_sched_schedule_spread(dpuf_sched *s, dpuf_sched_need *needs,
                                             int32_t *counts) {
    int32_t budget = dpuf_sched_begin(s);
    const int32_t n = s->n_running;
    int32_t decodes = 0, blocks = 0;
    for (int32_t c = 0; c < DPUF_SCHED_MAX_CHANNELS; c++) counts[c] = 0;
    for (int32_t i = 0; i < n; i++) {
        needs[i] = dpuf_sched_decode_need(s, i);
        if (needs[i].decode && needs[i].channel >= 0) counts[needs[i].channel]++;
        decodes += needs[i].decode;
        blocks += needs[i].blocks;
    }
    const int spread = dpuf_sched_decode_fits(s, budget, decodes, blocks, counts);
    if (spread) {
        int32_t work = 0, block = 0;
        for (int32_t i = 0; i < n; i++) {
            dpuf_sched_decode_take(s, i, needs[i], work, block);
            work += needs[i].decode;
            block += needs[i].blocks;
        }
        budget = dpuf_sched_decode_commit(s, budget, decodes, blocks, counts);
        budget = dpuf_sched_prefills(s, budget, needs);
    } else {
        budget = dpuf_sched_decodes(s, budget);
        budget = dpuf_sched_prefills(s, budget, 0);
    }
    dpuf_sched_admit(s, budget);
    return spread && decodes > 0;
}

/* Work i ran: its KV is in the cache and, if it samples, its sequence has one
 * more token. A sequence is in one work at most, so the works of a step may
 * be committed in any order, by any threads (the kernel strides over them).
 * Returns the KV positions the work's attention read, its context and its own
 * tokens (start + count), whatever its sequence's state: what the host
 * engine's EngineStats.context_tokens counts (dpuf_model_stats.context_tokens,
 * the bandwidth bound of the steps that ran). */
DPUF_SCHED_FN uint64_t dpuf_sched_commit_work(dpuf_sched *s, int32_t i) {
    const dpuf_sched_work *w = &s->works[i];
    dpuf_sched_seq *q = &s->seqs[w->seq];
    const uint64_t context = (uint64_t)w->start + (uint64_t)w->count;
    if (q->status != DPUF_SEQ_RUNNING) return context;
    q->computed = w->start + w->count;
    q->generated += w->sample;
    return context;
}

/* The step ran: every work committed (the host build's loop). Returns the
 * step's KV positions read, the sum of dpuf_sched_commit_work's. */
DPUF_SCHED_FN uint64_t dpuf_sched_commit(dpuf_sched *s) {
    uint64_t context = 0;
    for (int32_t i = 0; i < s->n_works; i++) context += dpuf_sched_commit_work(s, i);
    return context;
}

/* ---- the step's metadata, in the smallest captured graph that holds it */

DPUF_SCHED_FN int dpuf_sched_is_decode(const dpuf_sched *s) {
    for (int32_t i = 0; i < s->n_works; i++)
        if (s->works[i].count != 1 || !s->works[i].sample) return 0;
    return 1;
}

/* Where a work's part of a step starts: its first query row, its first
 * attention tile and its index among the sampling works. Over the whole step
 * (dpuf_sched_layout's return): the step's tokens, tiles and samples. */
typedef struct dpuf_sched_span {
    int32_t row;
    int32_t tile;
    int32_t sample;
} dpuf_sched_span;

/* The step's layout, counted once: each work's span into `at[i]` (NULL: the
 * totals only) and the step's totals returned. Serial: the prefix sums are a
 * few hundred additions, which the kernel's thread 0 runs into shared memory
 * while the rest of the block waits, and the host build into its arena. */
DPUF_SCHED_FN dpuf_sched_span dpuf_sched_layout(const dpuf_sched *s, dpuf_sched_span *at) {
    dpuf_sched_span total = {0, 0, 0};
    const int32_t p = s->c.per_tile;
    for (int32_t i = 0; i < s->n_works; i++) {
        const dpuf_sched_work *w = &s->works[i];
        if (at != 0) at[i] = total;
        total.row += w->count;
        total.tile += (w->count + p - 1) / p;
        total.sample += w->sample;
    }
    return total;
}

/* The index of the graph that runs a step of these totals
 * (graphs.StepGraphs.graph_for), or DPUF_SCHED_NO_GRAPH. */
DPUF_SCHED_FN int32_t dpuf_sched_graph_for(const dpuf_sched *s, dpuf_sched_span total) {
    const int32_t seqs = s->n_works;
    const int decode = dpuf_sched_is_decode(s);
    for (int32_t g = 0; g < s->n_graphs; g++) {
        const dpuf_sched_graph *gr = &s->graphs[g];
        if ((gr->samples < 0) != decode) continue;
        if (total.row <= gr->tokens && seqs < gr->seqs + (gr->samples < 0) && total.tile <= gr->tiles &&
            (gr->samples < 0 || total.sample <= gr->samples))
            return g;
    }
    return DPUF_SCHED_NO_GRAPH;
}

typedef struct dpuf_sched_fields {
    int64_t *slots, *positions, *cache_slots, *sample_rows;
    int32_t *tables, *tile_seq, *tile_row, *q_start, *q_len, *ctx_start;
} dpuf_sched_fields;

DPUF_SCHED_FN dpuf_sched_fields dpuf_sched_fields_of(const dpuf_sched *s, const dpuf_sched_graph *g) {
    dpuf_sched_fields f;
    uint8_t *at = g->inputs;
    int64_t samples = g->samples < 0 ? 0 : g->samples;
    f.slots = (int64_t *)dpuf_sched_take(&at, 8 * (uint64_t)g->tokens);
    f.positions = (int64_t *)dpuf_sched_take(&at, 8 * (uint64_t)g->tokens);
    f.cache_slots = (int64_t *)dpuf_sched_take(&at, 8 * (uint64_t)g->tokens);
    f.sample_rows = (int64_t *)dpuf_sched_take(&at, 8 * (uint64_t)samples);
    f.tables = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->seqs * s->max_blocks);
    f.tile_seq = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->tiles);
    f.tile_row = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->tiles);
    f.q_start = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->seqs);
    f.q_len = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->seqs);
    f.ctx_start = (int32_t *)dpuf_sched_take(&at, 4 * (uint64_t)g->seqs);
    return f;
}

/* Write work `i`'s part of graph `g`'s inputs: its query rows, its tiles, its
 * table row and spans, from its span `at` (dpuf_sched_layout). One work per
 * call, so the GPU kernel spreads the works over its threads. */
DPUF_SCHED_FN void dpuf_sched_fill_work(const dpuf_sched *s, const dpuf_sched_graph *g,
                                        const dpuf_sched_fields *f, int32_t i, dpuf_sched_span at) {
    const int32_t row = at.row, tile = at.tile;
    const dpuf_sched_work *w = &s->works[i];
    const dpuf_sched_seq *q = &s->seqs[w->seq];
    const int32_t *table = s->tables + (int64_t)q->slot * s->max_blocks;
    int32_t page = s->c.block_size, p = s->c.per_tile;
    int32_t *mine = f->tables + (int64_t)i * s->max_blocks;
    for (int32_t b = 0; b < q->n_blocks; b++) mine[b] = table[b];
    for (int32_t r = 0; r < w->count; r++) {
        int64_t pos = (int64_t)w->start + r;
        f->slots[row + r] = q->slot;
        f->positions[row + r] = pos;
        f->cache_slots[row + r] = (int64_t)table[pos / page] * page + pos % page;
    }
    int32_t tiles = (w->count + p - 1) / p;
    for (int32_t t = 0; t < tiles; t++) {
        f->tile_seq[tile + t] = i;
        f->tile_row[tile + t] = t * p;
    }
    f->q_start[i] = row;
    f->q_len[i] = w->count;
    f->ctx_start[i] = w->start;
    if (w->sample && g->samples >= 0) f->sample_rows[at.sample] = row + w->count - 1;
}

/* The padding past the batch: rows write K and V to the scratch slot, padding
 * tiles belong to the last sequence (padding, no query token). Starting
 * at `from`, every `stride`-th element (the GPU kernel's threads). */
DPUF_SCHED_FN void dpuf_sched_fill_padding(const dpuf_sched *s, const dpuf_sched_graph *g,
                                           const dpuf_sched_fields *f, dpuf_sched_span total,
                                           int32_t from, int32_t stride) {
    const int32_t seqs = s->n_works, tokens = total.row, tiles = total.tile, samples = total.sample;
    for (int32_t r = tokens + from; r < g->tokens; r += stride) {
        f->slots[r] = 0;
        f->positions[r] = 0;
        f->cache_slots[r] = s->c.scratch_slot;
    }
    for (int32_t t = tiles + from; t < g->tiles; t += stride) {
        f->tile_seq[t] = g->seqs - 1;
        f->tile_row[t] = 0;
    }
    for (int32_t i = seqs + from; i < g->seqs; i += stride) f->q_start[i] = f->q_len[i] = f->ctx_start[i] = 0;
    for (int32_t k = samples + from; k < (g->samples < 0 ? 0 : g->samples); k += stride)
        f->sample_rows[k] = 0;
    /* Every table entry past a work's blocks is zero. */
    for (int32_t i = from; i < g->seqs; i += stride) {
        int32_t held = i < seqs ? s->seqs[s->works[i].seq].n_blocks : 0;
        int32_t *row = f->tables + (int64_t)i * s->max_blocks;
        for (int32_t b = held; b < s->max_blocks; b++) row[b] = 0;
    }
}

/* The whole fill on one thread, from the step's layout `at` (the host build's
 * loop; the kernel strides over the same two pieces). */
DPUF_SCHED_FN int32_t dpuf_sched_fill(const dpuf_sched *s, int32_t g, const dpuf_sched_span *at,
                                      dpuf_sched_span total) {
    const dpuf_sched_graph *gr = &s->graphs[g];
    const dpuf_sched_fields f = dpuf_sched_fields_of(s, gr);
    for (int32_t i = 0; i < s->n_works; i++) dpuf_sched_fill_work(s, gr, &f, i, at[i]);
    dpuf_sched_fill_padding(s, gr, &f, total, 0, 1);
    return DPUF_SCHED_OK;
}

#endif /* DPUF_SCHED_CORE_H */
