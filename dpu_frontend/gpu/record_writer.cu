/*
 * record_writer.cu: the model's response records, written by the GPU.
 *
 * One block (WRITER_THREADS threads) per launch, on the engine's stream right
 * after the sampler, so a launch sees its step's tokens and the launches of
 * earlier steps are done. Phases, with a block barrier between them:
 *   1. resets (a channel attached or detached): epoch, positions, and every
 *      slot of the channel closed; then each channel's resp_consumed, read
 *      once (acquire, system scope);
 *   2. finals: records with no token (cancelled, refused);
 *   3. arms: a sequence took a slot;
 *   4. rows: each sampling row's token, judged by its slot's stop rules
 *      (docs/protocol.md section 9, the same rules as the host engine's),
 *      one record per row; a slot closed by an earlier record is skipped
 *      (an overlapped step's row past its sequence's end);
 *   5. per channel: resp_produced over everything published (release,
 *      system scope) and the mirror of the counters in pinned host memory.
 * Records go out in rounds of one per thread: positions are given in the
 * order of the operations (per channel: a thread's position is the channel's
 * next free one plus the records of lower threads there), so a launch lays
 * out the same bytes as the Python twin (dpu_frontend/model/publish.py).
 * Each thread writes its record's body, fences at system scope, and stores
 * seq (release); after the last round, one thread per channel fences and
 * stores resp_produced over the launch's records, a contiguous prefix.
 *
 * The host bounds what it launches so that a record always finds a free
 * slot (dpu_frontend/model/publish.py); if one ever does not, the record is
 * not written and the channel's error says so (the host fails the peer).
 *
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 -Xcompiler -fPIC -shared
 *        dpu_frontend/gpu/record_writer.cu -o libdpuf_records.so
 */
#include "record_writer.h"

#include <cuda_runtime.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WRITER_THREADS 256u

enum : uint32_t { SLOT_FREE = 0, SLOT_ACTIVE = 1, SLOT_DONE = 2 };

static __thread char g_last_error[512];

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
}

#define CHECK(call)                                                                            \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            set_error("%s: %s (line %d)", #call, cudaGetErrorString(e_), __LINE__);            \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)

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
    const int64_t *ops;
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

__global__ void __launch_bounds__(WRITER_THREADS, 1) writer_kernel(const __grid_constant__ writer_args a) {
    __shared__ writer_smem sm;
    const uint32_t t = threadIdx.x;
    const int64_t *resets = a.ops;
    const int64_t *finals = resets + (uint64_t)a.n_resets * DPUF_WRITER_RESET_WORDS;
    const int64_t *arms = finals + (uint64_t)a.n_finals * DPUF_WRITER_FINAL_WORDS;
    const int64_t *rows = arms + (uint64_t)a.n_arms * DPUF_WRITER_ARM_WORDS;

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

/* ======================================================================== */
/* Host API                                                                 */
/* ======================================================================== */

struct dpuf_writer {
    int device;
    uint32_t channel_count;
    uint32_t slot_count;
    uint8_t *region_host; /* registered here: unregistered at destroy */
    uint8_t *region_dev;
    dpuf_channel_desc *channels;
    dpuf_writer_channel *state;
    dpuf_writer_channel *mirror;
    writer_slot *slots;
    uint32_t eos[DPUF_WRITER_MAX_EOS];
    uint32_t eos_count;
};

static void writer_release(dpuf_writer *w) {
    if (w->region_host) cudaHostUnregister(w->region_host);
    if (w->channels) cudaFree(w->channels);
    if (w->state) cudaFree(w->state);
    if (w->slots) cudaFree(w->slots);
    if (w->mirror) cudaFreeHost(w->mirror);
    free(w);
}

static int writer_setup(dpuf_writer *w, const dpuf_writer_params *p) {
    CHECK(cudaSetDevice(p->device));
    if (p->region_is_device) {
        w->region_dev = (uint8_t *)p->region;
    } else {
        CHECK(cudaHostRegister(p->region, p->region_size, cudaHostRegisterMapped | cudaHostRegisterPortable));
        w->region_host = (uint8_t *)p->region;
        void *dev = NULL;
        CHECK(cudaHostGetDevicePointer(&dev, p->region, 0));
        w->region_dev = (uint8_t *)dev;
    }
    const size_t descs = sizeof(dpuf_channel_desc) * p->channel_count;
    const size_t states = sizeof(dpuf_writer_channel) * p->channel_count;
    CHECK(cudaMalloc((void **)&w->channels, descs));
    CHECK(cudaMemcpy(w->channels, p->channels, descs, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc((void **)&w->state, states));
    CHECK(cudaMemset(w->state, 0, states));
    CHECK(cudaMalloc((void **)&w->slots, sizeof(writer_slot) * p->slots));
    CHECK(cudaMemset(w->slots, 0, sizeof(writer_slot) * p->slots));
    CHECK(cudaHostAlloc((void **)&w->mirror, states, cudaHostAllocMapped | cudaHostAllocPortable));
    memset(w->mirror, 0, states);
    return 0;
}

extern "C" {

const char *dpuf_writer_last_error(void) { return g_last_error; }

dpuf_writer *dpuf_writer_create(const dpuf_writer_params *p) {
    if (p == NULL || p->region == NULL || p->channels == NULL) return set_error("no region or channel table"), nullptr;
    if (p->channel_count == 0 || p->channel_count > DPUF_WRITER_MAX_CHANNELS)
        return set_error("channel_count %u is not in [1, %u]", p->channel_count, DPUF_WRITER_MAX_CHANNELS), nullptr;
    if (p->slots == 0 || p->eos_count > DPUF_WRITER_MAX_EOS)
        return set_error("slots must be positive and eos_count at most %u", DPUF_WRITER_MAX_EOS), nullptr;
    for (uint32_t c = 0; c < p->channel_count; c++) {
        const dpuf_channel_desc *d = p->channels + c;
        const uint64_t ring = (uint64_t)d->resp_slots * d->resp_slot_size;
        if (d->resp_slots == 0 || d->resp_slot_size < DPUF_MIN_RESPONSE_SLOT_SIZE || d->resp_slot_size % 32u ||
            d->resp_ring_offset > p->region_size || ring > p->region_size - d->resp_ring_offset ||
            d->gpu_ctrl_offset + DPUF_CTRL_SIZE > p->region_size || d->dpu_ctrl_offset + DPUF_CTRL_SIZE > p->region_size)
            return set_error("channel %u does not fit the %llu-byte region", c, (unsigned long long)p->region_size), nullptr;
    }
    dpuf_writer *w = (dpuf_writer *)calloc(1, sizeof *w);
    if (!w) return set_error("out of host memory"), nullptr;
    w->device = p->device;
    w->channel_count = p->channel_count;
    w->slot_count = p->slots;
    memcpy(w->eos, p->eos, sizeof w->eos);
    w->eos_count = p->eos_count;
    if (writer_setup(w, p) != 0) {
        writer_release(w);
        return nullptr;
    }
    return w;
}

uint64_t dpuf_writer_region_device_ptr(dpuf_writer *w) { return (uint64_t)(uintptr_t)w->region_dev; }

const dpuf_writer_channel *dpuf_writer_mirror(dpuf_writer *w) { return w->mirror; }

int dpuf_writer_launch(dpuf_writer *w, uint64_t stream, const int64_t *ops, uint32_t n_resets, uint32_t n_finals,
                       uint32_t n_arms, uint32_t n_rows, const int64_t *tokens, const float *logprob,
                       const int64_t *top_ids, const float *top_logprobs, uint32_t top_stride) {
    if (n_rows && tokens == NULL) return set_error("rows without tokens"), -1;
    if (n_resets + n_finals + n_arms + n_rows && ops == NULL) return set_error("operations without their array"), -1;
    CHECK(cudaSetDevice(w->device)); /* per thread: the engine steps on worker threads */
    writer_args a = {};
    a.region = w->region_dev;
    a.channels = w->channels;
    a.state = w->state;
    a.mirror = w->mirror;
    a.slots = w->slots;
    a.slot_count = w->slot_count;
    a.channel_count = w->channel_count;
    memcpy(a.eos, w->eos, sizeof a.eos);
    a.eos_count = w->eos_count;
    a.ops = ops;
    a.n_resets = n_resets;
    a.n_finals = n_finals;
    a.n_arms = n_arms;
    a.n_rows = n_rows;
    a.tokens = tokens;
    a.logprob = logprob;
    a.top_ids = top_ids;
    a.top_logprobs = top_logprobs;
    a.top_stride = top_stride;
    writer_kernel<<<1, WRITER_THREADS, 0, (cudaStream_t)(uintptr_t)stream>>>(a);
    CHECK(cudaGetLastError());
    return 0;
}

void dpuf_writer_destroy(dpuf_writer *w) {
    if (!w) return;
    cudaSetDevice(w->device);
    cudaDeviceSynchronize();
    writer_release(w);
}

} /* extern "C" */
