/*
 * scheduler.cu: the model's scheduler inside the GPU (`model-peer --scheduler gpu`).
 *
 * Two persistent kernels and the host API of scheduler.h:
 *   - the scheduler kernel, one block of SCHED_THREADS threads, captured in
 *     a graph instantiated for device launch. Each run of it is one engine
 *     step of the host-driven loop (dpu_frontend/model/engine.py), with no
 *     host in it:
 *       A. publish the records of the step that just ran (the record
 *          writer's phases, record_writer.cuh: finals, arms, rows) and
 *          retire the sequences they finished;
 *       B. run the channels' mailbox commands (attach: a new epoch, rings
 *          reset; detach), dropping the channel's sequences;
 *       C. take the committed request records in: a GENERATE becomes a
 *          waiting sequence (its prompt copied out of the arena, and a
 *          constrained one's automaton into the automata's pool, checked,
 *          unless the pool holds it already), a CANCEL retires its sequence
 *          with a cancelled record;
 *       D. schedule (sched_core.h), each channel's sampling sequences bound
 *          by the free slots of its response ring;
 *       E. load the admitted prompts into the runner's token buffer, write
 *          the step's metadata into the static inputs of the smallest
 *          captured graph that holds it, and the sampler's rows;
 *       F. tail-launch that step graph, the sampler graph of the batch's
 *          variant, and itself: the three run one after the other, so the
 *          next run sees the step's tokens.
 *     With nothing to run it polls the mailboxes and rings in place,
 *     sleeping idle_ns between polls, and never relaunches.
 *   - the heartbeat kernel (ring_device.cuh), one warp on its own stream.
 * The host launches both once; afterwards it only posts mailbox commands
 * and reads the mirrored counters. The ring region is the shm transport's
 * mapping, or GPU memory for a NIC (verbs): cuda_driver.cuh's, as the CUDA
 * peer's.
 *
 * Build (device graph launch needs the device runtime):
 *   nvcc -O3 -std=c++17 -arch=sm_90 -rdc=true -Xcompiler -fPIC -shared \
 *        -Idpu_frontend/gpu dpu_frontend/model/device/scheduler.cu -o libdpuf_sched.so -lcudadevrt
 */
#include "scheduler.h"

#define DPUF_SOURCE "scheduler.cu"
#include "cuda_host.cuh"
#include "cuda_driver.cuh"
#include "automaton_pool.cuh"
#include "record_writer.cuh"
#include "ring_device.cuh"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define SCHED_THREADS WRITER_THREADS /* the writer's phases run on this block */
#define SCHED_MAX_SEQS 1024          /* per-work prefix sums live in shared memory */
/* The running list's indices each thread takes in the spread decodes (schedule). */
#define SCHED_PER_THREAD ((int32_t)(SCHED_MAX_SEQS / SCHED_THREADS))
static_assert(SCHED_MAX_SEQS % SCHED_THREADS == 0 && SCHED_THREADS % 32 == 0,
              "the running list in whole shares of whole warps");

/* What the scheduler keeps of a request beside sched_core's sequence. */
struct entry_info {
    uint64_t request_id;
    uint64_t seed;
    uint32_t channel;
    uint32_t flags; /* DPUF_WRITER_IGNORE_EOS | DPUF_WRITER_LOGPROBS */
    uint32_t top;   /* alternatives with each token, with LOGPROBS */
    uint32_t n_stop;
    uint32_t stop[DPUF_MAX_STOP_TOKEN_IDS];
    float f[6]; /* temperature, top_p, min_p, presence, frequency, repetition */
    int64_t top_k; /* 0: off */
    uint32_t penalized;
    int32_t automaton; /* structured output: its automaton_slot, -1: none */
};

/* The ring's state of a channel (ring_device.cuh: next request, mailbox ack,
 * epoch, the mailbox's counters), then the scheduler's own. */
struct chan_state : ring_channel {
    uint64_t finals; /* finals queued for the next publish */
};

struct sched_ctl {
    uint32_t n_finals, n_arms, n_rows; /* queued for the next publish */
    uint32_t started;
    uint64_t seeds;       /* draws of seeds for requests without one */
    uint64_t launched_at; /* when the last run launched its step (global timer, ns) */
    uint64_t passes;      /* intake passes: the automata's clock */
};

struct sched_args {
    uint8_t *region;
    const dpuf_channel_desc *channels; /* device copy */
    uint32_t channel_count;
    uint32_t vocab;
    dpuf_kernel_block *kblock; /* mapped host memory */
    dpuf_mailbox *mailboxes;
    chan_state *chan;
    sched_ctl *ctl;
    dpuf_sched *s;
    entry_info *entries;
    uint32_t *prompts; /* [capacity][prompt_stride] */
    uint64_t prompt_stride;
    int64_t *tokens;
    uint64_t tokens_stride;
    int32_t *counts;
    uint8_t *in_prompt;
    uint64_t vocab_rows;
    int64_t *row_slot, *row_pos;
    float *row_floats;
    int64_t *row_ints;
    uint32_t rows_stride;
    const int64_t *out_tokens;
    const float *out_logprob;
    const int64_t *out_top_ids;
    const float *out_top_logprobs;
    int32_t *row_entry; /* [max_seqs]: the entry of each sampling row of the step that ran */
    int64_t *finals, *arms, *rows;
    uint32_t max_finals;
    dpuf_writer_channel *wstate;  /* device */
    dpuf_writer_channel *wmirror; /* pinned */
    writer_slot *wslots;          /* [max_seqs] by runner slot */
    uint32_t eos[DPUF_MODEL_MAX_EOS];
    uint32_t eos_count;
    dpuf_model_stats *stats;        /* device */
    dpuf_model_stats *stats_mirror; /* pinned */
    uint64_t idle_ns;
    int32_t n_graphs;
    int32_t samples[DPUF_SCHED_MAX_GRAPHS]; /* sampler rows of each graph */
    cudaGraphExec_t forward[DPUF_SCHED_MAX_GRAPHS];
    cudaGraphExec_t sampler[DPUF_SCHED_MAX_GRAPHS][DPUF_MODEL_VARIANTS];
    /* Structured output (dpuf_model_params): the pool (automaton_pool.cuh), and the
     * sampler's view of each slot's automaton. */
    automaton_pool automata;
    int64_t *ameta;  /* [max_seqs + 1][6]: base, states, list length, vocabulary, end token, on */
    int64_t *astate; /* [max_seqs + 1] */
};

/* The scheduler's timed phases (dpuf_model_stats.ns_*). */
enum { PH_PUBLISH, PH_INTAKE, PH_SCHEDULE, PH_COUNT };

/* The block's scratch: thread 0 decides, everyone reads after a barrier. */
struct sched_smem {
    ring_smem ring; /* a request record's or a mailbox command's */
    uint32_t stop, go;
    int32_t added; /* the entry sched_core gave a GENERATE */
    int32_t automaton;   /* the automaton_slot a GENERATE took, -1: none or refused */
    uint32_t auto_fresh; /* ... copied now: to check */
    uint32_t auto_bad;   /* ... its header failed a check */
    uint32_t auto_dense; /* ... its dense states, counted by the check */
    int32_t graph, variant;
    uint64_t t;     /* thread 0's clock of the phase timers */
    uint64_t ph[PH_COUNT]; /* this pass's phases so far */
    dpuf_sched_span total;             /* the step's tokens, tiles and samples */
    unsigned long long context;        /* the step's KV positions read, summed at the commit */
    dpuf_sched_span at[SCHED_MAX_SEQS]; /* where each work's rows, tiles and sample row start */
    /* The schedule's spread decodes: each running index's need, each channel's
     * decodes, each warp's sums of decodes and blocks (then the warps' before it),
     * and thread 0's totals and verdict. */
    dpuf_sched_need need[SCHED_MAX_SEQS];
    int32_t counts[DPUF_SCHED_MAX_CHANNELS];
    int32_t warp_sums[2][SCHED_THREADS / 32];
    int32_t budget, decodes, blocks, spread;
};

__device__ __forceinline__ dpuf_dpu_ctrl *dpu_of(const sched_args &a, uint32_t c) {
    return dpu_ctrl_of(a.region, a.channels + c);
}

/* splitmix64: a seed for a request that brought none. */
__device__ uint64_t fresh_seed(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* ---- structured output's automata ------------------------------------------ */

/* ---- A. publish and retire ------------------------------------------------ */

/* Thread 0: sequence e ends; its automaton has one user less. */
__device__ void retire(const sched_args &a, int32_t e) {
    entry_info *en = a.entries + e;
    if (en->automaton >= 0) a.automata.slots[en->automaton].users--;
    en->automaton = -1;
    dpuf_sched_finish(a.s, e);
}

__device__ void publish(const sched_args &a, writer_smem &wsm) {
    sched_ctl *ctl = a.ctl;
    const uint32_t nf = ctl->n_finals, na = ctl->n_arms, nr = ctl->n_rows;
    __syncthreads(); /* every thread has the counts before thread 0 clears them */
    writer_args w = {};
    w.region = a.region;
    w.channels = a.channels;
    w.state = a.wstate;
    w.mirror = a.wmirror;
    w.slots = a.wslots;
    w.slot_count = (uint32_t)a.s->c.max_seqs;
    w.channel_count = a.channel_count;
    for (uint32_t i = 0; i < DPUF_WRITER_MAX_EOS; i++) w.eos[i] = a.eos[i];
    w.eos_count = a.eos_count;
    w.finals = a.finals;
    w.arms = a.arms;
    w.rows = a.rows;
    w.n_finals = nf;
    w.n_arms = na;
    w.n_rows = nr;
    w.tokens = a.out_tokens;
    w.logprob = a.out_logprob;
    w.top_ids = a.out_top_ids;
    w.top_logprobs = a.out_top_logprobs;
    w.top_stride = DPUF_MAX_TOP_LOGPROBS;
    writer_run(w, wsm);
    __syncthreads();
    if (threadIdx.x == 0) {
        /* A row whose slot the writer closed ended its sequence (stop or
         * length): its blocks and slot go to the next step. */
        for (uint32_t i = 0; i < nr; i++) {
            const int64_t slot = a.rows[2 * i];
            if (a.wslots[slot].state != SLOT_ACTIVE) retire(a, a.row_entry[i]);
        }
        ctl->n_finals = ctl->n_arms = ctl->n_rows = 0;
        for (uint32_t c = 0; c < a.channel_count; c++) {
            a.chan[c].finals = 0;
            if (a.wstate[c].error) a.stats->error = DPUF_MODEL_ERR_WRITER;
        }
    }
    __syncthreads();
}

/* Thread 0: a record with no token for the next publish. */
__device__ void queue_final(const sched_args &a, int64_t slot, uint32_t c, uint64_t request_id, uint32_t finish,
                            uint32_t flags) {
    int64_t *op = a.finals + (uint64_t)a.ctl->n_finals++ * DPUF_WRITER_FINAL_WORDS;
    op[0] = slot;
    op[1] = c;
    op[2] = (int64_t)request_id;
    op[3] = finish;
    op[4] = flags;
    a.chan[c].finals++;
}

/* ---- B. mailbox ------------------------------------------------------------ */

/* Every sequence of channel c ends without a record (its ring is being reset
 * or let go): thread 0 retires them, the block closes their writer slots. */
__device__ void drop_channel(const sched_args &a, uint32_t c) {
    if (threadIdx.x == 0) {
        for (int32_t e = 0; e < a.s->c.capacity; e++) {
            const int32_t status = a.s->seqs[e].status;
            if ((status == DPUF_SEQ_WAITING || status == DPUF_SEQ_RUNNING) && a.entries[e].channel == c)
                retire(a, e);
        }
    }
    for (int32_t e = threadIdx.x; e < a.s->c.max_seqs; e += blockDim.x)
        if (a.wslots[e].state == SLOT_ACTIVE && a.wslots[e].channel == c) a.wslots[e].state = SLOT_DONE;
    __syncthreads();
}

/* The scheduler's side of a mailbox command (ring_device.cuh: mailbox_command). */
struct sched_mailbox {
    const sched_args &a;
    uint32_t c;

    __device__ void drop() const { drop_channel(a, c); }
    __device__ void reset(uint32_t epoch) const {
        if (threadIdx.x == 0) {
            a.chan[c].finals = 0;
            /* The ring restarts at position 0; the counters run on. */
            a.wstate[c].reserved = 0;
            a.wstate[c].epoch = epoch;
        }
    }
};

__device__ void run_mailbox(const sched_args &a, uint32_t c, sched_smem &sm) {
    mailbox_command(a.region, a.channels + c, a.mailboxes + c, a.chan + c, sm.ring, sched_mailbox{a, c});
}

/* ---- C. intake ------------------------------------------------------------- */

/* Response positions of channel c not yet promised: the DPU's read index
 * against what the writer used and the finals queued. */
__device__ int64_t ring_room(const sched_args &a, uint32_t c) {
    const uint64_t consumed = dpuf_load_acquire_sys(&dpu_of(a, c)->resp_consumed);
    const int64_t used = (int64_t)(a.wstate[c].reserved - consumed) + (int64_t)a.chan[c].finals;
    return (int64_t)a.channels[c].resp_slots - used;
}

/* Thread 0: a GENERATE's entry (its parameters), once its prompt checked out. */
__device__ void fill_entry(const sched_args &a, int32_t e, uint32_t c, const uint32_t *wd) {
    entry_info *en = a.entries + e;
    en->request_id = req_u64(wd, REQ_ID);
    en->channel = c;
    const uint32_t flags = wd[REQ_FLAGS];
    en->flags = ((flags & DPUF_FLAG_IGNORE_EOS) ? DPUF_WRITER_IGNORE_EOS : 0u) |
                ((flags & DPUF_FLAG_LOGPROBS) ? DPUF_WRITER_LOGPROBS : 0u);
    en->top = (flags & DPUF_FLAG_LOGPROBS) ? wd[REQ_LOGPROBS] : 0u;
    en->n_stop = wd[REQ_N_STOP];
    for (uint32_t i = 0; i < DPUF_MAX_STOP_TOKEN_IDS; i++) en->stop[i] = wd[REQ_STOP + i];
    const int32_t f_words[6] = {REQ_TEMPERATURE, REQ_TOP_P, REQ_MIN_P, REQ_PRESENCE, REQ_FREQUENCY, REQ_REPETITION};
    for (int i = 0; i < 6; i++) en->f[i] = __uint_as_float(wd[f_words[i]]);
    const int32_t top_k = (int32_t)wd[REQ_TOP_K];
    en->top_k = top_k > 0 && (uint64_t)top_k < a.vocab_rows ? top_k : 0;
    en->seed = (flags & DPUF_FLAG_HAS_SEED) ? req_u64(wd, REQ_SEED)
                                            : fresh_seed(global_timer_ns() ^ (a.ctl->seeds++ << 32) ^ en->request_id);
    en->penalized = DPUF_ROW_PENALIZED(en->f[3], en->f[4], en->f[5]);
}

/* The scheduler's side of the intake walk (ring_device.cuh: intake_walk) for
 * channel c: sched_core's sequences, their entries and prompt spans. */
struct sched_intake {
    const sched_args &a;
    uint32_t c;
    sched_smem &sm;

    __device__ uint32_t judge(uint32_t verdict, const uint32_t *wd) const {
        /* A record that may end in a final (a cancel, a refusal) waits for a
         * free response slot; so does one when the queue is full. */
        if (ring_room(a, c) <= 0 || a.ctl->n_finals >= a.max_finals) return V_NONE;
        if (verdict == V_GENERATE && (wd[REQ_FLAGS] & DPUF_FLAG_LOGPROBS) && wd[REQ_LOGPROBS] > DPUF_MAX_TOP_LOGPROBS)
            return V_BAD;
        if (verdict == V_GENERATE && (wd[REQ_FLAGS] & DPUF_FLAG_CONSTRAINED)) {
            /* Its automaton waits (and the records behind it) until the pool has
             * room: automata in use leave it as their sequences end. One larger
             * than the pool never fits (the layout's bound prevents it). A size no
             * automaton has is answered with an error (automata_take). */
            const uint32_t bytes = wd[REQ_AUTOMATON];
            if (!automaton_sized(bytes)) return verdict;
            if (automaton_words(bytes) > a.automata.pool_words) return V_BAD;
            uint32_t h[16];
            automaton_header(automaton_at(a.region, a.channels + c, wd), h);
            if (!automata_room(a.automata, automaton_key(h), bytes, automaton_words(bytes),
                               &a.stats->automata_evicted))
                return V_NONE;
        }
        return verdict;
    }
    __device__ int32_t entries() const { return a.s->c.capacity; }
    /* The channel's live sequences, waiting or running. */
    __device__ uint32_t look(int32_t e, uint64_t request_id) const {
        const int32_t status = a.s->seqs[e].status;
        const bool same = (status == DPUF_SEQ_WAITING || status == DPUF_SEQ_RUNNING) && a.entries[e].channel == c &&
                          a.entries[e].request_id == request_id;
        return same ? LOOK_SAME_ID | LOOK_TARGET : 0u;
    }
    /* A waiting sequence in sched_core: past max_sequences no room (bad), a
     * prompt the context cannot hold refused. */
    __device__ int32_t place(const uint32_t *wd, int32_t) const {
        if (threadIdx.x == 0) {
            const int32_t e = dpuf_sched_add(a.s, (int64_t)req_u64(wd, REQ_ID), (int32_t)wd[REQ_PROMPT_LEN],
                                             wd[REQ_MAX_TOKENS], (int32_t)c);
            sm.added = e >= 0 ? e : e == DPUF_SCHED_BAD_PROMPT ? INTAKE_REFUSED : INTAKE_NO_ROOM;
            if (e >= 0) a.entries[e].automaton = -1;
        }
        __syncthreads();
        return sm.added;
    }
    __device__ uint32_t *prompt(int32_t e) const { return a.prompts + (uint64_t)e * a.prompt_stride; }
    __device__ bool generate(int32_t e, const uint32_t *wd) const {
        bool bad_ids = false; /* an id the vocabulary does not have */
        if (e >= 0) {
            const uint32_t *ids = prompt(e);
            const uint32_t len = wd[REQ_PROMPT_LEN];
            for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) bad_ids |= ids[i] >= a.vocab;
            bad_ids = __syncthreads_or(bad_ids);
        }
        const bool constrained = (wd[REQ_FLAGS] & DPUF_FLAG_CONSTRAINED) != 0;
        const bool bad_automaton = e >= 0 && !bad_ids && constrained && !take_automaton(wd);
        if (threadIdx.x != 0) return false;
        bool refused = e < 0 || bad_ids || bad_automaton;
        if (!refused) {
            fill_entry(a, e, c, wd);
            entry_info *en = a.entries + e;
            en->automaton = constrained ? sm.automaton : -1;
            if (constrained && !ends_at(en, a.automata.slots[sm.automaton].eos)) {
                retire(a, e); /* its automaton's user counted off */
                refused = true;
            }
        } else if (e >= 0) {
            dpuf_sched_finish(a.s, e);
        }
        if (refused) { /* a prompt or automaton the model cannot take: the request fails alone */
            const uint32_t flags = (wd[REQ_FLAGS] & DPUF_FLAG_LOGPROBS) ? DPUF_WRITER_LOGPROBS : 0u;
            queue_final(a, -1, c, req_u64(wd, REQ_ID), DPUF_FINISH_ERROR, flags);
            a.stats->refused++;
            return false;
        }
        return true;
    }
    /* All threads: a constrained GENERATE's automaton (sm.automaton), copied out
     * of the arena and checked if the pool did not hold it. False: it fails a
     * check (counted bad; its place freed). */
    __device__ bool take_automaton(const uint32_t *wd) const {
        if (threadIdx.x == 0) {
            const automaton_taken taken = automata_take(a.automata, automaton_at(a.region, a.channels + c, wd),
                                                        wd[REQ_AUTOMATON], a.ctl->passes);
            sm.automaton = taken.slot;
            sm.auto_fresh = taken.fresh;
            sm.auto_bad = taken.bad;
            sm.auto_dense = 0;
        }
        __syncthreads();
        bool bad = sm.auto_bad != 0;
        if (!bad && sm.auto_fresh)
            bad = automaton_copy_faulty(a.automata, a.automata.slots[sm.automaton],
                                        automaton_at(a.region, a.channels + c, wd), &sm.auto_dense);
        if (threadIdx.x == 0 && bad) {
            if (sm.automaton >= 0) a.automata.slots[sm.automaton].live = 0; /* its only user */
            sm.automaton = -1;
            a.stats->automata_refused++;
            a.chan[c].counters[CNT_BAD]++;
        } else if (threadIdx.x == 0 && sm.auto_fresh) {
            a.stats->automata_copied++;
        }
        __syncthreads();
        return !bad;
    }
    /* Thread 0: the automaton's end token `eos` ends the sequence with STOP
     * whatever ignore_eos says (protocol 5.4): an EOS of the model's is no
     * longer ignored, another joins the stop ids. False: no room for it there. */
    __device__ bool ends_at(entry_info *en, uint32_t eos) const {
        for (uint32_t i = 0; i < a.eos_count; i++)
            if (a.eos[i] == eos) {
                en->flags &= ~DPUF_WRITER_IGNORE_EOS;
                return true;
            }
        for (uint32_t i = 0; i < en->n_stop; i++)
            if (en->stop[i] == eos) return true;
        if (en->n_stop >= DPUF_MAX_STOP_TOKEN_IDS) return false;
        en->stop[en->n_stop++] = eos;
        return true;
    }
    __device__ void cancel(int32_t e, const uint32_t *wd) const {
        queue_final(a, a.s->seqs[e].slot, c, req_u64(wd, REQ_ID), DPUF_FINISH_CANCELLED, a.entries[e].flags);
        retire(a, e);
    }
};

/* Take in every committed record of attached channel c, all threads. */
__device__ void intake(const sched_args &a, uint32_t c, sched_smem &sm) {
    intake_walk(a.region, a.channels + c, a.chan + c, UINT64_MAX, sm.ring, sched_intake{a, c, sm});
}

/* ---- E. the step's inputs -------------------------------------------------- */

/* Admitted sequences: their prompt into the token buffer, the penalties'
 * state, and the writer's arm. */
__device__ void load_admitted(const sched_args &a) {
    const dpuf_sched *s = a.s;
    for (int32_t k = 0; k < s->n_admitted; k++) {
        const int32_t e = s->admitted[k];
        const dpuf_sched_seq *q = s->seqs + e;
        const entry_info *en = a.entries + e;
        const uint32_t *src = a.prompts + (uint64_t)e * a.prompt_stride;
        int64_t *row = a.tokens + (uint64_t)q->slot * a.tokens_stride;
        for (int32_t i = threadIdx.x; i < q->prompt_len; i += blockDim.x) row[i] = src[i];
        if (en->penalized) {
            /* Only a penalized row reads these: any other row's draw is the
             * same whatever they hold (its penalties are neutral bit for bit). */
            int32_t *counts = a.counts + (uint64_t)q->slot * a.vocab_rows;
            uint8_t *seen = a.in_prompt + (uint64_t)q->slot * a.vocab_rows;
            for (uint64_t v = threadIdx.x; v < a.vocab_rows; v += blockDim.x) {
                counts[v] = 0;
                seen[v] = 0;
            }
            __syncthreads();
            for (int32_t i = threadIdx.x; i < q->prompt_len; i += blockDim.x) seen[src[i]] = 1;
        }
        if (threadIdx.x == 0) {
            int64_t *op = a.arms + (uint64_t)a.ctl->n_arms++ * DPUF_WRITER_ARM_WORDS;
            op[0] = q->slot;
            op[1] = en->channel;
            op[2] = (int64_t)en->request_id;
            op[3] = q->limit;
            op[4] = en->flags;
            op[5] = en->top;
            op[6] = en->n_stop;
            op[7] = 0;
            for (uint32_t i = 0; i < DPUF_MAX_STOP_TOKEN_IDS; i++) op[8 + i] = en->stop[i];
            if (a.automata.pool_words) {
                /* The slot's automaton for the sampler's mask and state step
                 * (DeviceAutomata's meta row), walked from its start. */
                int64_t *meta = a.ameta + (uint64_t)q->slot * 6u;
                if (en->automaton >= 0) {
                    const automaton_slot &t = a.automata.slots[en->automaton];
                    meta[0] = (int64_t)t.base;
                    meta[1] = t.states;
                    meta[2] = t.list_len;
                    meta[3] = a.vocab;
                    meta[4] = t.eos;
                    meta[5] = 1;
                    a.astate[q->slot] = 0;
                    a.stats->constrained++;
                } else {
                    meta[5] = 0;
                }
            }
        }
        __syncthreads();
    }
}

/* All threads: the sampler's rows and the writer's, row k for the k-th sampling
 * work (the step's layout, sm.at); padding rows up to the graph's draw nothing
 * that counts (slot max_seqs is the token buffer's padding row). Returns the
 * sampler variant, the same in every thread. */
__device__ int32_t build_rows(const sched_args &a, int32_t graph, const sched_smem &sm) {
    const dpuf_sched *s = a.s;
    /* Locals, not fields of *args: a store through one of these pointers would
     * otherwise make the compiler reload every field after it. */
    int64_t *const row_slot = a.row_slot, *const row_pos = a.row_pos, *const row_ints = a.row_ints;
    float *const row_floats = a.row_floats;
    int64_t *const rows = a.rows;
    int32_t *const row_entry = a.row_entry;
    const entry_info *const entries = a.entries;
    const dpuf_sched_work *const works = s->works;
    const dpuf_sched_seq *const seqs = s->seqs;
    const uint32_t stride = a.rows_stride;
    const int32_t n = s->n_works, padded = a.samples[graph], pad_slot = s->c.max_seqs;
    bool greedy = true, penalty = false, cut = false, logprobs = false, constrained = false;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const dpuf_sched_work w = works[i];
        if (!w.sample) continue;
        const int32_t k = sm.at[i].sample;
        const dpuf_sched_seq q = seqs[w.seq];
        const entry_info *en = entries + w.seq;
        const int32_t total = q.prompt_len + q.generated; /* before this step's token */
        row_slot[k] = q.slot;
        row_pos[k] = total;
        for (int j = 0; j < 6; j++) row_floats[j * stride + k] = en->f[j];
        row_ints[k] = en->top_k;
        row_ints[stride + k] = (int64_t)en->seed;
        row_ints[2 * stride + k] = q.generated;
        rows[2 * k] = q.slot;
        rows[2 * k + 1] = total + 1;
        row_entry[k] = w.seq;
        greedy &= DPUF_ROW_GREEDY(en->f[0]);
        penalty |= en->penalized != 0;
        cut |= DPUF_ROW_CUT(en->top_k, en->f[1], en->f[2]);
        logprobs |= (en->flags & DPUF_WRITER_LOGPROBS) != 0;
        constrained |= en->automaton >= 0;
    }
    const float neutral[6] = {0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 1.0f};
    for (int32_t r = sm.total.sample + threadIdx.x; r < padded; r += blockDim.x) {
        row_slot[r] = pad_slot;
        row_pos[r] = 0;
        for (int j = 0; j < 6; j++) row_floats[j * stride + r] = neutral[j];
        row_ints[r] = row_ints[stride + r] = row_ints[2 * stride + r] = 0;
    }
    greedy = __syncthreads_and(greedy);
    penalty = __syncthreads_or(penalty);
    cut = __syncthreads_or(cut);
    logprobs = __syncthreads_or(logprobs);
    constrained = __syncthreads_or(constrained);
    return DPUF_SAMPLER_VARIANT(greedy, penalty, cut, logprobs, constrained);
}

/* All threads: the step ran (it will have, by the time anyone reads them).
 * sched_core's per-work commit, the works strided over the threads, and the
 * KV positions they read into sm.context (zeroed at the schedule): one shared
 * atomic per thread that had works, where a reduction would add barriers. */
__device__ void commit(const sched_args &a, sched_smem &sm) {
    dpuf_sched *s = a.s;
    const int32_t n = s->n_works;
    uint64_t context = 0;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) context += dpuf_sched_commit_work(s, i);
    if (context) atomicAdd(&sm.context, (unsigned long long)context);
    __syncthreads();
}

/* All threads: graph g's static inputs, sched_core's per-work fill strided over
 * the threads, from the step's layout (sm.at, counted at the schedule). */
__device__ void fill_inputs(const sched_args &a, int32_t g, const sched_smem &sm) {
    const dpuf_sched *s = a.s;
    const dpuf_sched_graph *gr = s->graphs + g;
    const dpuf_sched_fields f = dpuf_sched_fields_of(s, gr);
    for (int32_t i = threadIdx.x; i < s->n_works; i += blockDim.x) dpuf_sched_fill_work(s, gr, &f, i, sm.at[i]);
    dpuf_sched_fill_padding(s, gr, &f, sm.total, (int32_t)threadIdx.x, (int32_t)blockDim.x);
    __syncthreads();
}

/* All threads: the next step's batch (sched_core.h's dpuf_sched_schedule), its
 * part 1 spread over the block where the step preempts nothing and every ring
 * has room for its decodes: thread t takes the running list's indices
 * [t * SCHED_PER_THREAD, ...) in order, and a block scan of the decodes and
 * blocks before each gives its first work and block. dpuf_sched_schedule_spread
 * is the same in loops, which CI holds to the Python scheduler. Thread 0 runs
 * what stays serial: the check, the serial part 1 where the check fails, the
 * prefill chunks and admission. s->credits are set before. */
__device__ void schedule(const sched_args &a, sched_smem &sm) {
    dpuf_sched *s = a.s;
    const int32_t tid = (int32_t)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) sm.budget = dpuf_sched_begin(s);
    for (int32_t c = tid; c < DPUF_SCHED_MAX_CHANNELS; c += (int32_t)blockDim.x) sm.counts[c] = 0;
    __syncthreads();
    const int32_t n = s->n_running;
    const int32_t first = tid * SCHED_PER_THREAD;
    const int32_t last = first + SCHED_PER_THREAD < n ? first + SCHED_PER_THREAD : n;
    int32_t decodes = 0, blocks = 0;
    for (int32_t i = first; i < last; i++) {
        const dpuf_sched_need need = dpuf_sched_decode_need(s, i);
        sm.need[i] = need;
        if (need.decode && need.channel >= 0) atomicAdd(&sm.counts[need.channel], 1);
        decodes += need.decode;
        blocks += need.blocks;
    }
    /* Inclusive sums over the warp's lanes, then each warp's total. */
    int32_t work = decodes, block = blocks;
    for (int d = 1; d < 32; d <<= 1) {
        const int32_t w = __shfl_up_sync(0xffffffffu, work, d);
        const int32_t b = __shfl_up_sync(0xffffffffu, block, d);
        if (lane >= d) {
            work += w;
            block += b;
        }
    }
    if (lane == 31) {
        sm.warp_sums[0][warp] = work;
        sm.warp_sums[1][warp] = block;
    }
    __syncthreads();
    if (tid == 0) {
        int32_t w = 0, b = 0;
        for (int k = 0; k < SCHED_THREADS / 32; k++) {
            const int32_t dw = sm.warp_sums[0][k], db = sm.warp_sums[1][k];
            sm.warp_sums[0][k] = w; /* the warps' before warp k */
            sm.warp_sums[1][k] = b;
            w += dw;
            b += db;
        }
        sm.decodes = w;
        sm.blocks = b;
        sm.spread = dpuf_sched_decode_fits(s, sm.budget, w, b, sm.counts);
    }
    __syncthreads();
    if (sm.spread) {
        /* This thread's first work and block: the warps' before it, the lanes' before it. */
        work += sm.warp_sums[0][warp] - decodes;
        block += sm.warp_sums[1][warp] - blocks;
        for (int32_t i = first; i < last; i++) {
            const dpuf_sched_need need = sm.need[i];
            dpuf_sched_decode_take(s, i, need, work, block);
            work += need.decode;
            block += need.blocks;
        }
    }
    __syncthreads();
    if (tid == 0) {
        int32_t budget = sm.budget;
        if (sm.spread) {
            budget = dpuf_sched_decode_commit(s, budget, sm.decodes, sm.blocks, sm.counts);
            budget = dpuf_sched_prefills(s, budget, sm.need);
        } else {
            budget = dpuf_sched_decodes(s, budget);
            budget = dpuf_sched_prefills(s, budget, 0);
        }
        dpuf_sched_admit(s, budget);
    }
    __syncthreads();
}

/* ---- the kernel ------------------------------------------------------------ */

/* Thread 0: the time since the last lap into phase `ph` of this pass; every
 * thread leaves past a barrier. A pass that launches a step adds its phases
 * to the stats; an idle poll's count as idle. */
__device__ void lap(sched_smem &sm, int ph) {
    if (threadIdx.x == 0) {
        const uint64_t now = global_timer_ns();
        sm.ph[ph] += now - sm.t;
        sm.t = now;
    }
    __syncthreads();
}

/* Thread 0: counters into the mailboxes and the stats mirror (plain stores
 * into mapped host memory, never atomics). */
__device__ void mirror(const sched_args &a) {
    for (uint32_t c = 0; c < a.channel_count; c++) {
        dpuf_mailbox *mb = a.mailboxes + c;
        const chan_state *st = a.chan + c;
        const dpuf_writer_channel *w = a.wstate + c;
        store_vol_u64(&mb->records, st->counters[CNT_RECORDS]);
        store_vol_u64(&mb->admitted, st->counters[CNT_ADMITTED]);
        store_vol_u64(&mb->completed, w->completed);
        store_vol_u64(&mb->cancelled, w->cancelled);
        store_vol_u64(&mb->bad_records, st->counters[CNT_BAD]);
        store_vol_u64(&mb->tokens, w->tokens);
        store_vol_u64(&mb->published, w->published);
        store_vol_u64(&mb->ring_full_waits, st->counters[CNT_RING_FULL]);
    }
    dpuf_model_stats *st = a.stats;
    st->running = (uint64_t)a.s->n_running;
    st->waiting = (uint64_t)a.s->wait_count;
    st->free_blocks = (uint64_t)a.s->pool_free;
    st->preemptions = (uint64_t)a.s->preemptions;
    volatile uint64_t *dst = (volatile uint64_t *)a.stats_mirror;
    const uint64_t *src = (const uint64_t *)st;
    for (uint32_t i = 0; i < sizeof(dpuf_model_stats) / 8; i++) dst[i] = src[i];
}

__global__ void __launch_bounds__(SCHED_THREADS, 1) scheduler_kernel(const sched_args *args) {
    __shared__ writer_smem wsm;
    __shared__ sched_smem sm;
    const sched_args &a = *args;
    dpuf_sched *s = a.s;
    if (threadIdx.x == 0 && !a.ctl->started) {
        a.ctl->started = 1;
        dpuf_store_release_sys(&a.kblock->state, DPUF_KERNEL_RUNNING);
    }
    if (threadIdx.x == 0) {
        sm.t = global_timer_ns();
        sm.ph[PH_PUBLISH] = sm.ph[PH_INTAKE] = sm.ph[PH_SCHEDULE] = 0;
        /* The step graphs ran between the last run's launch and now. */
        if (a.ctl->launched_at) a.stats->ns_step += sm.t - a.ctl->launched_at;
        a.ctl->launched_at = 0;
    }
    for (;;) {
        /* A. the last step's records; its finished sequences retire. */
        publish(a, wsm);
        lap(sm, PH_PUBLISH);
        if (threadIdx.x == 0) sm.stop = dpuf_load_acquire_sys(&a.kblock->stop) != 0 || a.stats->error != 0;
        __syncthreads();
        if (sm.stop) break;
        /* B, C. */
        if (threadIdx.x == 0) a.ctl->passes++;
        for (uint32_t c = 0; c < a.channel_count; c++) run_mailbox(a, c, sm);
        for (uint32_t c = 0; c < a.channel_count; c++)
            if (a.chan[c].attached) intake(a, c, sm);
        lap(sm, PH_INTAKE);
        /* D. */
        if (threadIdx.x == 0) {
            for (uint32_t c = 0; c < a.channel_count; c++) {
                const int64_t room = ring_room(a, c);
                s->credits[c] = a.chan[c].attached ? (room > 0 ? room : 0) : 0;
            }
        }
        schedule(a, sm);
        if (threadIdx.x == 0) {
            if (s->held) {
                a.stats->held++;
                for (uint32_t c = 0; c < a.channel_count; c++)
                    if (s->held >> c & 1u) a.chan[c].counters[CNT_RING_FULL]++;
            }
            sm.total = dpuf_sched_layout(s, sm.at);
            sm.context = 0;
            sm.graph = s->n_works ? dpuf_sched_graph_for(s, sm.total) : -1;
            if (s->n_works && sm.graph < 0) a.stats->error = DPUF_MODEL_ERR_NO_GRAPH;
        }
        lap(sm, PH_SCHEDULE);
        const int32_t g = sm.graph;
        if (g < 0) {
            /* Nothing to run: publish what intake queued, or poll again. */
            if (threadIdx.x == 0) {
                mirror(a);
                sm.go = a.ctl->n_finals == 0 && a.stats->error == 0;
                if (sm.go) {
                    a.stats->idle_polls++;
                    __nanosleep((unsigned)a.idle_ns);
                }
                const uint64_t now = global_timer_ns();
                const uint64_t idle = now - sm.t + sm.ph[PH_PUBLISH] + sm.ph[PH_INTAKE] + sm.ph[PH_SCHEDULE];
                a.stats->ns_idle += idle;
                if (s->wait_count > 0) a.stats->ns_idle_waiting += idle;
                sm.ph[PH_PUBLISH] = sm.ph[PH_INTAKE] = sm.ph[PH_SCHEDULE] = 0;
                sm.t = now;
            }
            __syncthreads();
            continue;
        }
        /* E. */
        load_admitted(a);
        fill_inputs(a, g, sm);
        const int32_t v = build_rows(a, g, sm);
        commit(a, sm);
        if (threadIdx.x == 0) {
            a.ctl->n_rows = (uint32_t)sm.total.sample;
            dpuf_model_stats *st = a.stats;
            st->steps++;
            st->spread_schedules += (uint64_t)(sm.spread && sm.decodes > 0);
            st->tokens += (uint64_t)sm.total.row;
            st->sampled += (uint64_t)sm.total.sample;
            st->context_tokens += (uint64_t)sm.context;
            st->admitted += (uint64_t)s->n_admitted;
            st->sum_running += (uint64_t)s->n_running;
            st->sum_waiting += (uint64_t)s->wait_count;
            st->variants[v]++;
            mirror(a);
            store_vol_u64(&a.kblock->steps, st->steps);
            const uint64_t now = global_timer_ns();
            st->ns_prepare += now - sm.t;
            st->ns_publish += sm.ph[PH_PUBLISH];
            st->ns_intake += sm.ph[PH_INTAKE];
            st->ns_schedule += sm.ph[PH_SCHEDULE];
            a.ctl->launched_at = now;
            /* F. The step, its sampler, this scheduler again: one after the
             * other (a graph's tail launches run in the order enqueued). */
            cudaError_t e = cudaGraphLaunch(a.forward[g], cudaStreamGraphTailLaunch);
            if (e == cudaSuccess) e = cudaGraphLaunch(a.sampler[g][v], cudaStreamGraphTailLaunch);
            if (e == cudaSuccess) e = cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
            if (e != cudaSuccess) {
                st->error = DPUF_MODEL_ERR_LAUNCH;
                mirror(a);
                dpuf_store_release_sys(&a.kblock->state, DPUF_KERNEL_FAILED);
            }
        }
        return;
    }
    if (threadIdx.x == 0) {
        mirror(a);
        dpuf_store_release_sys(&a.kblock->state, a.stats->error ? DPUF_KERNEL_FAILED : DPUF_KERNEL_STOPPED);
    }
}

/* One thread: the core's state laid out in its arena. */
__global__ void init_kernel(dpuf_sched *s, dpuf_sched_config c, uint8_t *arena) { dpuf_sched_init(s, &c, arena); }

/* ======================================================================== */
/* Host API                                                                 */
/* ======================================================================== */

struct dpuf_model {
    int device;
    sched_args args; /* host copy, pushed to d_args at launch */
    sched_args *d_args;
    dpuf_region region; /* the shm mapping, or GPU memory for a NIC (cuda_driver.cuh) */
    uint32_t channel_count;
    dpuf_sched_config config;
    void *mbx_host; /* kernel block + mailboxes, pinned and mapped */
    dpuf_model_stats *stats_host;
    dpuf_writer_channel *wmirror_host;
    void *allocs[16];
    int n_allocs;
    cudaGraphExec_t execs[DPUF_SCHED_MAX_GRAPHS * (DPUF_MODEL_VARIANTS + 1) + 1];
    int n_execs;
    cudaGraph_t sched_graph;
    cudaStream_t stream, hb_stream;
    heartbeat_args hargs;
    bool launched;
};

template <typename T> static int device_alloc(dpuf_model *m, T **p, size_t bytes) {
    DPUF_CHECK(cudaMalloc((void **)p, bytes ? bytes : 8));
    DPUF_CHECK(cudaMemset(*p, 0, bytes ? bytes : 8));
    m->allocs[m->n_allocs++] = *p;
    return 0;
}

static void model_release(dpuf_model *m) {
    for (int i = 0; i < m->n_execs; i++) DPUF_NOTE(cudaGraphExecDestroy(m->execs[i]));
    if (m->sched_graph) DPUF_NOTE(cudaGraphDestroy(m->sched_graph));
    for (int i = 0; i < m->n_allocs; i++) DPUF_NOTE(cudaFree(m->allocs[i]));
    if (m->mbx_host) DPUF_NOTE(cudaFreeHost(m->mbx_host));
    if (m->stats_host) DPUF_NOTE(cudaFreeHost(m->stats_host));
    if (m->wmirror_host) DPUF_NOTE(cudaFreeHost(m->wmirror_host));
    if (m->stream) DPUF_NOTE(cudaStreamDestroy(m->stream));
    if (m->hb_stream) DPUF_NOTE(cudaStreamDestroy(m->hb_stream));
    region_release(&m->region);
    free(m);
}

static bool validate(const dpuf_model_params *p) {
    if (p == NULL || p->channels == NULL) return set_error("no channel table"), false;
    if (p->region_size == 0) return set_error("region_size is 0"), false;
    if (p->channel_count == 0 || p->channel_count > DPUF_SCHED_MAX_CHANNELS)
        return set_error("channel_count %u is not in [1, %u]", p->channel_count, DPUF_SCHED_MAX_CHANNELS), false;
    if (p->eos_count > DPUF_MODEL_MAX_EOS) return set_error("more than %u EOS ids", DPUF_MODEL_MAX_EOS), false;
    const dpuf_sched_config *c = &p->sched;
    if (c->max_seqs < 1 || c->max_seqs > SCHED_MAX_SEQS || c->capacity < 1 || c->num_blocks < 1 ||
        c->block_size < 1 || c->max_batched_tokens < 1 || c->max_model_len < 2 || c->per_tile < 1)
        return set_error("scheduler sizes out of range (max_seqs 1..%d)", SCHED_MAX_SEQS), false;
    if (p->tokens == NULL || p->counts == NULL || p->in_prompt == NULL || p->row_slot == NULL || p->row_pos == NULL ||
        p->row_floats == NULL || p->row_ints == NULL || p->out_tokens == NULL || p->out_logprob == NULL ||
        p->out_top_ids == NULL || p->out_top_logprobs == NULL)
        return set_error("a runner or sampler buffer is missing"), false;
    if (p->rows_stride < (uint32_t)c->max_seqs || p->vocab == 0 || p->vocab > p->vocab_rows)
        return set_error("rows_stride below max_seqs, or vocab outside (0, vocab_rows]"), false;
    if (p->automata != NULL && p->automata_words != 0 && (p->automaton_meta == NULL || p->automaton_state == NULL))
        return set_error("an automata pool without its per-slot meta and state"), false;
    for (uint32_t i = 0; i < p->channel_count; i++)
        if ((p->channels[i].features & DPUF_FEATURE_CONSTRAINTS) &&
            (p->automata == NULL || p->channels[i].max_automaton_bytes > 4 * p->automata_words))
            return set_error("channel %u takes automata of %u bytes; the pool holds %llu", i,
                             p->channels[i].max_automaton_bytes, (unsigned long long)(4 * p->automata_words)),
                   false;
    for (uint32_t i = 0; i < p->channel_count; i++) {
        const dpuf_channel_desc *d = p->channels + i;
        if (d->resp_slot_size < DPUF_MIN_RESPONSE_SLOT_SIZE || d->resp_ring_offset > p->region_size ||
            (uint64_t)d->resp_slots * d->resp_slot_size > p->region_size - d->resp_ring_offset ||
            d->req_ring_offset > p->region_size ||
            (uint64_t)d->req_slots * d->req_slot_size > p->region_size - d->req_ring_offset ||
            d->arena_offset > p->region_size || d->arena_size > p->region_size - d->arena_offset ||
            d->gpu_ctrl_offset + DPUF_CTRL_SIZE > p->region_size || d->dpu_ctrl_offset + DPUF_CTRL_SIZE > p->region_size)
            return set_error("channel %u does not fit the %llu-byte region", i, (unsigned long long)p->region_size),
                   false;
    }
    return true;
}

static int model_setup(dpuf_model *m, const dpuf_model_params *p) {
    DPUF_CHECK(cudaSetDevice(p->device));
    DPUF_CHECK(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
    DPUF_CHECK(cudaStreamCreateWithFlags(&m->hb_stream, cudaStreamNonBlocking));
    if (region_open(&m->region, p->device, p->region_host, p->region_size) != 0) return -1;
    sched_args *a = &m->args;
    void *dev = NULL;
    a->region = m->region.dev;
    const dpuf_sched_config *c = &p->sched;
    const uint32_t n = p->channel_count;
    dpuf_channel_desc *channels = NULL;
    if (device_alloc(m, &channels, sizeof(dpuf_channel_desc) * n)) return -1;
    DPUF_CHECK(cudaMemcpy(channels, p->channels, sizeof(dpuf_channel_desc) * n, cudaMemcpyHostToDevice));
    a->channels = channels;
    a->channel_count = n;
    a->vocab = p->vocab;
    uint64_t finals = 0;
    for (uint32_t i = 0; i < n; i++) finals += p->channels[i].resp_slots;
    a->max_finals = (uint32_t)finals;
    a->prompt_stride = ((uint64_t)c->max_model_len + 31u) / 32u * 32u;
    uint8_t *arena = NULL;
    if (device_alloc(m, &a->chan, sizeof(chan_state) * n) || device_alloc(m, &a->ctl, sizeof(sched_ctl)) ||
        device_alloc(m, &a->s, sizeof(dpuf_sched)) || device_alloc(m, &arena, dpuf_sched_arena_bytes(c)) ||
        device_alloc(m, &a->entries, sizeof(entry_info) * c->capacity) ||
        device_alloc(m, &a->prompts, 4 * a->prompt_stride * c->capacity) ||
        device_alloc(m, &a->row_entry, 4 * (size_t)c->max_seqs) ||
        device_alloc(m, &a->finals, 8 * DPUF_WRITER_FINAL_WORDS * finals) ||
        device_alloc(m, &a->arms, 8 * DPUF_WRITER_ARM_WORDS * (size_t)c->max_seqs) ||
        device_alloc(m, &a->rows, 8 * DPUF_WRITER_ROW_WORDS * (size_t)c->max_seqs) ||
        device_alloc(m, &a->wstate, sizeof(dpuf_writer_channel) * n) ||
        device_alloc(m, &a->wslots, sizeof(writer_slot) * c->max_seqs) ||
        device_alloc(m, &a->stats, sizeof(dpuf_model_stats)) || device_alloc(m, &m->d_args, sizeof(sched_args)) ||
        device_alloc(m, &a->automata.slots, sizeof(automaton_slot) * DPUF_MODEL_MAX_AUTOMATA))
        return -1;
    DPUF_CHECK(mailbox_area_alloc(n, &m->mbx_host, &dev));
    a->kblock = (dpuf_kernel_block *)dev;
    a->mailboxes = (dpuf_mailbox *)((uint8_t *)dev + DPUF_KERNEL_BLOCK_SIZE);
    DPUF_CHECK(cudaHostAlloc((void **)&m->stats_host, sizeof(dpuf_model_stats), cudaHostAllocMapped | cudaHostAllocPortable));
    memset(m->stats_host, 0, sizeof(dpuf_model_stats));
    DPUF_CHECK(cudaHostAlloc((void **)&m->wmirror_host, sizeof(dpuf_writer_channel) * n,
                             cudaHostAllocMapped | cudaHostAllocPortable));
    memset(m->wmirror_host, 0, sizeof(dpuf_writer_channel) * n);
    DPUF_CHECK(cudaHostGetDevicePointer(&dev, m->stats_host, 0));
    a->stats_mirror = (dpuf_model_stats *)dev;
    DPUF_CHECK(cudaHostGetDevicePointer(&dev, m->wmirror_host, 0));
    a->wmirror = (dpuf_writer_channel *)dev;
    a->tokens = p->tokens;
    a->tokens_stride = (uint64_t)c->max_model_len;
    a->counts = p->counts;
    a->in_prompt = p->in_prompt;
    a->vocab_rows = p->vocab_rows;
    a->row_slot = p->row_slot;
    a->row_pos = p->row_pos;
    a->row_floats = p->row_floats;
    a->row_ints = p->row_ints;
    a->rows_stride = p->rows_stride;
    a->out_tokens = p->out_tokens;
    a->out_logprob = p->out_logprob;
    a->out_top_ids = p->out_top_ids;
    a->out_top_logprobs = p->out_top_logprobs;
    a->automata.n_slots = DPUF_MODEL_MAX_AUTOMATA;
    a->automata.vocab = p->vocab;
    a->automata.words = p->automata;
    a->automata.pool_words = p->automata ? p->automata_words : 0;
    a->automata.distances = false; /* the sampler masks by the automaton: no walk of its own */
    a->ameta = p->automaton_meta;
    a->astate = p->automaton_state;
    memcpy(a->eos, p->eos, sizeof a->eos);
    a->eos_count = p->eos_count;
    a->idle_ns = p->idle_ns ? p->idle_ns : 2000u;
    /* device_alloc zeroes on the legacy stream, which m->stream (non-blocking) does
     * not wait for: a late memset would overwrite what init_kernel lays out. */
    DPUF_CHECK(cudaDeviceSynchronize());
    init_kernel<<<1, 1, 0, m->stream>>>(a->s, *c, arena);
    DPUF_CHECK(cudaGetLastError());
    DPUF_CHECK(cudaStreamSynchronize(m->stream));
    m->hargs.region = a->region;
    m->hargs.channels = a->channels;
    m->hargs.channel_count = n;
    m->hargs.kblock = a->kblock;
    m->hargs.heartbeat_ns = p->heartbeat_ns ? p->heartbeat_ns : 100000u;
    return 0;
}

/* Instantiate `graph` for device launch and upload it. */
static int device_exec(dpuf_model *m, cudaGraph_t graph, cudaGraphExec_t *out) {
    cudaGraphInstantiateParams ip = {};
    ip.flags = cudaGraphInstantiateFlagDeviceLaunch;
    const cudaError_t e = cudaGraphInstantiateWithParams(out, graph, &ip);
    if (e != cudaSuccess) {
        cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
        if (ip.errNode_out) cudaGraphNodeGetType(ip.errNode_out, &type);
        set_error("a graph cannot be launched from the GPU: %s (instantiate result %d, node type %d)",
                  cudaGetErrorString(e), (int)ip.result_out, (int)type);
        return -1;
    }
    m->execs[m->n_execs++] = *out;
    DPUF_CHECK(cudaGraphUpload(*out, m->stream));
    return 0;
}

extern "C" {

const char *dpuf_model_last_error(void) { return g_last_error; }

int dpuf_model_device_info_get(int32_t device, dpuf_device_info *out) { return device_info_get(device, out); }

dpuf_model *dpuf_model_create(const dpuf_model_params *p) {
    if (!validate(p)) return nullptr;
    dpuf_model *m = (dpuf_model *)calloc(1, sizeof *m);
    if (!m) return set_error("out of host memory"), nullptr;
    m->device = p->device;
    m->channel_count = p->channel_count;
    m->config = p->sched;
    if (model_setup(m, p) != 0) {
        model_release(m);
        return nullptr;
    }
    return m;
}

int dpuf_model_add_graph(dpuf_model *m, int32_t tokens, int32_t seqs, int32_t tiles, int32_t samples, void *inputs,
                         uint64_t forward, const uint64_t *samplers) {
    sched_args *a = &m->args;
    if (m->launched) return set_error("graphs are added before the launch"), -1;
    if (a->n_graphs == DPUF_SCHED_MAX_GRAPHS) return set_error("more than %d graphs", DPUF_SCHED_MAX_GRAPHS), -1;
    const int32_t rows = samples < 0 ? tokens : samples;
    if (rows > (int32_t)m->config.max_seqs || tokens < 1 || seqs < 1 || tiles < 1 || inputs == NULL)
        return set_error("a graph of %d rows does not fit %d sampler rows", rows, m->config.max_seqs), -1;
    DPUF_CHECK(cudaSetDevice(m->device));
    const int32_t g = a->n_graphs;
    if (device_exec(m, (cudaGraph_t)(uintptr_t)forward, &a->forward[g])) return -1;
    for (uint32_t v = 0; v < DPUF_MODEL_VARIANTS; v++)
        if (device_exec(m, (cudaGraph_t)(uintptr_t)samplers[v], &a->sampler[g][v])) return -1;
    a->samples[g] = rows;
    dpuf_sched_graph gr = {tokens, seqs, tiles, samples, (uint8_t *)inputs};
    DPUF_CHECK(cudaMemcpy(&a->s->graphs[g], &gr, sizeof gr, cudaMemcpyHostToDevice));
    a->n_graphs = g + 1;
    DPUF_CHECK(cudaMemcpy(&a->s->n_graphs, &a->n_graphs, sizeof a->n_graphs, cudaMemcpyHostToDevice));
    return 0;
}

int dpuf_model_write_region(dpuf_model *m, uint64_t offset, const void *data, uint64_t n) {
    if (m == NULL || (data == NULL && n != 0)) return set_error("model or data is NULL"), -1;
    DPUF_CHECK(cudaSetDevice(m->device));
    return region_write(&m->region, offset, data, n);
}

uint64_t dpuf_model_region_device_ptr(dpuf_model *m) {
    if (m == NULL) return set_error("model is NULL"), 0;
    return (uint64_t)(uintptr_t)m->region.dev;
}

int dpuf_model_dmabuf_fd(dpuf_model *m, int32_t *fd, uint64_t *offset) {
    if (m == NULL || fd == NULL || offset == NULL) return set_error("model, fd or offset is NULL"), -1;
    DPUF_CHECK(cudaSetDevice(m->device));
    return region_dmabuf_fd(&m->region, fd, offset);
}

void *dpuf_model_mailbox(dpuf_model *m) { return m->mbx_host; }
const dpuf_model_stats *dpuf_model_stats_mirror(dpuf_model *m) { return m->stats_host; }
const dpuf_writer_channel *dpuf_model_writer_mirror(dpuf_model *m) { return m->wmirror_host; }

int dpuf_model_launch(dpuf_model *m) {
    if (m->launched) return set_error("the scheduler was already launched"), -1;
    if (m->args.n_graphs == 0) return set_error("no step graph was added"), -1;
    DPUF_CHECK(cudaSetDevice(m->device));
    DPUF_CHECK(cudaMemcpy(m->d_args, &m->args, sizeof m->args, cudaMemcpyHostToDevice));
    /* The scheduler as a one-node graph: only a graph may launch graphs. */
    DPUF_CHECK(cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal));
    scheduler_kernel<<<1, SCHED_THREADS, 0, m->stream>>>(m->d_args);
    const cudaError_t launched = cudaGetLastError();
    const cudaError_t ended = cudaStreamEndCapture(m->stream, &m->sched_graph);
    DPUF_CHECK(launched);
    DPUF_CHECK(ended);
    cudaGraphExec_t exec;
    if (device_exec(m, m->sched_graph, &exec)) return -1;
    (void)cudaGetLastError();
    heartbeat_kernel<<<1, 32, 0, m->hb_stream>>>(m->hargs);
    DPUF_CHECK(cudaGetLastError());
    DPUF_CHECK(cudaGraphLaunch(exec, m->stream));
    m->launched = true;
    return 0;
}

static int kernels_state(dpuf_model *m) { return streams_state(m->hb_stream, m->stream); }

static uint64_t *stop_word(dpuf_model *m) { return &((dpuf_kernel_block *)m->mbx_host)->stop; }

int dpuf_model_poll(dpuf_model *m) {
    if (!m->launched) return set_error("the scheduler was not launched"), -1;
    DPUF_CHECK(cudaSetDevice(m->device));
    const int s = kernels_state(m);
    if (s == 1 && m->stats_host->error) {
        set_error("the scheduler stopped: error %llu", (unsigned long long)m->stats_host->error);
        return -1;
    }
    return s;
}

int dpuf_model_stop(dpuf_model *m, uint32_t timeout_ms) {
    if (!m->launched) return 0;
    DPUF_CHECK(cudaSetDevice(m->device));
    return stop_streams(stop_word(m), m->hb_stream, m->stream, timeout_ms);
}

void dpuf_model_destroy(dpuf_model *m) {
    if (m == NULL) return;
    DPUF_NOTE(cudaSetDevice(m->device));
    if (m->launched && !kernels_stopped(stop_word(m), m->hb_stream, m->stream)) {
        set_error("dpuf_model_destroy: the kernels did not stop; their memory is left allocated");
        free(m);
        return;
    }
    model_release(m);
}

} /* extern "C" */
