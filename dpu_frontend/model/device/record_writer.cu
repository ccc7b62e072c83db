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
 *        -Idpu_frontend/gpu dpu_frontend/model/device/record_writer.cu -o libdpuf_records.so
 */
#include "record_writer.cuh"

#define DPUF_SOURCE "record_writer.cu"
#include "cuda_host.cuh"

#include <stdlib.h>
#include <string.h>

__global__ void __launch_bounds__(WRITER_THREADS, 1) writer_kernel(const __grid_constant__ writer_args a) {
    __shared__ writer_smem sm;
    writer_run(a, sm);
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
    DPUF_CHECK(cudaSetDevice(p->device));
    if (p->region_is_device) {
        w->region_dev = (uint8_t *)p->region;
    } else {
        DPUF_CHECK(cudaHostRegister(p->region, p->region_size, cudaHostRegisterMapped | cudaHostRegisterPortable));
        w->region_host = (uint8_t *)p->region;
        void *dev = NULL;
        DPUF_CHECK(cudaHostGetDevicePointer(&dev, p->region, 0));
        w->region_dev = (uint8_t *)dev;
    }
    const size_t descs = sizeof(dpuf_channel_desc) * p->channel_count;
    const size_t states = sizeof(dpuf_writer_channel) * p->channel_count;
    DPUF_CHECK(cudaMalloc((void **)&w->channels, descs));
    DPUF_CHECK(cudaMemcpy(w->channels, p->channels, descs, cudaMemcpyHostToDevice));
    DPUF_CHECK(cudaMalloc((void **)&w->state, states));
    DPUF_CHECK(cudaMemset(w->state, 0, states));
    DPUF_CHECK(cudaMalloc((void **)&w->slots, sizeof(writer_slot) * p->slots));
    DPUF_CHECK(cudaMemset(w->slots, 0, sizeof(writer_slot) * p->slots));
    DPUF_CHECK(cudaHostAlloc((void **)&w->mirror, states, cudaHostAllocMapped | cudaHostAllocPortable));
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
    DPUF_CHECK(cudaSetDevice(w->device)); /* per thread: the engine steps on worker threads */
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
    a.resets = ops;
    a.finals = a.resets + (uint64_t)n_resets * DPUF_WRITER_RESET_WORDS;
    a.arms = a.finals + (uint64_t)n_finals * DPUF_WRITER_FINAL_WORDS;
    a.rows = a.arms + (uint64_t)n_arms * DPUF_WRITER_ARM_WORDS;
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
    DPUF_CHECK(cudaGetLastError());
    return 0;
}

void dpuf_writer_destroy(dpuf_writer *w) {
    if (!w) return;
    cudaSetDevice(w->device);
    cudaDeviceSynchronize();
    writer_release(w);
}

} /* extern "C" */
