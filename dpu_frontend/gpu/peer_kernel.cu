/*
 * peer_kernel.cu: the CUDA peer, the GPU half of the ring protocol v2.
 *
 * Two persistent kernels and the host API of peer_kernel.h:
 *   - the engine kernel (cooperative launch, engine_blocks x 128 threads)
 *     runs a step loop: block 0 takes mailbox commands and request records
 *     in, a grid barrier, every warp advances its sequences and publishes
 *     response records, a grid barrier, block 0 moves resp_produced;
 *   - the heartbeat kernel (one warp) beats gpu_ctrl.heartbeat of every
 *     channel on its own clock, so that a long step never looks like a dead
 *     GPU to the DPU.
 * The token source (replay of a corpus, or echo of the prompt) produces the
 * same token streams as dpu_frontend/peer/generator.py, byte for byte. A
 * constrained request (structured output) walks its automaton as the Python
 * peer's AutomatonWalk does (automaton_walk.h): block 0 takes the automaton
 * out of the arena into the peer's pool (automaton_pool.cuh, one copy per
 * constraint), checks it and sweeps its states' distances to the end; the
 * owning warp's lane 0 then takes the source's token where the automaton
 * allows it and the end stays within max_tokens, else the token nearest the
 * end.
 *
 * Build (no -rdc: grid-wide sync of cooperative groups needs none):
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Xcompiler -fPIC,-Wall -shared \
 *        dpu_frontend/gpu/peer_kernel.cu -o libdpuf_peer.so
 * The driver API is reached through cudaGetDriverEntryPointByVersion, so the
 * library needs no libcuda at link time (-lcuda is accepted, not required);
 * that, the device query and the ring region (host memory mapped into the GPU,
 * or GPU memory for a NIC) are cuda_driver.cuh's, shared with scheduler.cu.
 *
 * Sections: device helpers, token source, intake, publish, engine kernel,
 * heartbeat kernel, host API.
 */
#include "peer_kernel.h"

#define DPUF_SOURCE "peer_kernel.cu"
#include "cuda_host.cuh"
#include "automaton_pool.cuh"
#include "automaton_walk.h"
#include "cuda_driver.cuh"
#include "ring_device.cuh"

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

namespace cg = cooperative_groups;

#define ENGINE_THREADS 128u             /* threads per engine block: 4 warps */
#define ENGINE_WARPS (ENGINE_THREADS / 32u)
#define MAX_ENGINE_BLOCKS_DEFAULT 132u  /* engine_blocks == 0: one per SM, at most this */
#define PEER_MAX_AUTOMATA 64u           /* automata the pool holds at once, at most */

/* ======================================================================== */
/* Device helpers and GPU-local state                                       */
/* ======================================================================== */

/* SEQ_FAILED: a constrained GENERATE whose automaton failed its checks; its
 * owning warp answers it with an error record (refused, never admitted). */
enum : uint32_t { SEQ_FREE = 0, SEQ_ACTIVE = 1, SEQ_CANCELLED = 2, SEQ_FAILED = 3 };

/* One sequence (an admitted GENERATE). GPU memory only: the DPU never sees
 * it. Written by block 0 at admission, then only by the warp that owns the
 * entry; the grid barriers order the two. */
struct seq_entry {
    uint32_t state;           /* SEQ_* */
    uint32_t flags;           /* DPUF_FLAG_* of the record */
    uint64_t request_id;
    uint64_t cursor;          /* replay: index in the corpus; echo: index in the prompt */
    uint64_t seed;            /* the record's seed, 0 without DPUF_FLAG_HAS_SEED */
    uint32_t max_tokens;
    uint32_t emitted;         /* tokens drawn into records so far */
    uint32_t prompt_len;
    uint32_t n_stop;
    uint32_t stop[DPUF_MAX_STOP_TOKEN_IDS];
    uint32_t start_pending;   /* replay: the start cursor is still to be hashed */
    uint32_t prefill_pending; /* the simulated prefill is still to be spent */
    uint32_t has_pending;     /* a record is drawn and waits for ring space */
    uint32_t pending_n;       /* its tokens (in chan_state::pending) */
    uint32_t pending_finish;  /* its DPUF_FINISH_* */
    int32_t automaton;        /* a constrained sequence's automaton_slot, -1: none */
    int32_t astate;           /* ... and its state in it */
};

/* Everything the kernel keeps per channel, in GPU memory: the ring's state
 * (ring_device.cuh: next request, mailbox ack, epoch, counters), then its own. */
struct chan_state : ring_channel {
    seq_entry *table;            /* max_sequences entries */
    uint32_t *prompt_pool;       /* max_sequences spans of pool_stride tokens */
    uint32_t *pending;           /* max_sequences spans of tokens_per_step tokens */
    uint64_t *shadow;            /* resp_slots: the seq published in each slot (GPU scope) */
    uint64_t pool_stride;        /* max_prompt_tokens rounded up to 32 (128 bytes) */
    unsigned long long reserved; /* response positions handed out (atomicCAS) */
    uint64_t produced;           /* contiguous published prefix = gpu_ctrl.resp_produced */
    uint64_t resp_consumed_snapshot;
};

/* Grid-wide flags of the engine loop (GPU memory). */
struct engine_ctl {
    uint32_t quit; /* block 0 thread 0 decides, everyone reads after the next grid barrier */
    uint32_t busy; /* some warp served a sequence this step */
    uint64_t automata_evicted; /* unused automata evicted for room (GPU memory only: no
                                * mailbox field carries it; the ring's counters do the rest) */
};

/* Block 0's scratch: the ring's, then a constrained GENERATE's automaton. */
struct peer_smem {
    ring_smem ring;
    automaton_taken taken;
    uint32_t dense; /* its dense states, counted by the check */
};

struct engine_args {
    uint8_t *region; /* device address of the region */
    const dpuf_channel_desc *channels;
    chan_state *state;
    dpuf_kernel_block *kblock; /* mapped host memory */
    dpuf_mailbox *mailboxes;   /* mapped host memory, channel_count of them */
    engine_ctl *ctl;
    const uint32_t *corpus;
    const uint32_t *doc_starts;
    uint64_t corpus_len;
    uint32_t doc_count;
    uint32_t channel_count;
    uint32_t mode;
    uint32_t tokens_per_step;
    uint32_t eos[DPUF_MAX_EOS];
    uint32_t eos_count;
    uint64_t step_ns;
    uint64_t prefill_ns_per_token;
    automaton_pool automata; /* structured output (pool_words 0: none) */
};

/* The shadow array is GPU memory read only by this kernel: device scope is
 * enough there, and cheaper than the system scope of the region's markers. */
__device__ __forceinline__ void shadow_store_release(uint64_t *p, uint64_t v) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> a(*p);
    a.store(v, cuda::memory_order_release);
}
__device__ __forceinline__ uint64_t shadow_load_acquire(uint64_t *p) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> a(*p);
    return a.load(cuda::memory_order_acquire);
}

/* ======================================================================== */
/* Token source (equal to dpu_frontend/peer/generator.py, v2 semantics)         */
/* ======================================================================== */

/* CRC-32 as zlib computes it (reflected polynomial 0xEDB88320, initial and
 * final value 0xFFFFFFFF), one byte at a time through a 256-entry table in
 * constant memory (only lane 0 hashes, so every lookup is a broadcast). The
 * table is filled at create (crc32_table_init). */
__constant__ uint32_t c_crc32_table[256];

__device__ __forceinline__ uint32_t crc32_byte(uint32_t crc, uint32_t byte) {
    return c_crc32_table[(crc ^ byte) & 0xffu] ^ (crc >> 8);
}

/* One token: its 4 bytes, little-endian. */
__device__ __forceinline__ uint32_t crc32_token(uint32_t crc, uint32_t t) {
    return crc32_byte(crc32_byte(crc32_byte(crc32_byte(crc, t), t >> 8), t >> 16), t >> 24);
}

/* Replay start (dpu_frontend/peer/generator.py: replay_start): CRC-32 of every
 * prompt token (4 bytes LE), the seed (8 bytes LE, 0 without HAS_SEED) and one
 * byte HAS_SEED; modulo the document count, it picks the document. The prompt
 * is the entry's pool copy (GPU memory, a span of whole 128-byte chunks), read
 * 8 x 16 bytes at a time so that the loads of a chunk overlap instead of each
 * stalling the serial hash. */
__device__ uint64_t replay_start_cursor(const engine_args &a, const uint32_t *prompt, uint32_t len, uint64_t seed,
                                        bool has_seed) {
    uint32_t h = 0xffffffffu;
    const uint4 *chunk = (const uint4 *)prompt;
    for (uint32_t k = 0; k < len / 32u; k++, chunk += 8) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = chunk[i];
#pragma unroll
        for (int i = 0; i < 8; i++)
            h = crc32_token(crc32_token(crc32_token(crc32_token(h, v[i].x), v[i].y), v[i].z), v[i].w);
    }
    for (uint32_t i = len / 32u * 32u; i < len; i++) h = crc32_token(h, prompt[i]);
    for (int k = 0; k < 8; k++) h = crc32_byte(h, (uint32_t)(seed >> (8 * k)));
    h = crc32_byte(h, has_seed ? 1u : 0u);
    h ^= 0xffffffffu;
    return a.doc_starts[h % a.doc_count];
}

__device__ __forceinline__ bool is_eos(const engine_args &a, uint32_t t) {
    bool hit = false;
#pragma unroll
    for (uint32_t i = 0; i < DPUF_MAX_EOS; i++) hit |= (i < a.eos_count) & (a.eos[i] == t);
    return hit;
}

/* Slot t's automaton as the walk reads it, in the pool. */
__device__ __forceinline__ dpuf_walk slot_walk(const automaton_pool &p, const automaton_slot &t) {
    return dpuf_walk_view((const uint32_t *)(p.words + t.base), (int32_t)p.vocab, (int32_t)t.eos,
                          (int32_t)t.states, (int32_t)t.list_len, (int32_t)((p.vocab + 31u) / 32u));
}

/* Slot t's distances: one word a state, after its arrays. */
__device__ __forceinline__ int32_t *slot_distances(const automaton_pool &p, const automaton_slot &t) {
    return p.words + t.base + automaton_words(t.bytes);
}

/* All threads of block 0: each state's distance to the end (automaton_walk.h's
 * relaxation), the threads sweeping their shares of the states at once, a
 * barrier between sweeps, until a sweep lowers none. */
__device__ void sweep_distances(const automaton_pool &p, const automaton_slot &t) {
    const dpuf_walk w = slot_walk(p, t);
    int32_t *dist = slot_distances(p, t);
    for (uint32_t s = threadIdx.x; s < t.states; s += blockDim.x) dist[s] = DPUF_WALK_UNREACHABLE;
    __syncthreads();
    while (__syncthreads_or(dpuf_walk_relax(&w, dist, (int32_t)threadIdx.x, (int32_t)blockDim.x))) {
    }
}

/* One step of one ACTIVE sequence: at most K tokens into out[], and the
 * finish reason. A constrained sequence's walk picks each token from the
 * source's (AutomatonWalk.choose): its automaton's end token ends it with
 * STOP, a state with no end in reach with ERROR. Runs on the owning warp's
 * lane 0. */
__device__ void draw_step(const engine_args &a, seq_entry *en, const uint32_t *prompt, uint32_t *out,
                          uint32_t *n_out, uint32_t *finish_out) {
    uint32_t stop[DPUF_MAX_STOP_TOKEN_IDS];
#pragma unroll
    for (uint32_t i = 0; i < DPUF_MAX_STOP_TOKEN_IDS; i++) stop[i] = en->stop[i];
    const uint32_t n_stop = en->n_stop;
    const bool ignore_eos = (en->flags & DPUF_FLAG_IGNORE_EOS) != 0;
    const uint32_t max_tokens = en->max_tokens;
    const uint32_t prompt_len = en->prompt_len;
    uint32_t emitted = en->emitted;
    uint64_t cursor = en->cursor;
    uint32_t n = 0, finish = DPUF_FINISH_NONE;
    const bool walks = en->automaton >= 0;
    dpuf_walk w = {};
    const int32_t *dist = NULL;
    int32_t state = en->astate;
    if (walks) {
        const automaton_slot &slot = a.automata.slots[en->automaton];
        w = slot_walk(a.automata, slot);
        dist = slot_distances(a.automata, slot);
    }

    while (n < a.tokens_per_step && emitted + n < max_tokens) {
        uint32_t t = 0;
        bool ended = false; /* echo: the source has ended */
        if (a.mode == DPUF_MODE_ECHO) {
            if (cursor >= prompt_len)
                ended = true;
            else
                t = prompt[cursor++];
        } else { /* replay walks the corpus cyclically: it never ends */
            t = __ldg(a.corpus + cursor);
            cursor = (cursor + 1 == a.corpus_len) ? 0 : cursor + 1;
        }
        if (walks) {
            const int32_t chosen = dpuf_walk_choose(&w, dist, &state, ended ? DPUF_WALK_NONE : (int32_t)t,
                                                    (int64_t)max_tokens - emitted - n);
            if (chosen == DPUF_WALK_NONE) { /* no end is reachable from here */
                finish = DPUF_FINISH_ERROR;
                break;
            }
            if (chosen == w.eos) { /* the text may end here: it does, whatever ignore_eos says */
                finish = DPUF_FINISH_STOP;
                break;
            }
            t = (uint32_t)chosen;
            ended = false;
        }
        if (ended) {
            finish = DPUF_FINISH_STOP;
            break;
        }
        const bool eos = is_eos(a, t);
        if (eos && ignore_eos) continue; /* skipped: not emitted, not counted */
        bool stop_hit = false;
#pragma unroll
        for (uint32_t i = 0; i < DPUF_MAX_STOP_TOKEN_IDS; i++) stop_hit |= (i < n_stop) & (stop[i] == t);
        if (eos || stop_hit) { /* the stop token itself is not emitted */
            finish = DPUF_FINISH_STOP;
            break;
        }
        out[n++] = t;
    }
    emitted += n;
    if (finish == DPUF_FINISH_NONE && emitted >= max_tokens) finish = DPUF_FINISH_LENGTH;
    en->emitted = emitted;
    en->cursor = cursor;
    en->astate = state;
    *n_out = n;
    *finish_out = finish;
}

/* ======================================================================== */
/* Intake: mailbox commands and request records (block 0, all threads)      */
/* ======================================================================== */

/* The peer's side of a mailbox command (ring_device.cuh: mailbox_command).
 * Block 0 runs it between the grid barriers, while every other warp is parked
 * at the barrier: no step is publishing for this channel while its rings and
 * table are cleared. That is THE reason the engine is a step loop with grid
 * barriers. */
struct peer_mailbox {
    const engine_args &a;
    const dpuf_channel_desc *d;
    chan_state *st;

    __device__ void drop() const {
        for (uint32_t e = threadIdx.x; e < d->max_sequences; e += blockDim.x) {
            seq_entry *en = st->table + e;
            /* Its automaton has one user less (threads may drop users of one slot at once). */
            if (en->state != SEQ_FREE && en->automaton >= 0) atomicSub(&a.automata.slots[en->automaton].users, 1u);
            en->automaton = -1;
            en->state = SEQ_FREE; /* no record is published for them */
            en->has_pending = 0;
        }
    }
    /* Response positions start over at 0. */
    __device__ void reset(uint32_t) const {
        for (uint32_t s = threadIdx.x; s < d->resp_slots; s += blockDim.x) st->shadow[s] = 0;
        if (threadIdx.x == 0) {
            st->reserved = 0;
            st->produced = 0;
            st->resp_consumed_snapshot = 0;
        }
    }
};

/* Run the channel's pending mailbox command, if any (block 0). */
__device__ void run_mailbox(const engine_args &a, uint32_t c, peer_smem *sm) {
    const peer_mailbox k = {a, a.channels + c, a.state + c};
    mailbox_command(a.region, k.d, a.mailboxes + c, k.st, sm->ring, k);
}

/* The peer's side of the intake walk (ring_device.cuh: intake_walk): its
 * table of max_sequences entries, its prompt pool and its automata. */
struct peer_intake {
    const engine_args &a;
    const dpuf_channel_desc *d;
    chan_state *st;
    peer_smem &sm;

    /* A constrained GENERATE waits (and the records behind it) until the pool
     * has room for its automaton: automata in use leave it as their sequences
     * end. A size or header no automaton has is answered with an error
     * (generate); one larger than the pool never fits (the launcher sizes the
     * pool for the layout's bound). */
    __device__ uint32_t judge(uint32_t verdict, const uint32_t *wd) const {
        if (verdict != V_GENERATE || !(wd[REQ_FLAGS] & DPUF_FLAG_CONSTRAINED)) return verdict;
        const uint32_t bytes = wd[REQ_AUTOMATON];
        if (!automaton_sized(bytes)) return verdict;
        uint32_t h[16];
        automaton_header(automaton_at(a.region, d, wd), h);
        const uint64_t key = automaton_key(h);
        if (automata_find(a.automata, key, bytes) >= 0) return verdict;
        if (!automaton_header_ok(a.automata, h, bytes)) return verdict;
        const uint64_t words = automaton_slot_words(a.automata, bytes, h[AUT_STATES]);
        if (words > a.automata.pool_words) return V_BAD;
        return automata_room(a.automata, key, bytes, words, &a.ctl->automata_evicted) ? verdict : V_NONE;
    }
    __device__ int32_t entries() const { return (int32_t)d->max_sequences; }
    __device__ uint32_t look(int32_t e, uint64_t request_id) const {
        const seq_entry *en = st->table + e;
        const uint32_t state = en->state;
        if (state == SEQ_FREE) return LOOK_FREE;
        if (en->request_id != request_id) return 0u;
        /* A CANCELLED sequence holds its id until its final record is out,
         * but there is nothing left for a second cancel to stop. */
        return state == SEQ_ACTIVE ? LOOK_SAME_ID | LOOK_TARGET : LOOK_SAME_ID;
    }
    /* The lowest FREE entry (INTAKE_NO_ROOM: none). */
    __device__ int32_t place(const uint32_t *, int32_t free_entry) const { return free_entry; }
    __device__ uint32_t *prompt(int32_t e) const { return st->prompt_pool + (uint64_t)e * st->pool_stride; }
    __device__ bool generate(int32_t e, const uint32_t *wd) const {
        const bool constrained = (wd[REQ_FLAGS] & DPUF_FLAG_CONSTRAINED) != 0;
        const bool walks = constrained && take_automaton(wd);
        if (threadIdx.x != 0) return false;
        seq_entry *en = st->table + e;
        en->request_id = req_u64(wd, REQ_ID);
        en->automaton = walks ? sm.taken.slot : -1;
        en->astate = 0; /* every walk starts in state 0 */
        if (constrained && !walks) {
            /* Refused, and answered at once with an error record (its owning
             * warp publishes it), so that its stream ends instead of waiting. */
            en->has_pending = 0;
            en->state = SEQ_FAILED;
            st->counters[CNT_BAD]++;
            return false;
        }
        const bool has_seed = (wd[REQ_FLAGS] & DPUF_FLAG_HAS_SEED) != 0;
        en->flags = wd[REQ_FLAGS];
        en->prompt_len = wd[REQ_PROMPT_LEN];
        en->max_tokens = wd[REQ_MAX_TOKENS];
        en->seed = has_seed ? req_u64(wd, REQ_SEED) : 0;
        en->n_stop = wd[REQ_N_STOP];
        for (int i = 0; i < (int)DPUF_MAX_STOP_TOKEN_IDS; i++) en->stop[i] = wd[REQ_STOP + i];
        en->emitted = 0;
        en->cursor = 0; /* echo starts at the first prompt token */
        /* The replay start is hashed by the owning warp in the next phase: a
         * CRC-32 pass over a 32K-token prompt is serial work that would hold
         * up every channel's intake here. */
        en->start_pending = a.mode == DPUF_MODE_REPLAY;
        en->prefill_pending = a.prefill_ns_per_token != 0 && wd[REQ_PROMPT_LEN] != 0;
        en->has_pending = 0;
        en->state = SEQ_ACTIVE;
        return true;
    }
    /* All threads: a constrained GENERATE's automaton (sm.taken), copied out of
     * the arena, checked and its distances swept if the pool did not hold it.
     * False: it fails a check (its place freed). */
    __device__ bool take_automaton(const uint32_t *wd) const {
        const uint8_t *at = automaton_at(a.region, d, wd);
        if (threadIdx.x == 0) {
            sm.taken = automata_take(a.automata, at, wd[REQ_AUTOMATON], global_timer_ns());
            sm.dense = 0;
        }
        __syncthreads();
        bool bad = sm.taken.bad != 0;
        if (!bad && sm.taken.fresh) {
            const automaton_slot &t = a.automata.slots[sm.taken.slot];
            bad = automaton_copy_faulty(a.automata, t, at, &sm.dense);
            if (!bad) sweep_distances(a.automata, t);
        }
        __syncthreads();
        if (threadIdx.x == 0 && bad && sm.taken.slot >= 0) a.automata.slots[sm.taken.slot].live = 0; /* its only user */
        return !bad;
    }
    /* Its owning warp publishes the final record in the next phase. */
    __device__ void cancel(int32_t e, const uint32_t *) const {
        st->table[e].state = SEQ_CANCELLED;
        st->counters[CNT_CANCELLED]++;
    }
};

/* Take in every committed record of one attached channel (block 0): the peer
 * drains the ring at once (protocol 5.1, the sequence window). Returns
 * whether anything was consumed (the same value in every thread). */
__device__ bool intake_channel(const engine_args &a, uint32_t c, peer_smem *sm) {
    const peer_intake k = {a, a.channels + c, a.state + c, *sm};
    const bool consumed = intake_walk(a.region, k.d, k.st, UINT64_MAX, sm->ring, k);
    if (threadIdx.x == 0) {
        /* The DPU's read index, once per step: the publish phase reserves
         * positions against this snapshot (acquire: written by a NIC/CPU). */
        k.st->resp_consumed_snapshot = dpuf_load_acquire_sys(&dpu_ctrl_of(a.region, k.d)->resp_consumed);
    }
    return consumed;
}

/* ======================================================================== */
/* Publish (every warp, the entries it owns)                                */
/* ======================================================================== */

/* A response position p with p - resp_consumed_snapshot < resp_slots. The
 * CAS loop never hands out a position the DPU has not released. */
__device__ bool reserve_position(chan_state *st, const dpuf_channel_desc *d, uint64_t *p_out) {
    const uint64_t consumed = st->resp_consumed_snapshot;
    unsigned long long p = *(volatile unsigned long long *)&st->reserved;
    for (;;) {
        if (!dpuf_resp_fits(d, p, consumed)) return false;
        const unsigned long long seen = atomicCAS(&st->reserved, p, p + 1);
        if (seen == p) {
            *p_out = p;
            return true;
        }
        p = seen;
    }
}

/* Advance one sequence by a step and publish its record if the ring has
 * room. All 32 lanes call it; lane 0 does the scalar work, the lanes store
 * the tokens together. */
__device__ void serve_entry(const engine_args &a, uint32_t c, uint32_t e, uint32_t lane) {
    const dpuf_channel_desc *d = a.channels + c;
    chan_state *st = a.state + c;
    seq_entry *en = st->table + e;
    uint32_t *pend = st->pending + (uint64_t)e * a.tokens_per_step;
    uint32_t publish = 0, n = 0, finish = DPUF_FINISH_NONE;
    uint64_t p = 0;

    if (lane == 0) {
        if (en->state == SEQ_CANCELLED || en->state == SEQ_FAILED) {
            /* The final record replaces whatever was waiting: buffered
             * tokens are discarded. */
            en->pending_n = 0;
            en->pending_finish = en->state == SEQ_FAILED ? DPUF_FINISH_ERROR : DPUF_FINISH_CANCELLED;
            en->has_pending = 1;
        } else {
            const uint32_t *prompt = st->prompt_pool + (uint64_t)e * st->pool_stride;
            if (en->start_pending) {
                en->cursor = replay_start_cursor(a, prompt, en->prompt_len, en->seed,
                                                 (en->flags & DPUF_FLAG_HAS_SEED) != 0);
                en->start_pending = 0;
            }
            if (en->prefill_pending) {
                /* A long prefill inside one step: the whole grid waits for
                 * it at the next barrier, the heartbeat warp does not. */
                wait_until(global_timer_ns() + a.prefill_ns_per_token * en->prompt_len);
                en->prefill_pending = 0;
            }
            if (!en->has_pending) {
                uint32_t dn, df;
                draw_step(a, en, prompt, pend, &dn, &df);
                en->pending_n = dn;
                en->pending_finish = df;
                en->has_pending = dn != 0 || df != DPUF_FINISH_NONE;
            }
        }
        if (en->has_pending) {
            n = en->pending_n;
            finish = en->pending_finish;
            if (reserve_position(st, d, &p))
                publish = 1;
            else /* the ring is full: the record waits for the next step, nothing is dropped */
                atomicAdd(&st->counters[CNT_RING_FULL], 1ull);
        }
    }
    publish = __shfl_sync(0xffffffffu, publish, 0);
    if (!publish) return;
    n = __shfl_sync(0xffffffffu, n, 0);
    finish = __shfl_sync(0xffffffffu, finish, 0);
    p = __shfl_sync(0xffffffffu, p, 0);
    __syncwarp(); /* lane 0's pending tokens are visible to the other lanes */

    /* Body first: the header fields and the tokens, plain single stores (the
     * slot may be host memory the DPU process reads). */
    uint8_t *slot = a.region + dpuf_resp_slot_offset(d, p);
    for (uint32_t i = lane; i < n; i += 32) store_vol_u32(slot + DPUF_RESPONSE_HEADER_SIZE + 4u * i, pend[i]);
    if (lane == 0) {
        store_vol_u64(slot + 8, en->request_id);
        store_vol_u32(slot + 16, st->epoch);
        /* n_tokens (u16), finish (u8), flags (u8, zero) as one LE word */
        store_vol_u32(slot + 20, (n & 0xffffu) | ((finish & 0xffu) << 16));
        store_vol_u64(slot + 24, 0); /* reserved */
    }
    /* Body, fence, then seq (protocol 6.2): every lane fences its own
     * stores at system scope, the warp meets, lane 0 publishes. */
    __threadfence_system();
    __syncwarp();
    if (lane == 0) {
        dpuf_store_release_sys((volatile uint64_t *)slot, p + 1);
        /* For block 0's producer walk: release at GPU scope suffices, the
         * reader is this kernel. */
        shadow_store_release(st->shadow + p % d->resp_slots, p + 1);
        atomicAdd(&st->counters[CNT_PUBLISHED], 1ull);
        atomicAdd(&st->counters[CNT_TOKENS], (unsigned long long)n);
        en->has_pending = 0;
        if (finish != DPUF_FINISH_NONE) { /* the last record of the sequence */
            /* A refused one was never admitted: not completed either. */
            if (en->state != SEQ_FAILED) atomicAdd(&st->counters[CNT_COMPLETED], 1ull);
            /* Its automaton has one user less (warps may finish users of one slot at once). */
            if (en->automaton >= 0) atomicSub(&a.automata.slots[en->automaton].users, 1u);
            en->automaton = -1;
            en->state = SEQ_FREE;
        }
    }
    __syncwarp();
}

/* Phase 3: every warp serves the entries it owns. The entries of all
 * channels are numbered in one sequence (channel by channel) and dealt to the
 * warps round-robin, so that several channels spread over the whole grid. */
__device__ void serve_all(const engine_args &a) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t total_warps = gridDim.x * (blockDim.x / 32u);
    const uint32_t w = blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    uint64_t base = 0;
    bool busy = false;
    for (uint32_t c = 0; c < a.channel_count; c++) {
        const uint32_t max_seq = a.channels[c].max_sequences;
        const chan_state *st = a.state + c;
        if (st->attached) {
            /* first e >= 0 with (base + e) % total_warps == w */
            uint64_t e = (w + total_warps - base % total_warps) % total_warps;
            for (; e < max_seq; e += total_warps) {
                uint32_t state = lane == 0 ? st->table[e].state : 0;
                state = __shfl_sync(0xffffffffu, state, 0);
                if (state == SEQ_FREE) continue;
                busy = true;
                serve_entry(a, c, (uint32_t)e, lane);
            }
        }
        base += max_seq;
    }
    if (busy && lane == 0) store_vol_u32(&a.ctl->busy, 1);
}

/* ======================================================================== */
/* Engine kernel                                                            */
/* ======================================================================== */

/* Block 0 thread 0, after the publish phase: move resp_produced over the
 * contiguous published prefix and mirror the counters. */
__device__ void finish_step(const engine_args &a) {
    for (uint32_t c = 0; c < a.channel_count; c++) {
        const dpuf_channel_desc *d = a.channels + c;
        chan_state *st = a.state + c;
        if (st->attached) {
            uint64_t produced = st->produced;
            const uint64_t before = produced;
            /* Positions are reserved in any order across warps, so the
             * producer index only moves over a contiguous published prefix. */
            while (shadow_load_acquire(st->shadow + produced % d->resp_slots) == produced + 1) produced++;
            if (produced != before) {
                st->produced = produced;
                __threadfence_system(); /* the records' seq words before the index */
                dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->resp_produced, produced);
            }
        }
        /* Relaxed single stores into mapped host memory, never atomics. */
        dpuf_mailbox *mb = a.mailboxes + c;
        const volatile unsigned long long *k = st->counters;
        store_vol_u64(&mb->records, k[CNT_RECORDS]);
        store_vol_u64(&mb->admitted, k[CNT_ADMITTED]);
        store_vol_u64(&mb->completed, k[CNT_COMPLETED]);
        store_vol_u64(&mb->cancelled, k[CNT_CANCELLED]);
        store_vol_u64(&mb->bad_records, k[CNT_BAD]);
        store_vol_u64(&mb->tokens, k[CNT_TOKENS]);
        store_vol_u64(&mb->published, k[CNT_PUBLISHED]);
        store_vol_u64(&mb->ring_full_waits, k[CNT_RING_FULL]);
    }
}

__global__ void __launch_bounds__(ENGINE_THREADS, 1) engine_kernel(const __grid_constant__ engine_args a) {
    cg::grid_group grid = cg::this_grid();
    __shared__ peer_smem sm;
    const bool leader = blockIdx.x == 0;
    uint64_t steps = 0, step_start = 0;
    bool took = false; /* block 0: some record was consumed this step */

    if (leader && threadIdx.x == 0) dpuf_store_release_sys(&a.kblock->state, DPUF_KERNEL_RUNNING);
    for (;;) {
        /* 1. Block 0: mailbox commands, then request intake. */
        if (leader) {
            __syncthreads(); /* thread 0's quit decision of the last step */
            if (!load_vol_u32(&a.ctl->quit)) {
                step_start = global_timer_ns();
                for (uint32_t c = 0; c < a.channel_count; c++) run_mailbox(a, c, &sm);
                took = false;
                for (uint32_t c = 0; c < a.channel_count; c++) {
                    __syncthreads(); /* attach/detach of thread 0 seen by all */
                    if (a.state[c].attached) took |= intake_channel(a, c, &sm);
                }
            }
        }
        /* 2. Everything block 0 changed (tables, counters, snapshots, quit)
         *    is visible to the grid past this barrier. */
        grid.sync();
        if (load_vol_u32(&a.ctl->quit)) break; /* every block leaves together */

        /* 3. Every warp: advance and publish its sequences. */
        serve_all(a);

        /* 4. Every record reserved this step is published past this barrier. */
        grid.sync();

        /* 5. Block 0 thread 0: producer index, counters, pacing, stop. */
        if (leader && threadIdx.x == 0) {
            finish_step(a);
            store_vol_u64(&a.kblock->steps, ++steps);
            if (a.step_ns) wait_until(step_start + a.step_ns);
            bool attached = false;
            for (uint32_t c = 0; c < a.channel_count; c++) attached |= a.state[c].attached != 0;
            const bool busy = load_vol_u32(&a.ctl->busy) != 0;
            store_vol_u32(&a.ctl->busy, 0);
            /* Idle: poll the host memory less often (PCIe and power). */
            if (!attached || (!busy && !took)) __nanosleep(2000);
            /* Decided here, read by every block after the next barrier, so
             * that all leave the loop at the same step. */
            if (dpuf_load_acquire_sys(&a.kblock->stop) != 0) store_vol_u32(&a.ctl->quit, 1);
        }
    }
    if (leader && threadIdx.x == 0) {
        finish_step(a);
        dpuf_store_release_sys(&a.kblock->state, DPUF_KERNEL_STOPPED);
    }
}

/* ======================================================================== */
/* Heartbeat kernel                                                         */
/* ======================================================================== */

/* ======================================================================== */
/* Host API                                                                 */
/* ======================================================================== */

struct dpuf_peer {
    int device;
    uint32_t channel_count;
    chan_state *h_state;         /* host copy of the per-channel state (for freeing) */
    engine_args eargs;
    heartbeat_args hargs;
    dpuf_region region;          /* the shm mapping, or GPU memory (cuda_driver.cuh) */
    dpuf_channel_desc *d_channels;
    uint32_t *d_corpus;
    uint32_t *d_doc_starts;
    void *mbx_host;              /* kernel block + mailboxes, pinned and mapped */
    void *mbx_dev;
    chan_state *d_state;
    engine_ctl *d_ctl;
    cudaStream_t hb_stream;
    cudaStream_t engine_stream;
    uint32_t engine_blocks;
    bool launched;
};

/* The pool words the largest automaton of `max_bytes` can take: its arrays and
 * a distance a state, at most (max_bytes - header) / 12 states (each has a
 * list start, a default and a bitmask index: need >= 12 S + 68). */
static uint64_t automaton_pool_need(uint32_t max_bytes) {
    if (max_bytes < DPUF_AUTOMATON_HEADER_SIZE) return 0;
    const uint64_t arrays = ((uint64_t)(max_bytes - DPUF_AUTOMATON_HEADER_SIZE) / 4u + 31u) / 32u * 32u;
    const uint64_t states = (uint64_t)(max_bytes - DPUF_AUTOMATON_HEADER_SIZE) / 12u;
    return arrays + (states + 31u) / 32u * 32u;
}

static bool validate_params(const dpuf_peer_params *p) {
    if (p == NULL) return set_error("params is NULL"), false;
    if (p->mode != DPUF_MODE_REPLAY && p->mode != DPUF_MODE_ECHO)
        return set_error("mode %u is neither DPUF_MODE_REPLAY (0) nor DPUF_MODE_ECHO (1)", p->mode), false;
    if (p->eos_count > DPUF_MAX_EOS) return set_error("eos_count %u > %u", p->eos_count, DPUF_MAX_EOS), false;
    if (p->channels == NULL || p->channel_count == 0)
        return set_error("no channels (channels NULL or channel_count 0)"), false;
    if (p->region_size == 0) return set_error("region_size is 0"), false;
    if (p->heartbeat_ns == 0) return set_error("heartbeat_ns must be >= 1"), false;
    if (p->tokens_per_step == 0 || p->tokens_per_step > 0xffffu)
        return set_error("tokens_per_step %u is not in 1..65535", p->tokens_per_step), false;
    for (uint32_t c = 0; c < p->channel_count; c++) {
        const dpuf_channel_desc *d = p->channels + c;
        if (d->req_slots == 0 || d->req_slot_size != DPUF_REQUEST_SLOT_SIZE)
            return set_error("channel %u: req_slots %u, req_slot_size %u (want >= 1 and %u)", c, d->req_slots,
                             d->req_slot_size, DPUF_REQUEST_SLOT_SIZE), false;
        if (d->resp_slots == 0 || d->resp_slot_size < DPUF_MIN_RESPONSE_SLOT_SIZE || d->resp_slot_size % 32u)
            return set_error("channel %u: resp_slots %u, resp_slot_size %u (want >= 1, a multiple of 32 >= %u)", c,
                             d->resp_slots, d->resp_slot_size, DPUF_MIN_RESPONSE_SLOT_SIZE), false;
        if (d->max_sequences == 0) return set_error("channel %u: max_sequences is 0", c), false;
        if (d->features & DPUF_FEATURE_CONSTRAINTS) {
            if (p->vocab == 0 || p->automaton_pool_bytes == 0)
                return set_error("channel %u takes automata: vocab and automaton_pool_bytes must be >= 1", c), false;
            const uint64_t need = 4u * automaton_pool_need(d->max_automaton_bytes);
            if (p->automaton_pool_bytes < need)
                return set_error("channel %u takes automata of %u bytes: automaton_pool_bytes %llu < %llu, the "
                                 "largest one's slot with its distances", c, d->max_automaton_bytes,
                                 (unsigned long long)p->automaton_pool_bytes, (unsigned long long)need), false;
        }
        if (p->tokens_per_step > dpuf_tokens_per_record(d->resp_slot_size))
            return set_error("channel %u: tokens_per_step %u > %u tokens per response record", c,
                             p->tokens_per_step, dpuf_tokens_per_record(d->resp_slot_size)), false;
        if (d->arena_size % DPUF_ALIGN)
            return set_error("channel %u: arena_size %llu is not a multiple of %u", c,
                             (unsigned long long)d->arena_size, DPUF_ALIGN), false;
        const struct { const char *name; uint64_t off, len; } blocks[] = {
            {"gpu_ctrl", d->gpu_ctrl_offset, DPUF_CTRL_SIZE},
            {"dpu_ctrl", d->dpu_ctrl_offset, DPUF_CTRL_SIZE},
            {"request ring", d->req_ring_offset, (uint64_t)d->req_slots * d->req_slot_size},
            {"prompt arena", d->arena_offset, d->arena_size},
            {"response ring", d->resp_ring_offset, (uint64_t)d->resp_slots * d->resp_slot_size},
        };
        for (const auto &b : blocks) {
            if (b.off % DPUF_ALIGN)
                return set_error("channel %u: %s offset %llu is not %u-aligned", c, b.name,
                                 (unsigned long long)b.off, DPUF_ALIGN), false;
            if (!range_inside(b.off, b.len, p->region_size))
                return set_error("channel %u: %s [%llu, +%llu) lies outside the region (%llu bytes)", c, b.name,
                                 (unsigned long long)b.off, (unsigned long long)b.len,
                                 (unsigned long long)p->region_size), false;
        }
    }
    if (p->mode == DPUF_MODE_REPLAY) {
        if (p->corpus == NULL || p->corpus_len == 0) return set_error("replay needs a corpus (corpus_len >= 1)"), false;
        if (p->doc_starts == NULL || p->doc_count == 0)
            return set_error("replay needs documents (doc_count >= 1)"), false;
        for (uint32_t i = 0; i < p->doc_count; i++)
            if (p->doc_starts[i] >= p->corpus_len)
                return set_error("doc_starts[%u] = %u is past the corpus (%llu tokens)", i, p->doc_starts[i],
                                 (unsigned long long)p->corpus_len), false;
        /* A corpus of EOS ids only would spin forever under IGNORE_EOS. */
        bool has_word = false;
        for (uint64_t i = 0; i < p->corpus_len && !has_word; i++) {
            bool eos = false;
            for (uint32_t k = 0; k < p->eos_count; k++) eos |= p->corpus[i] == p->eos[k];
            has_word = !eos;
        }
        if (!has_word) return set_error("the replay corpus holds nothing but EOS ids"), false;
    }
    return true;
}

/* Free everything, best effort: a failure is recorded and the rest is
 * still released. */
static void peer_release(dpuf_peer *peer) {
    if (peer->hb_stream) DPUF_NOTE(cudaStreamDestroy(peer->hb_stream));
    if (peer->engine_stream) DPUF_NOTE(cudaStreamDestroy(peer->engine_stream));
    if (peer->h_state) {
        for (uint32_t c = 0; c < peer->channel_count; c++) {
            chan_state *s = peer->h_state + c;
            if (s->table) DPUF_NOTE(cudaFree(s->table));
            if (s->prompt_pool) DPUF_NOTE(cudaFree(s->prompt_pool));
            if (s->pending) DPUF_NOTE(cudaFree(s->pending));
            if (s->shadow) DPUF_NOTE(cudaFree(s->shadow));
        }
    }
    if (peer->d_state) DPUF_NOTE(cudaFree(peer->d_state));
    if (peer->d_ctl) DPUF_NOTE(cudaFree(peer->d_ctl));
    if (peer->eargs.automata.slots) DPUF_NOTE(cudaFree(peer->eargs.automata.slots));
    if (peer->eargs.automata.words) DPUF_NOTE(cudaFree(peer->eargs.automata.words));
    if (peer->d_channels) DPUF_NOTE(cudaFree(peer->d_channels));
    if (peer->d_corpus) DPUF_NOTE(cudaFree(peer->d_corpus));
    if (peer->d_doc_starts) DPUF_NOTE(cudaFree(peer->d_doc_starts));
    if (peer->mbx_host) DPUF_NOTE(cudaFreeHost(peer->mbx_host));
    region_release(&peer->region);
    free(peer->h_state);
    free(peer);
}

template <typename T> static int device_alloc(T **p, size_t bytes) {
    DPUF_CHECK(cudaMalloc((void **)p, bytes));
    DPUF_CHECK(cudaMemset(*p, 0, bytes));
    return 0;
}

/* The CRC-32 table of the replay start (zlib's polynomial), into constant memory. */
static int crc32_table_init(void) {
    uint32_t table[256];
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
    DPUF_CHECK(cudaMemcpyToSymbol(c_crc32_table, table, sizeof(table)));
    return 0;
}

static int peer_setup(dpuf_peer *peer, const dpuf_peer_params *p) {
    const uint32_t nch = p->channel_count;
    peer->device = p->device;
    peer->channel_count = nch;
    DPUF_CHECK(cudaSetDevice(p->device));
    if (crc32_table_init() != 0) return -1;
    int coop = 0, sms = 0;
    DPUF_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, p->device));
    DPUF_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p->device));
    if (!coop) return set_error("device %d does not support cooperative launches", p->device), -1;

    peer->h_state = (chan_state *)calloc(nch, sizeof(chan_state));
    if (!peer->h_state) return set_error("out of host memory"), -1;

    /* The region. */
    if (region_open(&peer->region, p->device, p->region_host, p->region_size) != 0) return -1;

    /* Channels, token source. */
    DPUF_CHECK(cudaMalloc((void **)&peer->d_channels, nch * sizeof(dpuf_channel_desc)));
    DPUF_CHECK(cudaMemcpy(peer->d_channels, p->channels, nch * sizeof(dpuf_channel_desc), cudaMemcpyHostToDevice));
    if (p->mode == DPUF_MODE_REPLAY) {
        DPUF_CHECK(cudaMalloc((void **)&peer->d_corpus, p->corpus_len * sizeof(uint32_t)));
        DPUF_CHECK(cudaMemcpy(peer->d_corpus, p->corpus, p->corpus_len * sizeof(uint32_t), cudaMemcpyHostToDevice));
        DPUF_CHECK(cudaMalloc((void **)&peer->d_doc_starts, p->doc_count * sizeof(uint32_t)));
        DPUF_CHECK(cudaMemcpy(peer->d_doc_starts, p->doc_starts, p->doc_count * sizeof(uint32_t),
                              cudaMemcpyHostToDevice));
    }

    /* Mailbox area: the kernel block, then one mailbox per channel. */
    DPUF_CHECK(mailbox_area_alloc(nch, &peer->mbx_host, &peer->mbx_dev));

    /* Per-channel GPU-local state. */
    for (uint32_t c = 0; c < nch; c++) {
        const dpuf_channel_desc *d = p->channels + c;
        chan_state *s = peer->h_state + c;
        const uint64_t stride = ((uint64_t)(d->max_prompt_tokens ? d->max_prompt_tokens : 1) + 31u) / 32u * 32u;
        s->pool_stride = stride;
        s->next_req_seq = 1;
        if (device_alloc(&s->table, d->max_sequences * sizeof(seq_entry)) != 0 ||
            device_alloc(&s->prompt_pool, d->max_sequences * stride * sizeof(uint32_t)) != 0 ||
            device_alloc(&s->pending, (size_t)d->max_sequences * p->tokens_per_step * sizeof(uint32_t)) != 0 ||
            device_alloc(&s->shadow, d->resp_slots * sizeof(uint64_t)) != 0)
            return -1;
    }
    DPUF_CHECK(cudaMalloc((void **)&peer->d_state, nch * sizeof(chan_state)));
    DPUF_CHECK(cudaMemcpy(peer->d_state, peer->h_state, nch * sizeof(chan_state), cudaMemcpyHostToDevice));
    if (device_alloc(&peer->d_ctl, sizeof(engine_ctl)) != 0) return -1;

    /* Structured output's pool: whole 128-byte lines of words, and its slots. */
    automaton_pool *pool = &peer->eargs.automata;
    pool->vocab = p->vocab;
    pool->distances = true;
    pool->n_slots = PEER_MAX_AUTOMATA;
    pool->pool_words = p->automaton_pool_bytes / 128u * 32u;
    if (pool->pool_words) {
        if (device_alloc(&pool->words, pool->pool_words * sizeof(int32_t)) != 0 ||
            device_alloc(&pool->slots, PEER_MAX_AUTOMATA * sizeof(automaton_slot)) != 0)
            return -1;
    }

    /* Engine size: every block must be resident at once (cooperative). */
    int per_sm = 0;
    DPUF_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, engine_kernel, ENGINE_THREADS, 0));
    const uint64_t coop_max = (uint64_t)per_sm * (uint64_t)sms;
    uint64_t blocks = p->engine_blocks ? p->engine_blocks
                                       : ((uint32_t)sms < MAX_ENGINE_BLOCKS_DEFAULT ? (uint32_t)sms
                                                                                   : MAX_ENGINE_BLOCKS_DEFAULT);
    if (blocks > coop_max) blocks = coop_max;
    if (blocks == 0) return set_error("the engine kernel cannot be resident on device %d", p->device), -1;
    peer->engine_blocks = (uint32_t)blocks;

    /* Kernel arguments. */
    dpuf_kernel_block *kb_dev = (dpuf_kernel_block *)peer->mbx_dev;
    engine_args *ea = &peer->eargs;
    ea->region = peer->region.dev;
    ea->channels = peer->d_channels;
    ea->state = peer->d_state;
    ea->kblock = kb_dev;
    ea->mailboxes = (dpuf_mailbox *)(kb_dev + 1);
    ea->ctl = peer->d_ctl;
    ea->corpus = peer->d_corpus;
    ea->doc_starts = peer->d_doc_starts;
    ea->corpus_len = p->corpus_len;
    ea->doc_count = p->doc_count;
    ea->channel_count = nch;
    ea->mode = p->mode;
    ea->tokens_per_step = p->tokens_per_step;
    memcpy(ea->eos, p->eos, sizeof ea->eos);
    ea->eos_count = p->eos_count;
    ea->step_ns = p->step_ns;
    ea->prefill_ns_per_token = p->prefill_ns_per_token;
    peer->hargs.region = peer->region.dev;
    peer->hargs.channels = peer->d_channels;
    peer->hargs.channel_count = nch;
    peer->hargs.kblock = kb_dev;
    peer->hargs.heartbeat_ns = p->heartbeat_ns;

    DPUF_CHECK(cudaDeviceSynchronize()); /* the memsets are done before anything runs */
    return 0;
}

/* 1: both kernels running or one still returning, 0: both returned, -1: error. */
static int kernels_state(dpuf_peer *peer) { return streams_state(peer->hb_stream, peer->engine_stream); }

static uint64_t *stop_word(dpuf_peer *peer) { return &((dpuf_kernel_block *)peer->mbx_host)->stop; }

extern "C" {

const char *dpuf_last_error(void) { return g_last_error; }

int dpuf_device_info_get(int32_t device, dpuf_device_info *out) { return device_info_get(device, out); }

dpuf_peer *dpuf_peer_create(const dpuf_peer_params *params) {
    if (!validate_params(params)) return NULL;
    dpuf_peer *peer = (dpuf_peer *)calloc(1, sizeof *peer);
    if (peer == NULL) return set_error("out of host memory"), (dpuf_peer *)NULL;
    if (peer_setup(peer, params) != 0) {
        char why[sizeof g_last_error];
        memcpy(why, g_last_error, sizeof why);
        peer_release(peer);
        memcpy(g_last_error, why, sizeof why); /* report the cause, not the cleanup */
        return NULL;
    }
    return peer;
}

int dpuf_peer_write_region(dpuf_peer *peer, uint64_t offset, const void *data, uint64_t n) {
    if (peer == NULL || (data == NULL && n != 0)) return set_error("peer or data is NULL"), -1;
    DPUF_CHECK(cudaSetDevice(peer->device));
    return region_write(&peer->region, offset, data, n);
}

uint64_t dpuf_peer_region_device_ptr(dpuf_peer *peer) {
    if (peer == NULL) return set_error("peer is NULL"), 0;
    return (uint64_t)(uintptr_t)peer->region.dev;
}

void *dpuf_peer_mailbox(dpuf_peer *peer) {
    if (peer == NULL) return set_error("peer is NULL"), (void *)NULL;
    return peer->mbx_host;
}

int dpuf_peer_dmabuf_fd(dpuf_peer *peer, int32_t *fd, uint64_t *offset) {
    if (peer == NULL || fd == NULL || offset == NULL) return set_error("peer, fd or offset is NULL"), -1;
    DPUF_CHECK(cudaSetDevice(peer->device));
    return region_dmabuf_fd(&peer->region, fd, offset);
}

int dpuf_peer_launch(dpuf_peer *peer) {
    if (peer == NULL) return set_error("peer is NULL"), -1;
    if (peer->launched) return set_error("the kernel was already launched"), -1;
    DPUF_CHECK(cudaSetDevice(peer->device));
    if (!peer->hb_stream) DPUF_CHECK(cudaStreamCreateWithFlags(&peer->hb_stream, cudaStreamNonBlocking));
    if (!peer->engine_stream) DPUF_CHECK(cudaStreamCreateWithFlags(&peer->engine_stream, cudaStreamNonBlocking));
    /* A launch error is read with cudaGetLastError: drop a stale,
     * non-sticky error of some earlier unrelated call first (a sticky one
     * fails the launches below anyway). */
    (void)cudaGetLastError();

    /* The heartbeat first, so that it is resident before the engine fills
     * the SMs; it returns only when kernel_block.stop is set. */
    heartbeat_kernel<<<1, 32, 0, peer->hb_stream>>>(peer->hargs);
    DPUF_CHECK(cudaGetLastError());

    void *args[] = {&peer->eargs};
    cudaError_t e = cudaLaunchCooperativeKernel((const void *)engine_kernel, dim3(peer->engine_blocks),
                                                dim3(ENGINE_THREADS), args, 0, peer->engine_stream);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
        cuda_ok(e, "cudaLaunchCooperativeKernel(engine_kernel)", __LINE__);
        char why[sizeof g_last_error];
        memcpy(why, g_last_error, sizeof why);
        /* Take the heartbeat down again; the peer may be launched later. */
        dpuf_kernel_block *kb = (dpuf_kernel_block *)peer->mbx_host;
        __atomic_store_n(&kb->stop, 1, __ATOMIC_RELEASE);
        DPUF_NOTE(cudaStreamSynchronize(peer->hb_stream));
        __atomic_store_n(&kb->stop, 0, __ATOMIC_RELEASE);
        memcpy(g_last_error, why, sizeof why);
        return -1;
    }
    peer->launched = true;
    return 0;
}

int dpuf_peer_poll(dpuf_peer *peer) {
    if (peer == NULL) return set_error("peer is NULL"), -1;
    if (!peer->launched) return set_error("the kernel was not launched"), -1;
    DPUF_CHECK(cudaSetDevice(peer->device));
    return kernels_state(peer);
}

int dpuf_peer_stop(dpuf_peer *peer, uint32_t timeout_ms) {
    if (peer == NULL) return set_error("peer is NULL"), -1;
    if (!peer->launched) return 0;
    DPUF_CHECK(cudaSetDevice(peer->device));
    return stop_streams(stop_word(peer), peer->hb_stream, peer->engine_stream, timeout_ms);
}

void dpuf_peer_destroy(dpuf_peer *peer) {
    if (peer == NULL) return;
    DPUF_NOTE(cudaSetDevice(peer->device));
    if (peer->launched && !kernels_stopped(stop_word(peer), peer->hb_stream, peer->engine_stream)) {
        set_error("dpuf_peer_destroy: the kernels did not stop; their memory is left allocated");
        free(peer->h_state);
        free(peer);
        return;
    }
    peer_release(peer);
}

} /* extern "C" */
