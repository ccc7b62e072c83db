/*
 * peer_order.h: what the protocols over peer memory (allreduce.h, step_relay.h)
 * share, for both sides: a word stored with release and loaded with acquire at
 * system scope (the GPU's PTX; the host build's C11 atomics), a clock in ns, a
 * pause in a wait, and a block's threads, which on the GPU meet at a barrier
 * after each fencing its writes at system scope (on the host one thread is the
 * block).
 */
#ifndef DPUF_PEER_ORDER_H
#define DPUF_PEER_ORDER_H

#include <stdint.h>

#ifdef __CUDACC__
#define DPUF_PEER_FN static inline __host__ __device__
#else
#define DPUF_PEER_FN static inline
#endif

#ifdef __CUDA_ARCH__
DPUF_PEER_FN void dpuf_peer_release(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DPUF_PEER_FN uint32_t dpuf_peer_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
DPUF_PEER_FN uint64_t dpuf_peer_now_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define DPUF_PEER_PAUSE() __nanosleep(100)
#define DPUF_PEER_THREAD ((int64_t)threadIdx.x)
#define DPUF_PEER_THREADS ((int64_t)blockDim.x)
#define DPUF_PEER_MEET()        \
    do {                        \
        __threadfence_system(); \
        __syncthreads();        \
    } while (0)
/* Thread 0's word for the whole block (in shared memory), read after this. */
#define DPUF_PEER_SHARE() __syncthreads()
#else
#include <sched.h>
#include <time.h>
DPUF_PEER_FN void dpuf_peer_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
DPUF_PEER_FN uint32_t dpuf_peer_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
DPUF_PEER_FN uint64_t dpuf_peer_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
/* The host build's ranks are threads that may outnumber the cores. */
#define DPUF_PEER_PAUSE() sched_yield()
#define DPUF_PEER_THREAD ((int64_t)0)
#define DPUF_PEER_THREADS ((int64_t)1)
#define DPUF_PEER_MEET() ((void)0)
#define DPUF_PEER_SHARE() ((void)0)
#endif

#endif /* DPUF_PEER_ORDER_H */
