/*
 * allreduce.cu: tensor parallelism's all-reduce over NVLink peer memory
 * (libdpuf_allreduce.so), allreduce.h's protocol on the GPU.
 *
 * Each rank's process allocates its staging buffer (the input, max_bytes) and
 * its signal words in its GPU's memory, exports both as CUDA IPC handles, and
 * opens every other rank's once, at start (dpuf_ar_open): from then on a call is
 * a copy of the input into the rank's own buffer and one kernel, both on the
 * caller's stream, so a CUDA graph captures them, for host launch or for device
 * launch. A graph's kernel arguments are fixed at capture, so the call's epoch
 * is not one: each block keeps its own in GPU memory, the last call's plus one,
 * and every rank's block b counts the same calls.
 *
 * The kernel runs allreduce.h's dpuf_ar_block, as the host build does: block b's
 * thread 0 signals and waits, the block's threads sum or copy its elements
 * between the phases, every thread fencing at system scope and the block meeting
 * at a barrier before thread 0 signals, so that a peer that sees the flag sees
 * every thread's writes.
 *
 * A wait past the patience given at create (a peer's kernel stopped) raises the
 * rank's fault word, in its GPU memory, and copies the first fault into pinned
 * host memory mapped for the GPU, which dpuf_ar_fault reads without a sync: the
 * step's kernels end (with wrong sums) instead of spinning, and the host fails
 * the step.
 *
 * Build (no -rdc: no device runtime):
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Xcompiler -fPIC -shared \
 *        dpu_frontend/gpu/allreduce.cu -o libdpuf_allreduce.so
 */
#include "allreduce.h"

#define DPUF_SOURCE "allreduce.cu"
#include "cuda_host.cuh"

#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#define AR_THREADS 512u
#define AR_MAX_BLOCKS 64

/* The kernel's view: allreduce.h's call, less its epoch (epochs[block]'s). */
struct ar_args {
    dpuf_ar_call call;
    uint32_t *epochs; /* [blocks], this rank's GPU memory */
};

__global__ void __launch_bounds__(AR_THREADS) allreduce_kernel(const __grid_constant__ ar_args a) {
    __shared__ uint32_t epoch;
    const int32_t block = (int32_t)blockIdx.x;
    if (threadIdx.x == 0) epoch = a.epochs[block] + 1u;
    __syncthreads();
    dpuf_ar_call c = a.call;
    c.epoch = epoch;
    dpuf_ar_block(&c, block); /* allreduce.h's, as the host build runs it */
    if (threadIdx.x == 0) a.epochs[block] = epoch;
}

/* ---- host API (allreduce.py's PeerMemoryLibrary binds it) ----------------- */

struct dpuf_ar {
    int device;
    int32_t rank, ranks, blocks;
    uint64_t max_bytes;
    void *buf;         /* this rank's staging buffer */
    uint32_t *flags;   /* this rank's signal words */
    uint32_t *epochs;  /* [blocks] */
    void *peer_buf[DPUF_AR_MAX_RANKS];
    uint32_t *peer_flags[DPUF_AR_MAX_RANKS];
    uint32_t *fault;           /* this rank's fault word, GPU memory */
    uint32_t *fault_host;      /* its first fault, pinned host memory ... */
    uint32_t *fault_host_dev;  /* ... as the GPU reaches it */
    uint64_t patience_ns;
    bool opened;
};

/* Two IPC handles a rank: its buffer's, then its flags'. */
#define AR_HANDLE_BYTES (2 * sizeof(cudaIpcMemHandle_t))

static void ar_release(dpuf_ar *ar) {
    for (int32_t q = 0; q < ar->ranks; q++) {
        if (q == ar->rank) continue;
        if (ar->peer_buf[q]) DPUF_NOTE(cudaIpcCloseMemHandle(ar->peer_buf[q]));
        if (ar->peer_flags[q]) DPUF_NOTE(cudaIpcCloseMemHandle(ar->peer_flags[q]));
    }
    if (ar->buf) DPUF_NOTE(cudaFree(ar->buf));
    if (ar->flags) DPUF_NOTE(cudaFree(ar->flags));
    if (ar->epochs) DPUF_NOTE(cudaFree(ar->epochs));
    if (ar->fault) DPUF_NOTE(cudaFree(ar->fault));
    if (ar->fault_host) DPUF_NOTE(cudaFreeHost(ar->fault_host));
    free(ar);
}

static int ar_setup(dpuf_ar *ar) {
    DPUF_CHECK(cudaSetDevice(ar->device));
    const size_t flag_bytes = sizeof(uint32_t) * (size_t)dpuf_ar_flag_words(ar->blocks, ar->ranks);
    DPUF_CHECK(cudaMalloc(&ar->buf, ar->max_bytes));
    DPUF_CHECK(cudaMalloc((void **)&ar->flags, flag_bytes));
    DPUF_CHECK(cudaMemset(ar->flags, 0, flag_bytes)); /* epoch 0: no call's (the first is 1) */
    DPUF_CHECK(cudaMalloc((void **)&ar->epochs, sizeof(uint32_t) * (size_t)ar->blocks));
    DPUF_CHECK(cudaMemset(ar->epochs, 0, sizeof(uint32_t) * (size_t)ar->blocks));
    DPUF_CHECK(cudaMalloc((void **)&ar->fault, sizeof(uint32_t)));
    DPUF_CHECK(cudaMemset(ar->fault, 0, sizeof(uint32_t)));
    DPUF_CHECK(cudaHostAlloc((void **)&ar->fault_host, sizeof(uint32_t), cudaHostAllocMapped));
    *(volatile uint32_t *)ar->fault_host = 0;
    DPUF_CHECK(cudaHostGetDevicePointer((void **)&ar->fault_host_dev, ar->fault_host, 0));
    DPUF_CHECK(cudaDeviceSynchronize());
    ar->peer_buf[ar->rank] = ar->buf;
    ar->peer_flags[ar->rank] = ar->flags;
    return 0;
}

extern "C" {

const char *dpuf_ar_last_error(void) { return g_last_error; }

/* This rank's buffers on `device`: inputs of up to max_bytes, a grid of
 * `blocks`, a wait past patience_ns a stalled peer. NULL: the reason in
 * dpuf_ar_last_error. */
dpuf_ar *dpuf_ar_create(int32_t device, int32_t rank, int32_t ranks, uint64_t max_bytes, int32_t blocks,
                        uint64_t patience_ns) {
    if (ranks < 1 || ranks > DPUF_AR_MAX_RANKS || rank < 0 || rank >= ranks)
        return set_error("rank %d of %d ranks (1 to %d)", rank, ranks, DPUF_AR_MAX_RANKS), (dpuf_ar *)NULL;
    if (blocks < 1 || blocks > AR_MAX_BLOCKS || max_bytes == 0 || max_bytes % 16)
        return set_error("%d blocks (1 to %d), max_bytes %llu (a multiple of 16)", blocks, AR_MAX_BLOCKS,
                         (unsigned long long)max_bytes), (dpuf_ar *)NULL;
    if (patience_ns == 0) return set_error("a patience of 0 ns: every wait a fault"), (dpuf_ar *)NULL;
    dpuf_ar *ar = (dpuf_ar *)calloc(1, sizeof *ar);
    if (ar == NULL) return set_error("out of host memory"), (dpuf_ar *)NULL;
    ar->device = device;
    ar->rank = rank;
    ar->ranks = ranks;
    ar->blocks = blocks;
    ar->max_bytes = max_bytes;
    ar->patience_ns = patience_ns;
    if (ar_setup(ar) != 0) {
        char why[sizeof g_last_error];
        memcpy(why, g_last_error, sizeof why);
        ar_release(ar);
        memcpy(g_last_error, why, sizeof why);
        return NULL;
    }
    return ar;
}

/* This rank's two IPC handles (its buffer's, its flags'), AR_HANDLE_BYTES, for
 * every other rank's dpuf_ar_open. */
int dpuf_ar_handles(dpuf_ar *ar, void *out) {
    if (ar == NULL || out == NULL) return set_error("ar or out is NULL"), -1;
    DPUF_CHECK(cudaSetDevice(ar->device));
    cudaIpcMemHandle_t h[2];
    DPUF_CHECK(cudaIpcGetMemHandle(&h[0], ar->buf));
    DPUF_CHECK(cudaIpcGetMemHandle(&h[1], ar->flags));
    memcpy(out, h, sizeof h);
    return 0;
}

int dpuf_ar_handle_bytes(void) { return (int)AR_HANDLE_BYTES; }

/* Every rank's handles, rank by rank (`ranks` x AR_HANDLE_BYTES; this rank's
 * own are skipped): the peers' buffers and flags mapped here, once. */
static int ar_open_peers(dpuf_ar *ar, const void *handles) {
    DPUF_CHECK(cudaSetDevice(ar->device));
    for (int32_t q = 0; q < ar->ranks; q++) {
        if (q == ar->rank) continue;
        cudaIpcMemHandle_t h[2];
        memcpy(h, (const uint8_t *)handles + (size_t)q * AR_HANDLE_BYTES, sizeof h);
        DPUF_CHECK(cudaIpcOpenMemHandle(&ar->peer_buf[q], h[0], cudaIpcMemLazyEnablePeerAccess));
        DPUF_CHECK(cudaIpcOpenMemHandle((void **)&ar->peer_flags[q], h[1], cudaIpcMemLazyEnablePeerAccess));
    }
    return 0;
}

int dpuf_ar_open(dpuf_ar *ar, const void *handles) {
    if (ar == NULL || handles == NULL) return set_error("ar or handles is NULL"), -1;
    if (ar->opened) return set_error("the peers are open already"), -1;
    if (ar_open_peers(ar, handles) != 0) {
        /* What was mapped is unmapped again: a later open starts clean. */
        for (int32_t q = 0; q < ar->ranks; q++) {
            if (q == ar->rank) continue;
            if (ar->peer_buf[q]) DPUF_NOTE(cudaIpcCloseMemHandle(ar->peer_buf[q]));
            if (ar->peer_flags[q]) DPUF_NOTE(cudaIpcCloseMemHandle(ar->peer_flags[q]));
            ar->peer_buf[q] = NULL;
            ar->peer_flags[q] = NULL;
        }
        return -1;
    }
    ar->opened = true;
    return 0;
}

/* One call on `stream`: n elements of `dtype` (DPUF_AR_*) from `in` into `out`
 * (both this device's), one-shot or two-shot. Every rank makes the same calls
 * in the same order, with the same n, dtype and shot. */
int dpuf_ar_run(dpuf_ar *ar, const void *in, void *out, int64_t n, int32_t dtype, int32_t two_shot, void *stream) {
    if (ar == NULL || !ar->opened) return set_error("the peers are not open (dpuf_ar_open)"), -1;
    if (dtype != DPUF_AR_F32 && dtype != DPUF_AR_BF16) return set_error("dtype %d", dtype), -1;
    const uint64_t bytes = (uint64_t)n * (dtype == DPUF_AR_BF16 ? 2u : 4u);
    if (n < 0 || bytes > ar->max_bytes)
        return set_error("%lld elements: %llu bytes, more than the %llu staged", (long long)n,
                         (unsigned long long)bytes, (unsigned long long)ar->max_bytes), -1;
    const cudaStream_t s = (cudaStream_t)stream;
    DPUF_CHECK(cudaSetDevice(ar->device)); /* the caller's thread may have another current */
    ar_args a;
    /* The epoch is the kernel's, from a.epochs: 0 here. */
    a.call = dpuf_ar_call_of(ar->rank, ar->ranks, dtype, two_shot, n, ar->blocks, 0, ar->peer_buf, ar->peer_flags,
                             out, ar->fault, ar->fault_host_dev, ar->patience_ns);
    a.epochs = ar->epochs;
    if (bytes) DPUF_CHECK(cudaMemcpyAsync(ar->buf, in, bytes, cudaMemcpyDeviceToDevice, s));
    allreduce_kernel<<<ar->blocks, AR_THREADS, 0, s>>>(a);
    DPUF_CHECK(cudaGetLastError());
    return 0;
}

/* The rank's first fault (allreduce.h's DPUF_AR_FAULT | phase << 8 | peer), 0
 * for none: read from host memory, no sync. Once raised it stays. */
uint32_t dpuf_ar_fault(dpuf_ar *ar) {
    if (ar == NULL) return 0;
    return __atomic_load_n(ar->fault_host, __ATOMIC_ACQUIRE);
}

void dpuf_ar_destroy(dpuf_ar *ar) {
    if (ar == NULL) return;
    DPUF_NOTE(cudaSetDevice(ar->device));
    ar_release(ar);
}

} /* extern "C" */
