/*
 * cuda_host.cuh: the host-side error handling the CUDA libraries share
 * (peer_kernel.cu, record_writer.cu, scheduler.cu), and the stop-and-wait of
 * the persistent kernels (peer_kernel.cu, scheduler.cu). Each library is its
 * own translation unit and keeps its own last error; define DPUF_SOURCE (the
 * file's name, for the messages) before including.
 */
#ifndef DPUF_CUDA_HOST_CUH
#define DPUF_CUDA_HOST_CUH

#include <cuda_runtime.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#ifndef DPUF_SOURCE
#error "define DPUF_SOURCE before including cuda_host.cuh"
#endif

/* The message of the last failure, per calling thread (the library's last_error). */
static __thread char g_last_error[512];

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
}

/* One checker per API flavour (a library with the driver API adds the
 * CUresult one); DPUF_CHECK picks it by the result's type, as the
 * checkCudaErrors of NVIDIA's samples does, but reports instead of exiting:
 * a library must not kill its host process. */
static inline bool cuda_ok(cudaError_t e, const char *call, int line) {
    if (e == cudaSuccess) return true;
    set_error("%s failed (%s:%d): %s: %s", call, DPUF_SOURCE, line, cudaGetErrorName(e), cudaGetErrorString(e));
    return false;
}

/* In functions returning int: record the failure and return -1. */
#define DPUF_CHECK(call)                                      \
    do {                                                      \
        if (!cuda_ok((call), #call, __LINE__)) return -1;     \
    } while (0)

/* In cleanup paths: record the failure and go on releasing the rest. */
#define DPUF_NOTE(call) ((void)cuda_ok((call), #call, __LINE__))

/* 0: the stream's work is done, 1: still running, -1: an error (recorded). */
static inline int stream_state(cudaStream_t s) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return 0;
    if (e == cudaErrorNotReady) return 1;
    cuda_ok(e, "cudaStreamQuery", __LINE__);
    return -1;
}

/* 1: either stream still has work, 0: both done, -1: an error (recorded). */
static inline int streams_state(cudaStream_t a, cudaStream_t b) {
    const int sa = stream_state(a);
    if (sa < 0) return -1;
    const int sb = stream_state(b);
    if (sb < 0) return -1;
    return (sa || sb) ? 1 : 0;
}

static inline void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static inline uint64_t monotonic_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Ask the persistent kernels on streams a and b to return (`stop`, the
 * kernel block's stop word: a plain host store with release semantics, which
 * the kernels read with an acquire) and wait for both at most timeout_ms:
 * 0 once both returned, -1 on an error or the timeout (recorded). */
static inline int stop_streams(uint64_t *stop, cudaStream_t a, cudaStream_t b, uint32_t timeout_ms) {
    __atomic_store_n(stop, (uint64_t)1, __ATOMIC_RELEASE);
    const uint64_t deadline = monotonic_ms() + timeout_ms;
    for (;;) {
        const int s = streams_state(a, b);
        if (s <= 0) return s;
        if (monotonic_ms() >= deadline)
            return set_error("the kernels did not return within %u ms of the stop request", timeout_ms), -1;
        sleep_us(200);
    }
}

/* How long a library's destroy waits for kernels still running. */
#define DPUF_DESTROY_STOP_MS 2000u

/* Before a destroy frees a launched library's memory: false while its
 * kernels still run after a stop request of DPUF_DESTROY_STOP_MS. Freeing
 * their memory then would block on them (cudaFree synchronizes) or pull it
 * from under them: the caller leaks it instead. */
static inline bool kernels_stopped(uint64_t *stop, cudaStream_t a, cudaStream_t b) {
    return streams_state(a, b) != 1 || stop_streams(stop, a, b, DPUF_DESTROY_STOP_MS) == 0 ||
           streams_state(a, b) != 1;
}

#endif /* DPUF_CUDA_HOST_CUH */
