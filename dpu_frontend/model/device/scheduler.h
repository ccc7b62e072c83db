/*
 * scheduler.h: the host API of the scheduler inside the GPU (libdpuf_sched.so).
 *
 * The model peer's `--scheduler gpu`: one persistent scheduler kernel takes
 * the requests from the ring, batches them (sched_core.h), launches each
 * step's captured graphs from the GPU (device graph launch), publishes the
 * records (record_writer.cuh) and retires what finished. The host loads the
 * model, captures the step graphs (dpu_frontend/model/gpu_scheduler.py),
 * hands them and the runner's buffers over, launches the scheduler once, and
 * from then on only answers the control plane (mailbox, stats).
 *
 * Life: dpuf_model_device_info_get (before the model loads: GPUDirect RDMA)
 * -> dpuf_model_create -> dpuf_model_add_graph (each captured step, with
 * its sampler variants) -> dpuf_model_write_region -> (a GPU region: its
 * dma-buf or device address, registered for RDMA) -> dpuf_model_launch ->
 * mailbox commands -> dpuf_model_stop -> dpuf_model_destroy. Every function
 * returns 0 (or a pointer) on success and -1 (NULL) on failure, with the
 * reason in dpuf_model_last_error(). The Python side mirrors the structures
 * field by field; CI checks the offsets.
 */
#ifndef DPUF_SCHEDULER_H
#define DPUF_SCHEDULER_H

#include "device_info.h"
#include "ring_protocol.h"
#include "record_writer.h"
#include "sched_core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DPUF_MODEL_MAX_EOS 8u
#define DPUF_MODEL_VARIANTS 5u /* sampler graphs per step graph (DPUF_SAMPLER_*) */
/* Structured output's automata kept in GPU memory at once (one per constraint). */
#define DPUF_MODEL_MAX_AUTOMATA 64u

/* The sampler graph a step runs: the cheapest whose stages cover the batch.
 * Each stage leaves a row whose parameters are neutral bit for bit as it
 * was, so any variant draws a row's token as a fuller one would. */
#define DPUF_SAMPLER_GREEDY 0u   /* every row greedy, no penalties: argmax */
#define DPUF_SAMPLER_PLAIN 1u    /* temperature only: no penalties, no top-k/top-p/min-p cut */
#define DPUF_SAMPLER_FULL 2u     /* penalties and every cut */
#define DPUF_SAMPLER_LOGPROBS 3u /* FULL and the log probabilities (DPUF_MAX_TOP_LOGPROBS wide) */
#define DPUF_SAMPLER_CONSTRAINED 4u /* LOGPROBS and structured output's mask and state step */

/* The sampler's rules, once for C (dpu_frontend.model.sampling holds the
 * Python side; CI evaluates both on every case). A temperature below
 * DPUF_GREEDY_BELOW draws greedily (dividing by it would overflow float32). A
 * row is penalized unless its presence, frequency and repetition penalties are
 * neutral, and cut unless its top-k, top-p and min-p keep every token. */
#define DPUF_GREEDY_BELOW 1e-5f
#define DPUF_ROW_GREEDY(temperature) ((temperature) < DPUF_GREEDY_BELOW)
#define DPUF_ROW_PENALIZED(presence, frequency, repetition) \
    ((presence) != 0.0f || (frequency) != 0.0f || (repetition) != 1.0f)
#define DPUF_ROW_CUT(top_k, top_p, min_p) ((top_k) != 0 || (top_p) < 1.0f || (min_p) > 0.0f)
/* The cheapest variant whose stages cover a batch, from its rows' facts. */
#define DPUF_SAMPLER_VARIANT(all_greedy, any_penalty, any_cut, any_logprobs, any_constrained) \
    ((any_constrained) ? DPUF_SAMPLER_CONSTRAINED                                            \
     : (any_logprobs) ? DPUF_SAMPLER_LOGPROBS                                                \
     : ((any_penalty) || (any_cut)) ? DPUF_SAMPLER_FULL                                      \
     : (all_greedy) ? DPUF_SAMPLER_GREEDY : DPUF_SAMPLER_PLAIN)

typedef struct dpuf_model_params {
    /* The region. region_host != NULL: host memory (the shm transport's
     * mapping), registered here with cudaHostRegister(Mapped|Portable).
     * region_host == NULL: allocated here in GPU memory (whole 2 MiB pages,
     * SYNC_MEMOPS set) for a NIC to register: dpuf_model_dmabuf_fd, or
     * dpuf_model_region_device_ptr with nvidia-peermem. */
    void *region_host;                  /*   0 */
    uint64_t region_size;               /*   8 */
    const dpuf_channel_desc *channels;  /*  16 host copy of the layout's table */
    uint32_t channel_count;             /*  24 <= DPUF_SCHED_MAX_CHANNELS */
    uint32_t eos_count;                 /*  28 */
    uint32_t eos[DPUF_MODEL_MAX_EOS];   /*  32 */
    int32_t device;                     /*  64 */
    uint32_t vocab;                     /*  68 token ids a prompt may hold (the tokenizer's) */
    uint64_t heartbeat_ns;              /*  72 */
    uint64_t idle_ns;                   /*  80 the scheduler's sleep between polls when idle */
    dpuf_sched_config sched;            /*  88 (32 bytes) */
    /* The runner's buffers (device memory, PyTorch's). */
    int64_t *tokens;                    /* 120 [max_seqs + 1][max_model_len]: row max_seqs is padding's */
    int32_t *counts;                    /* 128 [max_seqs + 1][vocab_rows] */
    uint8_t *in_prompt;                 /* 136 [max_seqs + 1][vocab_rows] (bool) */
    uint32_t vocab_rows;                /* 144 the model's vocabulary (logits columns) */
    uint32_t rows_stride;               /* 148 columns of the sampler's row arrays: max_seqs */
    /* The sampler graphs' inputs: each row's slot and token position, floats
     * [6][rows_stride] (temperature, top_p, min_p, presence, frequency,
     * repetition), ints [3][rows_stride] (top_k, seed bits, output index). */
    int64_t *row_slot;                  /* 152 */
    int64_t *row_pos;                   /* 160 */
    float *row_floats;                  /* 168 */
    int64_t *row_ints;                  /* 176 */
    /* ... and outputs: tokens [rows_stride], with DPUF_SAMPLER_LOGPROBS the
     * drawn token's log probability and DPUF_MAX_TOP_LOGPROBS alternatives. */
    const int64_t *out_tokens;          /* 184 */
    const float *out_logprob;           /* 192 */
    const int64_t *out_top_ids;         /* 200 */
    const float *out_top_logprobs;      /* 208 */
    /* Structured output (the runner's DeviceAutomata, model/layers/constrain.py):
     * the pool of automata the scheduler copies out of the arena, 32-bit words;
     * per runner slot, [max_seqs + 1][6] int64 (base word, states, list length,
     * vocabulary, end token, on) and the state. automata_words 0: none. */
    int32_t *automata;                  /* 216 */
    uint64_t automata_words;            /* 224 */
    int64_t *automaton_meta;            /* 232 */
    int64_t *automaton_state;           /* 240 */
} dpuf_model_params;

/* Counters of the scheduler, mirrored into pinned host memory every step. */
typedef struct dpuf_model_stats {
    uint64_t steps;           /*   0 step graphs launched */
    uint64_t tokens;          /*   8 tokens scheduled (prefill and decode) */
    uint64_t sampled;         /*  16 rows drawn */
    uint64_t admitted;        /*  24 sequences given a slot */
    uint64_t preemptions;     /*  32 */
    uint64_t refused;         /*  40 requests ended with an error record (prompt the model cannot take) */
    uint64_t idle_polls;      /*  48 */
    uint64_t held;            /*  56 steps with a sequence held out for ring room */
    uint64_t variants[DPUF_MODEL_VARIANTS]; /* 64 steps per sampler graph */
    uint64_t running;         /* 104 sequences running after the last step */
    uint64_t waiting;         /* 112 */
    uint64_t free_blocks;     /* 120 */
    uint64_t error;           /* 128 DPUF_MODEL_ERR_* (sticky) */
    /* Where the time goes, ns of the GPU's clock: the scheduler's phases in
     * the passes that launched a step (A, publish and retire; B-C, mailbox and
     * intake; D, schedule; E, prepare and launch), its passes with nothing to
     * run (idle, sleeps included), and the step graphs themselves (from a
     * launch to the next run's start: forward, sampler, launch gaps). */
    uint64_t ns_publish;      /* 136 */
    uint64_t ns_intake;       /* 144 */
    uint64_t ns_schedule;     /* 152 */
    uint64_t ns_prepare;      /* 160 */
    uint64_t ns_idle;         /* 168 */
    uint64_t ns_step;         /* 176 */
    /* KV positions the steps' attention read: each work's start + count, its
     * context and its own tokens, as the host engine's
     * EngineStats.context_tokens (with `steps`, a run's bandwidth bound). */
    uint64_t context_tokens;  /* 184 */
    /* Structured output: sequences admitted with an automaton, automata copied
     * out of the arena (and checked), evicted for room, and refused (a check
     * failed: the request ended with an error record). */
    uint64_t constrained;     /* 192 */
    uint64_t automata_copied; /* 200 */
    uint64_t automata_evicted; /* 208 */
    uint64_t automata_refused; /* 216 */
    /* Steps with decodes that were scheduled spread over the block (nothing
     * preempted, room in every ring for them); the rest by thread 0's serial loop. */
    uint64_t spread_schedules; /* 224 */
    /* After each launched step's schedule, the sequences running and those still
     * waiting, summed (means a step: over `steps`), as the host engine's
     * EngineStats.sum_running / sum_waiting; and the idle passes' time while
     * sequences waited (none could be scheduled: no blocks, slots or ring room). */
    uint64_t sum_running;     /* 232 */
    uint64_t sum_waiting;     /* 240 */
    uint64_t ns_idle_waiting; /* 248 */
} dpuf_model_stats;

/* dpuf_model_stats.error: what stopped the scheduler. */
#define DPUF_MODEL_OK 0u
#define DPUF_MODEL_ERR_NO_GRAPH 1u    /* a step no captured graph holds (a sizing bug) */
#define DPUF_MODEL_ERR_LAUNCH 2u      /* a device graph launch failed */
#define DPUF_MODEL_ERR_WRITER 3u      /* the record writer reported an error */

typedef struct dpuf_model dpuf_model;

const char *dpuf_model_last_error(void);
/* The device as GPUDirect RDMA sees it (device_info.h), before any allocation:
 * the launcher checks it before the model loads. */
int dpuf_model_device_info_get(int32_t device, dpuf_device_info *out);
dpuf_model *dpuf_model_create(const dpuf_model_params *params);
/* A captured step: its sizes, its static input buffer (device), the
 * cudaGraph_t of its forward (`forward`) and of each sampler variant
 * (`samplers`, DPUF_MODEL_VARIANTS of them), all instantiated here for
 * device launch and uploaded. In the order the scheduler takes the first
 * that holds a step (decode graphs, then mixed, each smallest first). */
int dpuf_model_add_graph(dpuf_model *m, int32_t tokens, int32_t seqs, int32_t tiles, int32_t samples, void *inputs,
                         uint64_t forward, const uint64_t *samplers);
int dpuf_model_write_region(dpuf_model *m, uint64_t offset, const void *data, uint64_t n);
/* The region as the GPU addresses it (for RDMA registration of a GPU region). */
uint64_t dpuf_model_region_device_ptr(dpuf_model *m);
/* A dma-buf fd for a GPU region (cuMemGetHandleForAddressRange). */
int dpuf_model_dmabuf_fd(dpuf_model *m, int32_t *fd, uint64_t *offset);
/* Host pointer to the mailbox area: one dpuf_kernel_block, then one
 * dpuf_mailbox per channel (pinned, mapped host memory). */
void *dpuf_model_mailbox(dpuf_model *m);
/* The pinned mirror of the counters; and of the record writer's, per channel. */
const dpuf_model_stats *dpuf_model_stats_mirror(dpuf_model *m);
const dpuf_writer_channel *dpuf_model_writer_mirror(dpuf_model *m);
int dpuf_model_launch(dpuf_model *m);
/* 1 while the kernels run, 0 once they returned; -1 with an error (a fault). */
int dpuf_model_poll(dpuf_model *m);
int dpuf_model_stop(dpuf_model *m, uint32_t timeout_ms);
void dpuf_model_destroy(dpuf_model *m);

#ifdef __cplusplus
}
#endif

#endif /* DPUF_SCHEDULER_H */
