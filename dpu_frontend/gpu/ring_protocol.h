/*
 * ring_protocol.h: the dpu-frontend ring protocol v2, for GPU-kernel authors.
 *
 * One source for C, C++ and CUDA: every record, field, offset and constant of
 * docs/protocol.md, with the acquire/release helpers a persistent kernel
 * needs. CI compiles it with a C compiler and checks every size, offset and
 * golden record against the Python codecs (tests/unit/test_c_header.py), so
 * the two cannot drift apart.
 *
 * All integers are little-endian; all structures are naturally aligned and
 * packed by their declaration order (the static asserts below hold for any
 * conforming LP64 compiler, nvcc included).
 */
#ifndef DPUF_RING_PROTOCOL_H
#define DPUF_RING_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define DPUF_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define DPUF_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

#if defined(__CUDACC__)
#define DPUF_HD __host__ __device__ __forceinline__
#else
#define DPUF_HD static inline
#endif

/* ---- constants ---------------------------------------------------------- */

#define DPUF_MAGIC "DPUFRING"            /* 8 bytes, no terminator in the record */
#define DPUF_VERSION_MAJOR 2u
#define DPUF_VERSION_MINOR 2u
#define DPUF_ALIGN 128u                   /* every block, ring and prompt span */
#define DPUF_HEADER_SIZE 128u
#define DPUF_CHANNEL_DESC_SIZE 128u
#define DPUF_CTRL_SIZE 128u
#define DPUF_REQUEST_SLOT_SIZE 128u
#define DPUF_RESPONSE_HEADER_SIZE 32u
#define DPUF_MIN_RESPONSE_SLOT_SIZE 64u   /* a multiple of 32 */
#define DPUF_MAX_STOP_TOKEN_IDS 8u
#define DPUF_MAX_TOP_LOGPROBS 5u
#define DPUF_MIN_LOGPROBS_SLOT_SIZE 96u   /* a token with its log probabilities */
#define DPUF_MAILBOX_SIZE 128u
#define DPUF_KERNEL_BLOCK_SIZE 128u

/* request record kinds */
#define DPUF_KIND_GENERATE 1u
#define DPUF_KIND_CANCEL 2u
/* request record flags */
#define DPUF_FLAG_IGNORE_EOS (1u << 0)
#define DPUF_FLAG_HAS_SEED (1u << 1)
#define DPUF_FLAG_LOGPROBS (1u << 2)      /* minor 1: top_logprobs alternatives */
#define DPUF_FLAG_CONSTRAINED (1u << 3)   /* minor 2: an automaton follows the prompt */
/* response record flags */
#define DPUF_RESPONSE_LOGPROBS (1u << 0)  /* payload: dpuf_token_logprobs entries */
/* channel features (dpuf_channel_desc.features, minor 1) */
#define DPUF_FEATURE_LOGPROBS (1u << 0)
#define DPUF_FEATURE_CONSTRAINTS (1u << 1) /* minor 2: structured output's automata */
/* structured output's automaton (dpuf_automaton, then its arrays) */
#define DPUF_AUTOMATON_MAGIC "DPUFAUT1"   /* 8 bytes, no terminator in the header */
#define DPUF_AUTOMATON_HEADER_SIZE 64u
#define DPUF_AUTOMATON_NONE (-1)          /* a sparse state's default and mask_at */
/* response finish reasons */
#define DPUF_FINISH_NONE 0u
#define DPUF_FINISH_STOP 1u
#define DPUF_FINISH_LENGTH 2u
#define DPUF_FINISH_CANCELLED 3u
#define DPUF_FINISH_ERROR 4u

/* mailbox commands (host -> kernel) and states */
#define DPUF_CMD_NONE 0u
#define DPUF_CMD_ATTACH 1u
#define DPUF_CMD_DETACH 2u
#define DPUF_STATE_DETACHED 0u
#define DPUF_STATE_ATTACHED 1u
/* mailbox error codes (kernel -> host) */
#define DPUF_MBX_OK 0u
#define DPUF_MBX_BAD_COMMAND 1u
#define DPUF_MBX_BAD_EPOCH 2u

/* kernel block: run states */
#define DPUF_KERNEL_STARTING 0u
#define DPUF_KERNEL_RUNNING 1u
#define DPUF_KERNEL_STOPPED 2u
#define DPUF_KERNEL_FAILED 3u

/* ---- the layout record (region offset 0, written once before attach) ---- */

typedef struct dpuf_layout_header {
    char magic[8];              /*   0 "DPUFRING" */
    uint16_t version_major;     /*   8 */
    uint16_t version_minor;     /*  10 */
    uint32_t header_size;       /*  12 128 + 128 * channel_count */
    uint64_t region_size;       /*  16 */
    uint64_t instance;          /*  24 non-zero, random per peer start */
    uint32_t channel_count;     /*  32 */
    uint32_t channel_desc_size; /*  36 128 */
    uint8_t reserved[88];       /*  40 zero */
} dpuf_layout_header;

typedef struct dpuf_channel_desc {
    uint64_t req_ring_offset;   /*   0 */
    uint32_t req_slots;         /*   8 */
    uint32_t req_slot_size;     /*  12 128 */
    uint64_t arena_offset;      /*  16 */
    uint64_t arena_size;        /*  24 multiple of 128 */
    uint64_t resp_ring_offset;  /*  32 */
    uint32_t resp_slots;        /*  40 >= 2 * max_sequences */
    uint32_t resp_slot_size;    /*  44 multiple of 32, >= 64 */
    uint64_t gpu_ctrl_offset;   /*  48 */
    uint64_t dpu_ctrl_offset;   /*  56 */
    uint32_t max_sequences;     /*  64 generates the DPU may have open */
    uint32_t max_prompt_tokens; /*  68 longest prompt the GPU side accepts */
    uint32_t features;          /*  72 DPUF_FEATURE_* (minor 1; zero in minor 0) */
    uint32_t max_top_logprobs;  /*  76 alternatives per token, <= 5, with LOGPROBS */
    uint32_t max_automaton_bytes; /* 80 the largest automaton, with CONSTRAINTS (minor 2) */
    uint8_t reserved[44];       /*  84 zero */
} dpuf_channel_desc;

/* ---- control blocks ------------------------------------------------------ */

/* Written only by the GPU side; the DPU READs it. */
typedef struct dpuf_gpu_ctrl {
    uint64_t resp_produced;     /*   0 release store (system scope) */
    uint64_t req_consumed;      /*   8 release store (system scope) */
    uint64_t heartbeat;         /*  16 beaten by a dedicated warp */
    uint64_t epoch;             /*  24 the attachment this state belongs to */
    uint8_t reserved[96];       /*  32 zero */
} dpuf_gpu_ctrl;

/* Written only by the DPU (RDMA WRITE); the GPU reads it. */
typedef struct dpuf_dpu_ctrl {
    uint64_t resp_consumed;     /*   0 acquire load (system scope) */
    uint8_t reserved[120];      /*   8 zero */
} dpuf_dpu_ctrl;

/* ---- records --------------------------------------------------------------- */

/* One 128-byte slot of the request ring. Record seq (1-based) lives in slot
 * (seq - 1) % req_slots; it is valid once commit == seq (acquire load). */
typedef struct dpuf_request {
    uint64_t commit;            /*   0 = seq, its own WRITE, posted last */
    uint32_t kind;              /*   8 DPUF_KIND_* */
    uint32_t flags;             /*  12 DPUF_FLAG_* */
    uint64_t request_id;        /*  16 unique per attachment; CANCEL: the target */
    uint64_t arena_offset;      /*  24 prompt bytes offset in the arena, 128-aligned */
    uint32_t prompt_len;        /*  32 tokens (u32 each) */
    uint32_t max_tokens;        /*  36 >= 1 */
    float temperature;          /*  40 */
    float top_p;                /*  44 */
    int32_t top_k;              /*  48 -1 = off */
    float min_p;                /*  52 */
    uint64_t seed;              /*  56 valid with DPUF_FLAG_HAS_SEED */
    float presence_penalty;     /*  64 */
    float frequency_penalty;    /*  68 */
    float repetition_penalty;   /*  72 */
    uint32_t n_stop_token_ids;  /*  76 <= 8 */
    uint32_t stop_token_ids[8]; /*  80 */
    uint32_t epoch;             /* 112 the attachment the DPU wrote it in */
    uint32_t top_logprobs;      /* 116 alternatives wanted, <= 5, with DPUF_FLAG_LOGPROBS */
    uint32_t automaton_bytes;   /* 120 with DPUF_FLAG_CONSTRAINED (minor 2): the automaton
                                 *     at arena_offset + prompt_len * 4 rounded up to 128 */
    uint8_t reserved[4];        /* 124 zero */
} dpuf_request;

/* Structured output's automaton (minor 2), in the arena after its request's
 * prompt: this header, then six arrays of 32-bit words, in this order:
 * list_start[states + 1], list_tokens[list_len], list_next[list_len],
 * default_next[states], mask_at[states] (int32; DPUF_AUTOMATON_NONE in a
 * sparse state) and masks[dense_states * mask_words] (uint32 bitmasks over
 * the vocabulary). docs/protocol.md, section 5.4, says how a state is walked
 * and what a GPU side checks before it walks one. */
typedef struct dpuf_automaton {
    char magic[8];              /*   0 DPUF_AUTOMATON_MAGIC */
    uint32_t header_size;       /*   8 64 */
    uint32_t vocab_size;        /*  12 the ids it is over */
    uint32_t eos;               /*  16 the end token: drawing it finishes with STOP */
    uint32_t states;            /*  20 >= 1; state 0 is the start */
    uint32_t list_len;          /*  24 (token, next state) pairs of all states */
    uint32_t mask_words;        /*  28 (vocab_size + 31) / 32 */
    uint32_t dense_states;      /*  32 bitmasks that follow */
    uint32_t total_bytes;       /*  36 this header and the arrays */
    uint64_t key;               /*  40 the constraint's identity: one key, one automaton */
    uint8_t reserved[16];       /*  48 zero */
} dpuf_automaton;

/* Header of one response slot; u32 token ids follow at byte 32. Record at
 * ring position p (0-based) lives in slot p % resp_slots, with seq = p + 1,
 * stored last (release, system scope). */
typedef struct dpuf_response_header {
    uint64_t seq;               /*   0 = p + 1 */
    uint64_t request_id;        /*   8 */
    uint32_t epoch;             /*  16 */
    uint16_t n_tokens;          /*  20 <= (resp_slot_size - 32) / 4 */
    uint8_t finish;             /*  22 DPUF_FINISH_* */
    uint8_t flags;              /*  23 DPUF_RESPONSE_* */
    uint8_t n_top;              /*  24 alternatives per token, with DPUF_RESPONSE_LOGPROBS */
    uint8_t reserved[7];        /*  25 zero */
} dpuf_response_header;

/* With DPUF_RESPONSE_LOGPROBS the payload at byte 32 is n_tokens of these
 * instead of u32 ids: (resp_slot_size - 32) / 48 fit a record. */
typedef struct dpuf_token_logprobs {
    uint32_t token;             /*   0 */
    float logprob;              /*   4 <= 0, -inf allowed, never NaN */
    uint32_t top_ids[5];        /*   8 first n_top valid, most likely first */
    float top_logprobs[5];      /*  28 */
} dpuf_token_logprobs;

/* ---- host <-> kernel (not in the RDMA region; the DPU never sees it) ----- */

/* One per launcher; first in the host-mapped mailbox area. */
typedef struct dpuf_kernel_block {
    uint64_t stop;              /*   0 host: non-zero asks the kernel to return */
    uint64_t state;             /*   8 kernel: DPUF_KERNEL_* */
    uint64_t steps;             /*  16 kernel: engine steps run */
    uint64_t heartbeats;        /*  24 kernel: beats by the heartbeat warp */
    uint64_t error;             /*  32 reserved for a kernel that can report its own failure;
                                 *     a fault ends the launch, which the launcher sees */
    uint8_t reserved[88];       /*  40 zero */
} dpuf_kernel_block;

/* One per channel, after the kernel block. The host writes command and
 * arg_epoch, then command_seq (release); the kernel runs the command between
 * two engine steps, writes state and error, then ack_seq = command_seq
 * (release). Counters are the kernel's, monotonic, relaxed stores. */
typedef struct dpuf_mailbox {
    uint64_t command_seq;       /*   0 host */
    uint32_t command;           /*   8 host: DPUF_CMD_* */
    uint32_t arg_epoch;         /*  12 host: the epoch an ATTACH starts */
    uint64_t ack_seq;           /*  16 kernel */
    uint32_t state;             /*  24 kernel: DPUF_STATE_* */
    uint32_t error;             /*  28 kernel: DPUF_MBX_* of the last command */
    uint64_t records;           /*  32 request records consumed */
    uint64_t admitted;          /*  40 generates admitted */
    uint64_t completed;         /*  48 sequences ended (any finish) */
    uint64_t cancelled;         /*  56 cancels honoured */
    uint64_t bad_records;       /*  64 request records refused (counted, skipped) */
    uint64_t tokens;            /*  72 tokens published */
    uint64_t published;         /*  80 response records published */
    uint64_t ring_full_waits;   /*  88 times a record waited for ring space */
    uint8_t reserved[32];       /*  96 zero */
} dpuf_mailbox;

/* ---- layout checks: the Python codecs are checked against these ---------- */

DPUF_STATIC_ASSERT(sizeof(dpuf_layout_header) == DPUF_HEADER_SIZE, "layout header");
DPUF_STATIC_ASSERT(sizeof(dpuf_channel_desc) == DPUF_CHANNEL_DESC_SIZE, "channel desc");
DPUF_STATIC_ASSERT(sizeof(dpuf_gpu_ctrl) == DPUF_CTRL_SIZE, "gpu ctrl");
DPUF_STATIC_ASSERT(sizeof(dpuf_dpu_ctrl) == DPUF_CTRL_SIZE, "dpu ctrl");
DPUF_STATIC_ASSERT(sizeof(dpuf_request) == DPUF_REQUEST_SLOT_SIZE, "request");
DPUF_STATIC_ASSERT(sizeof(dpuf_response_header) == DPUF_RESPONSE_HEADER_SIZE, "response");
DPUF_STATIC_ASSERT(sizeof(dpuf_token_logprobs) == 48, "token logprobs");
DPUF_STATIC_ASSERT(sizeof(dpuf_kernel_block) == DPUF_KERNEL_BLOCK_SIZE, "kernel block");
DPUF_STATIC_ASSERT(sizeof(dpuf_mailbox) == DPUF_MAILBOX_SIZE, "mailbox");
DPUF_STATIC_ASSERT(offsetof(dpuf_request, epoch) == 112, "request epoch");
DPUF_STATIC_ASSERT(offsetof(dpuf_response_header, n_tokens) == 20, "response n_tokens");

/* ---- helpers ------------------------------------------------------------------ */

/* Tokens one response record carries. */
DPUF_HD uint32_t dpuf_tokens_per_record(uint32_t resp_slot_size) {
    return (resp_slot_size - DPUF_RESPONSE_HEADER_SIZE) / 4u;
}

/* Byte offset (in the region) of request record seq (1-based). */
DPUF_HD uint64_t dpuf_req_slot_offset(const dpuf_channel_desc *ch, uint64_t seq) {
    return ch->req_ring_offset + ((seq - 1u) % ch->req_slots) * (uint64_t)ch->req_slot_size;
}

/* Byte offset (in the region) of response record at position p (0-based). */
DPUF_HD uint64_t dpuf_resp_slot_offset(const dpuf_channel_desc *ch, uint64_t p) {
    return ch->resp_ring_offset + (p % ch->resp_slots) * (uint64_t)ch->resp_slot_size;
}

/* May the GPU publish position p, given the DPU's resp_consumed? */
DPUF_HD int dpuf_resp_fits(const dpuf_channel_desc *ch, uint64_t p, uint64_t resp_consumed) {
    return p - resp_consumed < (uint64_t)ch->resp_slots;
}

/* Round up to DPUF_ALIGN. */
DPUF_HD uint64_t dpuf_align(uint64_t n) {
    return (n + DPUF_ALIGN - 1u) / DPUF_ALIGN * DPUF_ALIGN;
}

/*
 * Memory ordering (docs/protocol.md section 6), in CUDA terms. The other
 * side may be a NIC (GPUDirect RDMA) or, with no NIC, a CPU writing host
 * memory mapped into the GPU, so every marker is accessed at SYSTEM scope:
 *   - loads of commit and resp_consumed: acquire, system scope;
 *   - stores of seq, resp_produced, req_consumed: release, system scope;
 *   - request bodies and prompts: read after the acquire with ld.cv (never
 *     a cached load that can be stale from the previous lap of the ring).
 */
#if defined(__CUDACC__)
#include <cuda/atomic>

__device__ __forceinline__ uint64_t dpuf_load_acquire_sys(const volatile uint64_t *p) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(*const_cast<uint64_t *>(p));
    return a.load(cuda::memory_order_acquire);
}

__device__ __forceinline__ void dpuf_store_release_sys(volatile uint64_t *p, uint64_t v) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> a(*const_cast<uint64_t *>(p));
    a.store(v, cuda::memory_order_release);
}

/* A load that bypasses L1 and reads memory again (PTX ld.global.cv). */
__device__ __forceinline__ uint32_t dpuf_load_fresh_u32(const uint32_t *p) {
    return __ldcv(p);
}
#endif /* __CUDACC__ */

#endif /* DPUF_RING_PROTOCOL_H */
