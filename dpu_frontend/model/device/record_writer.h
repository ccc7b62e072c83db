/*
 * record_writer.h: the host API of the model's record writer (libdpuf_records.so).
 *
 * The model engine's step ends with one small kernel, launched on the step's
 * stream right after the sampler: it takes the drawn tokens (and their log
 * probabilities) where the sampler left them in GPU memory, judges each
 * sequence's stop rules, and publishes one response record per sequence into
 * the ring region by the v2 rules (body, system fence, seq; then
 * resp_produced over the whole published prefix). The host never touches a
 * token on its way to the ring; it schedules the steps and says, per launch:
 *
 *   - resets: a channel attached (new epoch) or detached;
 *   - finals: a record with no token that ends a request (cancelled by the
 *     DPU, refused by the engine);
 *   - arms:   a sequence took an engine slot: where its records go and its
 *             stop rules;
 *   - rows:   the step's sampling rows, in the sampler's order: the slot and
 *             the sequence's token count with this step's token.
 *
 * All four travel as one int64 array in device memory (record_writer.cu says
 * the layout, dpu_frontend/model/publish.py builds it). The Python launcher
 * mirrors dpuf_writer_params field by field; CI checks the offsets.
 * Every function returns 0 (or a pointer) on success and -1 (NULL) on
 * failure, with the reason in dpuf_writer_last_error().
 */
#ifndef DPUF_RECORD_WRITER_H
#define DPUF_RECORD_WRITER_H

#include "ring_protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DPUF_WRITER_MAX_CHANNELS 64u
#define DPUF_WRITER_MAX_EOS 8u

/* Operation widths, in int64 words. */
#define DPUF_WRITER_RESET_WORDS 2u  /* channel, epoch (unchanged at a detach) */
#define DPUF_WRITER_FINAL_WORDS 5u  /* slot (-1: none), channel, request_id, finish, flags */
#define DPUF_WRITER_ARM_WORDS 16u   /* slot, channel, request_id, limit, flags, top, n_stop, 0, stop[8] */
#define DPUF_WRITER_ROW_WORDS 2u    /* slot, total (prompt and output tokens with this one) */

/* dpuf_writer_arm flags */
#define DPUF_WRITER_IGNORE_EOS (1u << 0)
#define DPUF_WRITER_LOGPROBS (1u << 1)  /* records carry dpuf_token_logprobs entries */

/* Errors the kernel reports (dpuf_writer_channel.error, sticky). */
#define DPUF_WRITER_OK 0u
#define DPUF_WRITER_RING_FULL 1u         /* a record found no free slot: the host's bound failed */
#define DPUF_WRITER_NO_LOGPROBS 2u       /* a row wanted log probabilities the step did not compute */
#define DPUF_WRITER_BAD_SLOT 3u          /* an operation named a slot or channel out of range */

typedef struct dpuf_writer_params {
    /* The ring region: host memory (the shm file's mapping, or the verbs
     * transport's buffer), registered here with cudaHostRegister, or GPU
     * memory (region_is_device != 0) used as it is. */
    void *region;                      /*   0 */
    uint64_t region_size;              /*   8 */
    const dpuf_channel_desc *channels; /*  16 host copy of the layout's table */
    uint32_t channel_count;            /*  24 <= DPUF_WRITER_MAX_CHANNELS */
    uint32_t slots;                    /*  28 the engine's sequence slots */
    uint32_t eos[DPUF_WRITER_MAX_EOS]; /*  32 */
    uint32_t eos_count;                /*  64 */
    int32_t device;                    /*  68 */
    uint32_t region_is_device;         /*  72 */
    uint32_t reserved;                 /*  76 zero */
} dpuf_writer_params;

/* Per channel, mirrored into pinned host memory at the end of every launch
 * (plain stores; read by the host after the launch's stream work is done). */
typedef struct dpuf_writer_channel {
    uint64_t reserved;   /*   0 response positions used = resp_produced after the launch */
    uint64_t published;  /*   8 records */
    uint64_t tokens;     /*  16 tokens in them */
    uint64_t completed;  /*  24 final records other than cancelled ones */
    uint64_t cancelled;  /*  32 cancelled finals */
    uint32_t epoch;      /*  40 */
    uint32_t error;      /*  44 DPUF_WRITER_* (first one) */
    uint8_t pad[16];     /*  48 */
} dpuf_writer_channel;

typedef struct dpuf_writer dpuf_writer;

const char *dpuf_writer_last_error(void);
dpuf_writer *dpuf_writer_create(const dpuf_writer_params *params);
/* Device address of the region (the mapped pointer of host memory). */
uint64_t dpuf_writer_region_device_ptr(dpuf_writer *w);
/* The pinned mirror: channel_count entries. */
const dpuf_writer_channel *dpuf_writer_mirror(dpuf_writer *w);
/* Queue one launch on `stream` (a cudaStream_t). `ops` (device memory):
 * resets, finals, arms, rows, back to back. tokens [n_rows] int64;
 * logprob [n_rows] float32 or NULL; top_ids [n_rows, top_stride] int64 and
 * top_logprobs [n_rows, top_stride] float32, or NULL. */
int dpuf_writer_launch(dpuf_writer *w, uint64_t stream, const int64_t *ops, uint32_t n_resets,
                       uint32_t n_finals, uint32_t n_arms, uint32_t n_rows, const int64_t *tokens,
                       const float *logprob, const int64_t *top_ids, const float *top_logprobs,
                       uint32_t top_stride);
void dpuf_writer_destroy(dpuf_writer *w);

#ifdef __cplusplus
}
#endif

#endif /* DPUF_RECORD_WRITER_H */
