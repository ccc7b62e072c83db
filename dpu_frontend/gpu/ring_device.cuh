/*
 * ring_device.cuh: the GPU half of the ring protocol that every persistent
 * kernel shares: the CUDA peer (peer_kernel.cu) and the model's scheduler
 * (scheduler.cu). Request records in, rings reset at an attachment, mailbox
 * commands, the heartbeat. docs/protocol.md says the bytes and the orders.
 *
 * Where the kernels differ (their sequence tables, what a record or a command
 * does to them), a shared walk takes the kernel's side as a small object
 * whose members it calls: a template, so every call is inlined, with no
 * function pointer and no cost at run time.
 */
#ifndef DPUF_RING_DEVICE_CUH
#define DPUF_RING_DEVICE_CUH

#include "ring_protocol.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Sleep-spin until the global timer reaches deadline_ns. */
__device__ __forceinline__ void wait_until(uint64_t deadline_ns) {
    for (uint64_t now = global_timer_ns(); now < deadline_ns; now = global_timer_ns()) {
        uint64_t left = deadline_ns - now;
        __nanosleep(left < 1000u ? (unsigned)left : 1000u);
    }
}

/* Plain single stores and loads that the compiler may neither merge, split
 * nor cache: every word the other side reads is one aligned store (protocol
 * 6.3), and mapped host memory is read back fresh. */
__device__ __forceinline__ void store_vol_u64(void *p, uint64_t v) { *(volatile uint64_t *)p = v; }
__device__ __forceinline__ void store_vol_u32(void *p, uint32_t v) { *(volatile uint32_t *)p = v; }
__device__ __forceinline__ uint64_t load_vol_u64(const void *p) { return *(const volatile uint64_t *)p; }
__device__ __forceinline__ uint32_t load_vol_u32(const void *p) { return *(const volatile uint32_t *)p; }

__device__ __forceinline__ dpuf_gpu_ctrl *gpu_ctrl_of(uint8_t *region, const dpuf_channel_desc *d) {
    return (dpuf_gpu_ctrl *)(region + d->gpu_ctrl_offset);
}
__device__ __forceinline__ dpuf_dpu_ctrl *dpu_ctrl_of(uint8_t *region, const dpuf_channel_desc *d) {
    return (dpuf_dpu_ctrl *)(region + d->dpu_ctrl_offset);
}

/* A request record's verdict, and a mailbox command's action. */
enum : uint32_t { V_NONE = 0, V_BAD, V_GENERATE, V_CANCEL };
enum : uint32_t { M_NONE = 0, M_ATTACH, M_DETACH, M_BAD_EPOCH, M_BAD_COMMAND };

/* The mailbox's 8 counters, in its order (dpuf_mailbox.records onwards). */
enum : uint32_t { CNT_RECORDS, CNT_ADMITTED, CNT_COMPLETED, CNT_CANCELLED, CNT_BAD, CNT_TOKENS, CNT_PUBLISHED,
                  CNT_RING_FULL, CNT_COUNT };

/* What every kernel keeps of a channel's ring, in GPU memory: the fields the
 * intake walk and the mailbox commands below read and write. A kernel's own
 * per-channel state derives from it (struct chan_state : ring_channel). */
struct ring_channel {
    uint64_t next_req_seq; /* the next request record expected (1-based) */
    uint64_t acked;        /* the last mailbox command_seq acknowledged */
    uint32_t epoch;        /* of the current attachment (0: never attached) */
    uint32_t attached;
    /* GPU memory: atomics work here, and must never be used on the mapped
     * host memory of the mailbox, which gets plain stores of these. */
    unsigned long long counters[CNT_COUNT];
};

/* The block's scratch for a request record or a mailbox command: thread 0
 * writes it, the block reads it past a barrier, and nothing is rewritten
 * before the next barrier. */
struct ring_smem {
    uint32_t words[32]; /* the request record (REQ_*); words 0-1, the commit word, are not copied */
    uint64_t command_seq;
    uint32_t action; /* M_* */
    uint32_t arg_epoch;
    uint32_t verdict; /* V_* */
    int entry;        /* the scan's lowest match (a free entry, a cancel's target); INT_MAX: none */
    int duplicate;    /* a live sequence has the GENERATE's request_id */
};

/* Request record words: dpuf_request (protocol 5.1) as 32 u32 words, read
 * by read_request. Every reader names them; the asserts after the list hold
 * each name to its field's offset. */
__device__ __forceinline__ uint64_t req_u64(const uint32_t *w, int i) { return w[i] | ((uint64_t)w[i + 1] << 32); }
#define REQ_KIND 2
#define REQ_FLAGS 3
#define REQ_ID 4
#define REQ_ARENA 6
#define REQ_PROMPT_LEN 8
#define REQ_MAX_TOKENS 9
#define REQ_TEMPERATURE 10
#define REQ_TOP_P 11
#define REQ_TOP_K 12
#define REQ_MIN_P 13
#define REQ_SEED 14
#define REQ_PRESENCE 16
#define REQ_FREQUENCY 17
#define REQ_REPETITION 18
#define REQ_N_STOP 19
#define REQ_STOP 20
#define REQ_EPOCH 28
#define REQ_LOGPROBS 29
#define REQ_AUTOMATON 30
#define DPUF_REQ_WORD(name, field) \
    static_assert(offsetof(dpuf_request, field) == 4 * (name), #name " is not dpuf_request." #field)
DPUF_REQ_WORD(REQ_KIND, kind);
DPUF_REQ_WORD(REQ_FLAGS, flags);
DPUF_REQ_WORD(REQ_ID, request_id);
DPUF_REQ_WORD(REQ_ARENA, arena_offset);
DPUF_REQ_WORD(REQ_PROMPT_LEN, prompt_len);
DPUF_REQ_WORD(REQ_MAX_TOKENS, max_tokens);
DPUF_REQ_WORD(REQ_TEMPERATURE, temperature);
DPUF_REQ_WORD(REQ_TOP_P, top_p);
DPUF_REQ_WORD(REQ_TOP_K, top_k);
DPUF_REQ_WORD(REQ_MIN_P, min_p);
DPUF_REQ_WORD(REQ_SEED, seed);
DPUF_REQ_WORD(REQ_PRESENCE, presence_penalty);
DPUF_REQ_WORD(REQ_FREQUENCY, frequency_penalty);
DPUF_REQ_WORD(REQ_REPETITION, repetition_penalty);
DPUF_REQ_WORD(REQ_N_STOP, n_stop_token_ids);
DPUF_REQ_WORD(REQ_STOP, stop_token_ids);
DPUF_REQ_WORD(REQ_EPOCH, epoch);
DPUF_REQ_WORD(REQ_LOGPROBS, top_logprobs);
DPUF_REQ_WORD(REQ_AUTOMATON, automaton_bytes);
#undef DPUF_REQ_WORD

/* Where a constrained request's automaton starts in the arena, from its
 * prompt's start: the prompt rounded up to 128 bytes (protocol 5.4). */
__device__ __forceinline__ uint64_t automaton_offset(uint32_t prompt_len) { return dpuf_align(4ull * prompt_len); }

/* One thread: read and check record `seq` of channel `d` into words[0..31];
 * V_NONE while it is not committed. */
__device__ uint32_t read_request(const uint8_t *region, const dpuf_channel_desc *d, uint32_t epoch, uint64_t seq,
                                 uint32_t *words) {
    const uint8_t *slot = region + dpuf_req_slot_offset(d, seq);
    /* Acquire, system scope: the writer is a NIC or a CPU; the body was
     * written before the commit word (protocol 6.1). */
    if (dpuf_load_acquire_sys((const volatile uint64_t *)slot) != seq) return V_NONE;
    /* The body, fresh (ld.global.cv, as dpuf_load_fresh_u32 but 8 and 16
     * bytes wide): the slot is reused every lap of the ring, a cached line
     * could hold the last lap's record. All eight loads are issued before
     * the first result is used, so the body costs one PCIe round trip. */
    const uint2 head = __ldcv((const uint2 *)(slot + 8));
    uint4 body[7];
#pragma unroll
    for (int i = 0; i < 7; i++) body[i] = __ldcv((const uint4 *)(slot + 16) + i);
    words[2] = head.x;
    words[3] = head.y;
#pragma unroll
    for (int i = 0; i < 7; i++) {
        words[4 + 4 * i] = body[i].x;
        words[5 + 4 * i] = body[i].y;
        words[6 + 4 * i] = body[i].z;
        words[7 + 4 * i] = body[i].w;
    }
    const uint32_t kind = words[REQ_KIND];
    const uint64_t arena_off = req_u64(words, REQ_ARENA);
    const uint32_t prompt_len = words[REQ_PROMPT_LEN], max_tokens = words[REQ_MAX_TOKENS];
    const uint32_t n_stop = words[REQ_N_STOP];
    if (words[REQ_EPOCH] != epoch) return V_BAD; /* written for another attachment */
    if (kind == DPUF_KIND_CANCEL) return V_CANCEL;
    if (kind != DPUF_KIND_GENERATE) return V_BAD;
    if (n_stop > DPUF_MAX_STOP_TOKEN_IDS || max_tokens == 0 || arena_off % DPUF_ALIGN != 0) return V_BAD;
    if (arena_off > d->arena_size || 4ull * prompt_len > d->arena_size - arena_off) return V_BAD;
    if (prompt_len > d->max_prompt_tokens) return V_BAD;
    /* An automaton on a channel that does not walk them (minor 2): refused, never
     * served as if unconstrained. */
    const bool constrained = (words[REQ_FLAGS] & DPUF_FLAG_CONSTRAINED) != 0;
    const uint32_t automaton = words[REQ_AUTOMATON];
    if ((constrained || automaton != 0) && (d->features & DPUF_FEATURE_CONSTRAINTS) == 0) return V_BAD;
    if (constrained) {
        /* Its span after the prompt's, within the arena and the channel's bound.
         * Its contents, its size's shape included, are the walker's to check: it
         * answers an automaton that fails with an error record. */
        const uint64_t at = arena_off + automaton_offset(prompt_len);
        if (automaton == 0 || automaton > d->max_automaton_bytes || at > d->arena_size ||
            automaton > d->arena_size - at)
            return V_BAD; /* the flag without a size, as decode_request refuses it */
    } else if (automaton != 0) {
        return V_BAD;
    }
    return V_GENERATE;
}

/* Copy a prompt out of the arena, all threads of the block together. ld.cv:
 * the arena span is rewritten for later requests, a cached copy could be a
 * previous prompt. Both ends are 16-byte aligned (arena_offset % 128 == 0,
 * destination spans of whole 128-byte chunks), so most of it moves as uint4,
 * four loads in flight per thread. */
__device__ void copy_prompt(const uint32_t *src, uint32_t *dst, uint32_t len) {
    const uint4 *src4 = (const uint4 *)src;
    uint4 *dst4 = (uint4 *)dst;
    const uint32_t n4 = len / 4u, nt = blockDim.x;
    for (uint32_t base = 0; base < n4; base += 4u * nt) {
        uint4 v[4];
#pragma unroll
        for (uint32_t k = 0; k < 4; k++) {
            const uint32_t i = base + k * nt + threadIdx.x;
            if (i < n4) v[k] = __ldcv(src4 + i);
        }
#pragma unroll
        for (uint32_t k = 0; k < 4; k++) {
            const uint32_t i = base + k * nt + threadIdx.x;
            if (i < n4) dst4[i] = v[k];
        }
    }
    for (uint32_t i = n4 * 4u + threadIdx.x; i < len; i += nt) dst[i] = dpuf_load_fresh_u32(src + i);
}

/* The scan's view of one entry of a kernel's sequence table (LOOK_* bits). */
enum : uint32_t {
    LOOK_FREE = 1u,    /* a GENERATE may take it */
    LOOK_SAME_ID = 2u, /* a live sequence of the channel with the record's request_id: a GENERATE is a duplicate */
    LOOK_TARGET = 4u,  /* ... that a CANCEL of that id stops */
};
/* Where a GENERATE goes, besides an entry (>= 0). */
#define INTAKE_NO_ROOM INT_MAX /* no entry for it: a bad record (the DPU broke its max_sequences window) */
#define INTAKE_REFUSED (-1)    /* not a bad record, but its prompt is not copied: the kernel answers it */

/*
 * The intake walk: take in the committed request records of attached channel
 * d, in order, at most max_records of them, all threads of the block
 * together. Returns whether it took any (the same in every thread).
 *
 * Shared here: the commit's acquire and the body's fresh loads
 * (read_request), the block-wide scan of the kernel's sequence table (a
 * GENERATE's duplicate id and a free entry, a CANCEL's target), the prompt
 * copy, the counters, and req_consumed released once, after every copy.
 * The kernel's side is `k`; thread-0 members run on thread 0 only, block
 * members on every thread with the same arguments (they may __syncthreads):
 *
 *   uint32_t judge(uint32_t verdict, const uint32_t *words)    thread 0
 *       a committed record as the kernel sees it: V_NONE leaves it and the
 *       rest for a later walk, V_BAD refuses it, or the verdict as it is.
 *   int32_t entries()                                           block
 *       the size of the sequence table.
 *   uint32_t look(int32_t e, uint64_t request_id)               block
 *       entry e as LOOK_* bits.
 *   int32_t place(const uint32_t *words, int32_t free_entry)    block
 *       a GENERATE with no duplicate: the entry its prompt goes to, or
 *       INTAKE_NO_ROOM, INTAKE_REFUSED. free_entry is the lowest entry the
 *       scan found LOOK_FREE, INTAKE_NO_ROOM if none.
 *   uint32_t *prompt(int32_t entry)                              block
 *       where that entry's prompt goes: 16-byte aligned, room for the whole
 *       128-byte chunks of max_prompt_tokens.
 *   bool generate(int32_t entry, const uint32_t *words)         block
 *       the GENERATE placed at entry (INTAKE_REFUSED: not copied), its
 *       prompt copied; thread 0's result: admitted (counted).
 *   void cancel(int32_t target, const uint32_t *words)          thread 0
 *       a CANCEL whose target is live (an unknown or finished one is
 *       ignored, not bad).
 */
template <class Kernel>
__device__ bool intake_walk(uint8_t *region, const dpuf_channel_desc *d, ring_channel *st, uint64_t max_records,
                            ring_smem &sm, const Kernel &k) {
    const uint64_t first = st->next_req_seq;
    uint64_t seq = first; /* every thread keeps the same copy */
    while (seq - first < max_records) {
        if (threadIdx.x == 0) {
            uint32_t verdict = read_request(region, d, st->epoch, seq, sm.words);
            if (verdict != V_NONE) verdict = k.judge(verdict, sm.words);
            sm.verdict = verdict;
            sm.entry = INT_MAX;
            sm.duplicate = 0;
        }
        __syncthreads();
        uint32_t verdict = sm.verdict;
        if (verdict == V_NONE) break; /* not committed yet, or left for later: the walk ends */
        const uint64_t request_id = req_u64(sm.words, REQ_ID);

        /* Scan the table together. */
        if (verdict == V_GENERATE || verdict == V_CANCEL) {
            const int32_t n = k.entries();
            for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
                const uint32_t look = k.look(e, request_id);
                if (verdict == V_GENERATE) {
                    if (look & LOOK_SAME_ID) sm.duplicate = 1;
                    if (look & LOOK_FREE) atomicMin(&sm.entry, e);
                } else if (look & LOOK_TARGET) {
                    atomicMin(&sm.entry, e);
                }
            }
        }
        __syncthreads();
        int32_t entry = sm.entry;
        /* A duplicate id, or no entry: refused like any bad record. */
        if (verdict == V_GENERATE && sm.duplicate) verdict = V_BAD;
        if (verdict == V_GENERATE) {
            entry = k.place(sm.words, entry);
            if (entry == INTAKE_NO_ROOM) verdict = V_BAD;
        }
        if (verdict == V_GENERATE && entry >= 0) {
            copy_prompt((const uint32_t *)(region + d->arena_offset + req_u64(sm.words, REQ_ARENA)), k.prompt(entry),
                        sm.words[REQ_PROMPT_LEN]);
            __syncthreads(); /* the copy is complete before req_consumed can move */
        }
        const bool admitted = verdict == V_GENERATE && k.generate(entry, sm.words);
        if (threadIdx.x == 0) {
            /* Plain increments: thread 0 of this block is their only writer. */
            if (verdict == V_BAD) st->counters[CNT_BAD]++;
            if (verdict == V_CANCEL && entry != INT_MAX) k.cancel(entry, sm.words); /* else ignored, not bad */
            if (admitted) st->counters[CNT_ADMITTED]++;
            st->counters[CNT_RECORDS]++;
        }
        seq++;
        __syncthreads(); /* sm is rewritten for the next record */
    }
    const bool took = seq != first;
    if (threadIdx.x == 0 && took) {
        st->next_req_seq = seq;
        /* Every prompt is copied out (each copy ended at a barrier) before
         * req_consumed moves: the DPU reuses the slots and arena spans it
         * covers as soon as it sees it. Fence, then release, system scope. */
        __threadfence_system();
        dpuf_store_release_sys(&gpu_ctrl_of(region, d)->req_consumed, seq - 1);
    }
    __syncthreads();
    return took;
}

/* Zero a channel's rings and indices for a new attachment, all threads of
 * the block; nothing may publish into the channel meanwhile. The caller
 * fences (system scope) and syncs before it stores the new epoch. A stale
 * commit of the last attachment would pass for record seq of the new one; a
 * stale seq for a response the DPU has not read. */
__device__ void reset_rings(uint8_t *region, const dpuf_channel_desc *d) {
    for (uint32_t s = threadIdx.x; s < d->req_slots; s += blockDim.x)
        store_vol_u64(region + d->req_ring_offset + (uint64_t)s * d->req_slot_size, 0);
    for (uint32_t s = threadIdx.x; s < d->resp_slots; s += blockDim.x)
        store_vol_u64(region + d->resp_ring_offset + (uint64_t)s * d->resp_slot_size, 0);
    if (threadIdx.x == 0) {
        dpuf_gpu_ctrl *gc = gpu_ctrl_of(region, d);
        store_vol_u64(&gc->resp_produced, 0);
        store_vol_u64(&gc->req_consumed, 0);
        /* The only store of the GPU into the DPU's block: no DPU is attached. */
        store_vol_u64(&dpu_ctrl_of(region, d)->resp_consumed, 0);
        /* gpu_ctrl.heartbeat is left alone: it is monotonic across attachments. */
    }
}

/* One thread: the channel's pending mailbox command as an M_* action (its
 * command_seq and epoch argument out), M_NONE when there is none. */
__device__ uint32_t mailbox_take(const dpuf_mailbox *mb, uint64_t acked, uint32_t epoch, uint64_t *command_seq,
                                 uint32_t *arg_epoch) {
    /* Acquire: the host wrote command and arg_epoch before command_seq. */
    const uint64_t cs = dpuf_load_acquire_sys(&mb->command_seq);
    *command_seq = cs;
    if (cs == acked) return M_NONE;
    const uint32_t command = load_vol_u32(&mb->command);
    *arg_epoch = load_vol_u32(&mb->arg_epoch);
    if (command == DPUF_CMD_ATTACH) return *arg_epoch > epoch ? M_ATTACH : M_BAD_EPOCH;
    if (command == DPUF_CMD_DETACH) return M_DETACH;
    return M_BAD_COMMAND;
}

/* One thread, once the action is carried out: state and error, then the ack. */
__device__ void mailbox_ack(dpuf_mailbox *mb, uint64_t command_seq, uint32_t action) {
    uint32_t error = DPUF_MBX_OK;
    if (action == M_BAD_EPOCH) error = DPUF_MBX_BAD_EPOCH; /* refused, the attachment stands */
    if (action == M_BAD_COMMAND) error = DPUF_MBX_BAD_COMMAND;
    if (action == M_ATTACH) store_vol_u32(&mb->state, DPUF_STATE_ATTACHED);
    if (action == M_DETACH) store_vol_u32(&mb->state, DPUF_STATE_DETACHED);
    store_vol_u32(&mb->error, error);
    /* Release: state and error are visible before the host sees the ack. */
    dpuf_store_release_sys(&mb->ack_seq, command_seq);
}

/*
 * Run channel d's pending mailbox command, if any, all threads of the block,
 * between two engine steps: nothing of the kernel may publish into the
 * channel meanwhile. An ATTACH refused (M_BAD_EPOCH) or unknown is only
 * acknowledged. `k` is the kernel's side, two members every thread calls:
 *   void drop()                 every sequence of the channel ends without a
 *                               record (ATTACH: the ring it would publish
 *                               into is zeroed; DETACH: it is let go);
 *   void reset(uint32_t epoch)  an ATTACH: the kernel's own state of the
 *                               channel starts over, after the rings are
 *                               zeroed and before the fence.
 */
template <class Kernel>
__device__ void mailbox_command(uint8_t *region, const dpuf_channel_desc *d, dpuf_mailbox *mb, ring_channel *st,
                                ring_smem &sm, const Kernel &k) {
    if (threadIdx.x == 0) sm.action = mailbox_take(mb, st->acked, st->epoch, &sm.command_seq, &sm.arg_epoch);
    __syncthreads();
    const uint32_t action = sm.action, epoch = sm.arg_epoch;
    const uint64_t cs = sm.command_seq;
    __syncthreads(); /* read by all before thread 0 takes the next command */
    if (action == M_NONE) return;
    if (action == M_ATTACH || action == M_DETACH) k.drop();
    if (action == M_ATTACH) {
        reset_rings(region, d);
        k.reset(epoch);
        if (threadIdx.x == 0) st->next_req_seq = 1;
        /* Every thread's zeroes reach the system before the new epoch does: a
         * DPU that sees the epoch sees clean rings and counters. */
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            st->epoch = epoch;
            st->attached = 1;
            dpuf_store_release_sys(&gpu_ctrl_of(region, d)->epoch, epoch);
        }
    }
    __syncthreads(); /* the block's drop and reset are done before the ack */
    if (threadIdx.x == 0) {
        if (action == M_DETACH) st->attached = 0;
        st->acked = cs;
        mailbox_ack(mb, cs, action);
    }
    __syncthreads();
}

struct heartbeat_args {
    uint8_t *region;
    const dpuf_channel_desc *channels;
    uint32_t channel_count;
    dpuf_kernel_block *kblock;
    uint64_t heartbeat_ns;
};

/* One warp, lane 0, on its own clock: it never waits on the engine, so a
 * 32K-token prefill inside one step never stops the heartbeat. */
__global__ void heartbeat_kernel(const heartbeat_args a) {
    if (threadIdx.x != 0) return;
    /* Go on from the highest value in the region: monotonic even if the
     * region was beaten by an earlier peer. */
    uint64_t beat = 0;
    for (uint32_t c = 0; c < a.channel_count; c++) {
        const uint64_t v = load_vol_u64(&gpu_ctrl_of(a.region, a.channels + c)->heartbeat);
        beat = v > beat ? v : beat;
    }
    uint64_t beats = 0, next = global_timer_ns();
    while (dpuf_load_acquire_sys(&a.kblock->stop) == 0) {
        const uint64_t now = global_timer_ns();
        if (now < next) {
            const uint64_t left = next - now;
            __nanosleep(left < 100000u ? (unsigned)left : 100000u); /* see stop within 0.1 ms */
            continue;
        }
        ++beat;
        for (uint32_t c = 0; c < a.channel_count; c++)
            dpuf_store_release_sys(&gpu_ctrl_of(a.region, a.channels + c)->heartbeat, beat);
        store_vol_u64(&a.kblock->heartbeats, ++beats);
        next += a.heartbeat_ns;
        if (next <= now) next = now + a.heartbeat_ns; /* after a stall: no burst of beats */
    }
}

/* ---- host -------------------------------------------------------------------- */

/* The mailbox area (protocol 7.1): the kernel block, then one mailbox per
 * channel, zeroed, in pinned host memory mapped into the GPU. *host is the
 * launcher's address (cudaFreeHost), *dev the kernels'. The first failure is
 * returned for the caller's check (DPUF_CHECK); *host may be set even then. */
static inline cudaError_t mailbox_area_alloc(uint32_t channel_count, void **host, void **dev) {
    const size_t bytes = DPUF_KERNEL_BLOCK_SIZE + (size_t)DPUF_MAILBOX_SIZE * channel_count;
    const cudaError_t e = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) return e;
    memset(*host, 0, bytes);
    return cudaHostGetDevicePointer(dev, *host, 0);
}

#endif /* DPUF_RING_DEVICE_CUH */
