/*
 * peer_kernel.h: the host API of the CUDA peer (libdpuf_peer.so).
 *
 * The Python launcher (dpu_frontend/gpu/runtime.py) loads the library with
 * ctypes and mirrors dpuf_peer_params field by field; CI compiles this header
 * with a C compiler and checks the mirror's offsets against it.
 *
 * Life of a peer: dpuf_peer_create (allocates and registers memory, copies
 * the token corpus to the GPU) -> dpuf_peer_write_region (the layout record)
 * -> dpuf_peer_launch (the persistent kernel, once) -> mailbox commands from
 * the host (ATTACH/DETACH per channel, written through dpuf_peer_mailbox) ->
 * dpuf_peer_stop -> dpuf_peer_destroy. Every function returns 0 on success
 * and -1 on failure, with the reason in dpuf_last_error().
 */
#ifndef DPUF_PEER_KERNEL_H
#define DPUF_PEER_KERNEL_H

#include "device_info.h"
#include "ring_protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DPUF_MODE_REPLAY 0u
#define DPUF_MODE_ECHO 1u
#define DPUF_MAX_EOS 8u

typedef struct dpuf_peer_params {
    /* The region. region_host != NULL: host memory (the shm transport's
     * mapping), registered with cudaHostRegister(Mapped|Portable); the kernel
     * reaches it through the mapped device pointer. region_host == NULL: the
     * region is allocated in GPU memory (cudaMalloc) for RDMA registration. */
    void *region_host;             /*   0 */
    uint64_t region_size;          /*   8 */
    /* The channel table, as in the layout record (host copy). */
    const dpuf_channel_desc *channels; /* 16 */
    uint32_t channel_count;        /*  24 */
    /* The token source (docs/protocol.md, "The CUDA peer"). */
    uint32_t mode;                 /*  28 DPUF_MODE_* */
    const uint32_t *corpus;        /*  32 replay: documents, each followed by eos[0] */
    uint64_t corpus_len;           /*  40 tokens in corpus */
    const uint32_t *doc_starts;    /*  48 index of each document's first token */
    uint32_t doc_count;            /*  56 */
    uint32_t tokens_per_step;      /*  60 K: tokens per sequence per step (1 = GPU-like) */
    uint32_t eos[DPUF_MAX_EOS];    /*  64 */
    uint32_t eos_count;            /*  96 */
    uint32_t engine_blocks;        /* 100 0: one per SM, at most 132 */
    uint64_t step_ns;              /* 104 minimum engine step duration, 0: no pacing */
    uint64_t prefill_ns_per_token; /* 112 simulated prefill cost per prompt token */
    uint64_t heartbeat_ns;         /* 120 heartbeat period of the dedicated warp */
    int32_t device;                /* 128 CUDA device ordinal */
    /* Structured output, for channels with DPUF_FEATURE_CONSTRAINTS: the
     * tokenizer's vocabulary (every automaton is over it) and the bytes of GPU
     * memory that hold the automata, each with its states' distances; enough
     * for the largest automaton a channel takes. */
    uint32_t vocab;                /* 132 */
    uint64_t automaton_pool_bytes; /* 136 0: no channel takes automata */
} dpuf_peer_params;

typedef struct dpuf_peer dpuf_peer;

const char *dpuf_last_error(void);
/* The device as GPUDirect RDMA sees it (device_info.h), before any allocation. */
int dpuf_device_info_get(int32_t device, dpuf_device_info *out);
dpuf_peer *dpuf_peer_create(const dpuf_peer_params *params);
/* Copy bytes into the region (host memcpy, or cudaMemcpy for a GPU region). */
int dpuf_peer_write_region(dpuf_peer *peer, uint64_t offset, const void *data, uint64_t n);
/* The region as the GPU addresses it (for RDMA registration of a GPU region). */
uint64_t dpuf_peer_region_device_ptr(dpuf_peer *peer);
/* Host pointer to the mailbox area: one dpuf_kernel_block, then one
 * dpuf_mailbox per channel (pinned, mapped host memory). */
void *dpuf_peer_mailbox(dpuf_peer *peer);
/* A dma-buf fd for the GPU region (cuMemGetHandleForAddressRange). */
int dpuf_peer_dmabuf_fd(dpuf_peer *peer, int32_t *fd, uint64_t *offset);
int dpuf_peer_launch(dpuf_peer *peer);
/* 1 while the kernel runs, 0 once it returned; -1 with an error (a fault). */
int dpuf_peer_poll(dpuf_peer *peer);
/* Ask the kernel to return and wait for it at most timeout_ms. */
int dpuf_peer_stop(dpuf_peer *peer, uint32_t timeout_ms);
void dpuf_peer_destroy(dpuf_peer *peer);

#ifdef __cplusplus
}
#endif

#endif /* DPUF_PEER_KERNEL_H */
