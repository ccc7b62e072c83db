/*
 * cuda_host.cuh: the host-side error handling the CUDA libraries share
 * (peer_kernel.cu, record_writer.cu, scheduler.cu). Each library is its own
 * translation unit and keeps its own last error; define DPUF_SOURCE (the
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

static inline void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static inline uint64_t monotonic_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif /* DPUF_CUDA_HOST_CUH */
