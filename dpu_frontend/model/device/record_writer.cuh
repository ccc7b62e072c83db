/*
 * record_writer.cuh: the device half of the model's record writer, shared by
 * its own kernel (record_writer.cu, one launch behind each host-driven step)
 * and the scheduler inside the GPU (scheduler.cu, which runs it between its
 * steps). record_writer.cu's head comment says the phases and the orders.
 */
#ifndef DPUF_RECORD_WRITER_CUH
#define DPUF_RECORD_WRITER_CUH

#include "record_writer.h"

#include <cuda_runtime.h>

#define WRITER_THREADS 256u

enum : uint32_t { SLOT_FREE = 0, SLOT_ACTIVE = 1, SLOT_DONE = 2 };

/* A sequence's slot: where its records go and when it ends. GPU memory. */
struct writer_slot {
    uint64_t request_id;
    uint32_t state; /* SLOT_* */
    uint32_t channel;
    uint32_t limit; /* LENGTH once prompt + output tokens reach it */
    uint32_t flags; /* DPUF_WRITER_IGNORE_EOS | DPUF_WRITER_LOGPROBS */
    uint32_t top;   /* alternatives per token, with DPUF_WRITER_LOGPROBS */
    uint32_t n_stop;
    uint32_t stop[DPUF_MAX_STOP_TOKEN_IDS];
};

struct writer_args {
    uint8_t *region;
    const dpuf_channel_desc *channels; /* device copy */
    dpuf_writer_channel *state;        /* device: the authoritative counters */
    dpuf_writer_channel *mirror;       /* pinned host memory */
    writer_slot *slots;
    uint32_t slot_count;
    uint32_t channel_count;
    uint32_t eos[DPUF_WRITER_MAX_EOS];
    uint32_t eos_count;
    const int64_t *resets, *finals, *arms, *rows; /* DPUF_WRITER_*_WORDS each */
    uint32_t n_resets, n_finals, n_arms, n_rows;
    const int64_t *tokens;
    const float *logprob;
    const int64_t *top_ids;
    const float *top_logprobs;
    uint32_t top_stride;
};

/* What one record holds (at most one token: one record per row). */
struct record {
    uint64_t request_id;
    uint32_t epoch;
    uint32_t n_tokens;
    uint32_t finish;
    uint32_t logprobs; /* DPUF_RESPONSE_LOGPROBS payload */
    uint32_t n_top;
    uint32_t token;
    float logprob;
    uint32_t top_ids[DPUF_MAX_TOP_LOGPROBS];
    float top_lps[DPUF_MAX_TOP_LOGPROBS];
};

/* The 4-byte word of a slot at byte `off` (>= 8): the header after seq, the
 * payload, zeros after it (as the Python encoder writes the whole slot). */
__device__ uint32_t body_word(const record &r, uint32_t off) {
    switch (off) {
    case 8: return (uint32_t)r.request_id;
    case 12: return (uint32_t)(r.request_id >> 32);
    case 16: return r.epoch;
    case 20: return (r.n_tokens & 0xffffu) | ((r.finish & 0xffu) << 16) | ((r.logprobs ? DPUF_RESPONSE_LOGPROBS : 0u) << 24);
    case 24: return r.logprobs ? r.n_top : 0u;
    case 28: return 0u;
    default: break;
    }
    const uint32_t p = off - DPUF_RESPONSE_HEADER_SIZE;
    if (r.n_tokens == 0) return 0u;
    if (!r.logprobs) return p == 0 ? r.token : 0u;
    if (p >= 48u) return 0u;
    const uint32_t w = p / 4u; /* dpuf_token_logprobs word */
    if (w == 0) return r.token;
    if (w == 1) return __float_as_uint(r.logprob);
    if (w < 7) return w - 2 < r.n_top ? r.top_ids[w - 2] : 0u;
    return w - 7 < r.n_top ? __float_as_uint(r.top_lps[w - 7]) : 0u;
}

__device__ bool is_stop(const writer_args &a, const writer_slot &s, uint32_t t) {
    if (!(s.flags & DPUF_WRITER_IGNORE_EOS))
        for (uint32_t i = 0; i < a.eos_count; i++)
            if (a.eos[i] == t) return true;
    for (uint32_t i = 0; i < s.n_stop; i++)
        if (s.stop[i] == t) return true;
    return false;
}

__device__ void report(const writer_args &a, uint32_t c, uint32_t error) {
    atomicCAS(&a.state[c < a.channel_count ? c : 0].error, DPUF_WRITER_OK, error);
}

/* Block-wide state of the publishing phases (shared memory). */
struct writer_smem {
    uint64_t consumed[DPUF_WRITER_MAX_CHANNELS];        /* the DPU's resp_consumed, read once */
    unsigned long long next[DPUF_WRITER_MAX_CHANNELS];  /* the next free position */
    uint64_t before[DPUF_WRITER_MAX_CHANNELS];          /* positions used before this launch */
    uint32_t pub[WRITER_THREADS];                        /* this round: thread t publishes */
    uint32_t chan[WRITER_THREADS];                       /* ... into this channel */
};

/* One round of up to WRITER_THREADS records, every thread of the block
 * calling: positions in thread order per channel (so that a launch's records
 * lie in the order of its operations, the same as the Python twin's), then
 * each thread writes its record: body, system fence, seq (release). */
__device__ void publish_round(const writer_args &a, writer_smem *sm, bool pub, uint32_t c, const record &r) {
    const uint32_t t = threadIdx.x;
    sm->pub[t] = pub;
    sm->chan[t] = c;
    __syncthreads();
    uint64_t p = 0;
    bool ok = false;
    if (pub) {
        uint32_t k = 0;
        for (uint32_t u = 0; u < t; u++) k += sm->pub[u] && sm->chan[u] == c;
        p = sm->next[c] + k;
        /* Positions past the room are a suffix: a refused record leaves no hole. */
        ok = dpuf_resp_fits(a.channels + c, p, sm->consumed[c]);
        if (!ok) report(a, c, DPUF_WRITER_RING_FULL);
    }
    __syncthreads(); /* every thread has read next[] */
    if (ok) {
        atomicMax(&sm->next[c], (unsigned long long)(p + 1));
        const dpuf_channel_desc *d = a.channels + c;
        uint8_t *slot = a.region + dpuf_resp_slot_offset(d, p);
        for (uint32_t off = 8u; off < d->resp_slot_size; off += 4u) *(volatile uint32_t *)(slot + off) = body_word(r, off);
        __threadfence_system();
        dpuf_store_release_sys((volatile uint64_t *)slot, p + 1);
        dpuf_writer_channel *st = a.state + c;
        atomicAdd((unsigned long long *)&st->published, 1ull);
        atomicAdd((unsigned long long *)&st->tokens, (unsigned long long)r.n_tokens);
        if (r.finish == DPUF_FINISH_CANCELLED)
            atomicAdd((unsigned long long *)&st->cancelled, 1ull);
        else if (r.finish != DPUF_FINISH_NONE)
            atomicAdd((unsigned long long *)&st->completed, 1ull);
    }
    __syncthreads();
}

/* A launch's records, WRITER_THREADS threads of one block together. */
__device__ void writer_run(const writer_args &a, writer_smem &sm) {
    const uint32_t t = threadIdx.x;
    const int64_t *resets = a.resets, *finals = a.finals, *arms = a.arms, *rows = a.rows;

    /* 1. Resets, in order (one thread), then the slots of reset channels. */
    if (t == 0) {
        for (uint32_t i = 0; i < a.n_resets; i++) {
            const int64_t *op = resets + (uint64_t)i * DPUF_WRITER_RESET_WORDS;
            const uint32_t c = (uint32_t)op[0];
            if (c >= a.channel_count) {
                report(a, c, DPUF_WRITER_BAD_SLOT);
                continue;
            }
            /* The ring restarts at position 0; the counters run on (as the
             * mailbox's do across attachments). */
            a.state[c].reserved = 0;
            a.state[c].epoch = (uint32_t)op[1];
        }
    }
    __syncthreads();
    for (uint32_t i = 0; i < a.n_resets; i++) {
        const uint32_t c = (uint32_t)resets[(uint64_t)i * DPUF_WRITER_RESET_WORDS];
        for (uint32_t e = t; e < a.slot_count; e += WRITER_THREADS)
            if (a.slots[e].state == SLOT_ACTIVE && a.slots[e].channel == c) a.slots[e].state = SLOT_DONE;
    }
    for (uint32_t c = t; c < a.channel_count; c += WRITER_THREADS) {
        sm.consumed[c] = dpuf_load_acquire_sys(&((const dpuf_dpu_ctrl *)(a.region + a.channels[c].dpu_ctrl_offset))->resp_consumed);
        sm.next[c] = sm.before[c] = a.state[c].reserved;
    }
    __syncthreads();

    /* 2. Finals: a record with no token. A slot's final only while the slot
     *    still belongs to that request (its own last record may have come first). */
    for (uint32_t base = 0; base < a.n_finals; base += WRITER_THREADS) {
        const uint32_t i = base + t;
        bool pub = false;
        uint32_t c = 0;
        record r = {};
        if (i < a.n_finals) {
            const int64_t *op = finals + (uint64_t)i * DPUF_WRITER_FINAL_WORDS;
            const int64_t e = op[0];
            c = (uint32_t)op[1];
            if (c >= a.channel_count || e >= (int64_t)a.slot_count) {
                report(a, c, DPUF_WRITER_BAD_SLOT);
                c = 0;
            } else {
                pub = e < 0;
                if (!pub) {
                    writer_slot *s = a.slots + e;
                    pub = s->state == SLOT_ACTIVE && s->channel == c && s->request_id == (uint64_t)op[2];
                    if (pub) s->state = SLOT_DONE;
                }
                r.request_id = (uint64_t)op[2];
                r.epoch = a.state[c].epoch;
                r.finish = (uint32_t)op[3];
                r.logprobs = ((uint32_t)op[4] & DPUF_WRITER_LOGPROBS) != 0;
            }
        }
        publish_round(a, &sm, pub, c, r);
    }

    /* 3. Arms. */
    for (uint32_t i = t; i < a.n_arms; i += WRITER_THREADS) {
        const int64_t *op = arms + (uint64_t)i * DPUF_WRITER_ARM_WORDS;
        const int64_t e = op[0];
        const uint32_t c = (uint32_t)op[1];
        if (e < 0 || e >= (int64_t)a.slot_count || c >= a.channel_count || op[6] > DPUF_MAX_STOP_TOKEN_IDS ||
            op[5] > DPUF_MAX_TOP_LOGPROBS) {
            report(a, c, DPUF_WRITER_BAD_SLOT);
            continue;
        }
        writer_slot *s = a.slots + e;
        s->request_id = (uint64_t)op[2];
        s->channel = c;
        s->limit = (uint32_t)op[3];
        s->flags = (uint32_t)op[4];
        s->top = (uint32_t)op[5];
        s->n_stop = (uint32_t)op[6];
        for (uint32_t k = 0; k < DPUF_MAX_STOP_TOKEN_IDS; k++) s->stop[k] = (uint32_t)op[8 + k];
        s->state = SLOT_ACTIVE;
    }
    __syncthreads();

    /* 4. Rows: one record each, while the slot is open (a slot appears once). */
    for (uint32_t base = 0; base < a.n_rows; base += WRITER_THREADS) {
        const uint32_t i = base + t;
        bool pub = false;
        uint32_t c = 0;
        record r = {};
        const int64_t e = i < a.n_rows ? rows[(uint64_t)i * DPUF_WRITER_ROW_WORDS] : -1;
        if (e >= (int64_t)a.slot_count) report(a, 0, DPUF_WRITER_BAD_SLOT);
        if (e >= 0 && e < (int64_t)a.slot_count && a.slots[e].state == SLOT_ACTIVE) {
            writer_slot *s = a.slots + e;
            const uint32_t total = (uint32_t)rows[(uint64_t)i * DPUF_WRITER_ROW_WORDS + 1];
            const uint32_t token = (uint32_t)a.tokens[i];
            const bool stop = is_stop(a, *s, token);
            c = s->channel;
            pub = true;
            r.request_id = s->request_id;
            r.epoch = a.state[c].epoch;
            r.finish = stop ? DPUF_FINISH_STOP : total >= s->limit ? DPUF_FINISH_LENGTH : DPUF_FINISH_NONE;
            r.n_tokens = stop ? 0u : 1u;
            r.token = token;
            r.logprobs = (s->flags & DPUF_WRITER_LOGPROBS) != 0;
            if (r.logprobs && r.n_tokens) {
                if (a.logprob == NULL || (s->top > 0 && (a.top_ids == NULL || s->top > a.top_stride))) {
                    report(a, c, DPUF_WRITER_NO_LOGPROBS); /* never from a correct host: the peer fails */
                    pub = false;
                } else {
                    r.logprob = a.logprob[i];
                    r.n_top = s->top;
                    for (uint32_t k = 0; k < s->top; k++) {
                        r.top_ids[k] = (uint32_t)a.top_ids[(uint64_t)i * a.top_stride + k];
                        r.top_lps[k] = a.top_logprobs[(uint64_t)i * a.top_stride + k];
                    }
                }
            }
            if (r.finish != DPUF_FINISH_NONE) s->state = SLOT_DONE;
        }
        publish_round(a, &sm, pub, c, r);
    }

    /* 5. The producer index over everything published, then the mirror. */
    for (uint32_t c = t; c < a.channel_count; c += WRITER_THREADS) {
        dpuf_writer_channel *s = a.state + c;
        s->reserved = sm.next[c];
        if (sm.next[c] != sm.before[c] || a.n_resets) {
            __threadfence_system(); /* every record's seq first (other threads': the barrier) */
            dpuf_gpu_ctrl *g = (dpuf_gpu_ctrl *)(a.region + a.channels[c].gpu_ctrl_offset);
            dpuf_store_release_sys(&g->resp_produced, s->reserved);
        }
        volatile dpuf_writer_channel *m = a.mirror + c;
        m->reserved = s->reserved;
        m->published = s->published;
        m->tokens = s->tokens;
        m->completed = s->completed;
        m->cancelled = s->cancelled;
        m->epoch = s->epoch;
        m->error = s->error;
    }
}


#endif /* DPUF_RECORD_WRITER_CUH */
