/*
 * cuda_driver.cuh: the host code both persistent kernels' libraries share
 * (peer_kernel.cu, scheduler.cu), beside cuda_host.cuh's error handling:
 *   - the CUDA driver API entry points they need, resolved through the
 *     runtime (the libraries then load on any machine with the driver,
 *     without a libcuda stub to link), and DPUF_CHECK's CUresult checker;
 *   - the device query (device_info.h): GPUDirect RDMA support and write
 *     ordering, dma-buf export, for the launcher to refuse a device before
 *     anything is allocated on it;
 *   - the ring region: host memory (the shm transport's mapping) registered
 *     with the GPU, or GPU memory for a NIC to register (dma-buf or
 *     nvidia-peermem, dpu_frontend/gpu/registration.py).
 * Include after cuda_host.cuh.
 */
#ifndef DPUF_CUDA_DRIVER_CUH
#define DPUF_CUDA_DRIVER_CUH

#ifndef DPUF_CUDA_HOST_CUH
#error "include cuda_host.cuh before cuda_driver.cuh"
#endif

#include "device_info.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* A GPU region is allocated in whole 2 MiB pages: a dma-buf export covers
 * whole pages. */
#define GPU_REGION_GRANULE (2ull << 20)

/* ---- the driver API ------------------------------------------------------- */

typedef CUresult (*pfn_cuInit)(unsigned int);
typedef CUresult (*pfn_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*pfn_cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*pfn_cuPointerSetAttribute)(const void *, CUpointer_attribute, CUdeviceptr);
typedef CUresult (*pfn_cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, CUmemRangeHandleType,
                                                      unsigned long long);
typedef CUresult (*pfn_cuGetErrorName)(CUresult, const char **);

struct driver_api {
    bool ok;
    char error[256];
    pfn_cuInit cuInit;
    pfn_cuDeviceGet cuDeviceGet;
    pfn_cuDeviceGetAttribute cuDeviceGetAttribute;
    pfn_cuPointerSetAttribute cuPointerSetAttribute;
    pfn_cuMemGetHandleForAddressRange cuMemGetHandleForAddressRange;
    pfn_cuGetErrorName cuGetErrorName;
};

static inline bool resolve(driver_api *d, const char *symbol, void **fn, unsigned int version) {
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, fn, version, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == NULL) {
        snprintf(d->error, sizeof d->error, "driver entry point %s not found: %s (query result %d)", symbol,
                 cudaGetErrorString(e), (int)q);
        return false;
    }
    return true;
}

static inline driver_api load_driver_api(void) {
    driver_api d;
    memset(&d, 0, sizeof d);
    d.ok = resolve(&d, "cuInit", (void **)&d.cuInit, 12000) &&
           resolve(&d, "cuDeviceGet", (void **)&d.cuDeviceGet, 12000) &&
           resolve(&d, "cuDeviceGetAttribute", (void **)&d.cuDeviceGetAttribute, 12000) &&
           resolve(&d, "cuPointerSetAttribute", (void **)&d.cuPointerSetAttribute, 12000) &&
           resolve(&d, "cuMemGetHandleForAddressRange", (void **)&d.cuMemGetHandleForAddressRange, 12000) &&
           resolve(&d, "cuGetErrorName", (void **)&d.cuGetErrorName, 12000);
    return d;
}

/* The table, resolved once (C++ guarantees a thread-safe static init). */
static inline const driver_api *driver(void) {
    static const driver_api api = load_driver_api();
    if (!api.ok) set_error("%s", api.error);
    return api.ok ? &api : NULL;
}

/* DPUF_CHECK's checker for the driver API's results (cuda_host.cuh has the
 * runtime's). */
static inline bool cuda_ok(CUresult r, const char *call, int line) {
    if (r == CUDA_SUCCESS) return true;
    const char *name = NULL;
    const driver_api *d = driver();
    if (d == NULL || d->cuGetErrorName(r, &name) != CUDA_SUCCESS) name = NULL;
    set_error("%s failed (%s:%d): %s (CUresult %d)", call, DPUF_SOURCE, line, name ? name : "unknown error", (int)r);
    return false;
}

/* ---- the device query ----------------------------------------------------- */

static inline int device_info_get(int32_t device, dpuf_device_info *out) {
    if (out == NULL) return set_error("out is NULL"), -1;
    memset(out, 0, sizeof *out);
    const driver_api *drv = driver();
    if (!drv) return -1;
    DPUF_CHECK(drv->cuInit(0));
    CUdevice dev;
    DPUF_CHECK(drv->cuDeviceGet(&dev, device));
    cudaDeviceProp prop;
    DPUF_CHECK(cudaGetDeviceProperties(&prop, device));
    const size_t len = strnlen(prop.name, sizeof out->name - 1); /* truncated to fit, NUL-terminated */
    memcpy(out->name, prop.name, len);
    out->sm_count = prop.multiProcessorCount;
    out->major = prop.major;
    out->minor = prop.minor;
    int v = 0;
    DPUF_CHECK(drv->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev));
    out->gdr_writes_ordering = v;
    DPUF_CHECK(drv->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev));
    out->gdr_supported = v;
    DPUF_CHECK(drv->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev));
    out->dmabuf_supported = v;
    DPUF_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrCanMapHostMemory, device));
    out->can_map_host = v;
    return 0;
}

/* ---- the ring region ------------------------------------------------------ */

static inline bool range_inside(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

/* Where a library's ring region is. Host memory (host != NULL): registered
 * with cudaHostRegister(Mapped|Portable), the kernels reach it through its
 * mapped device pointer. GPU memory (host == NULL): allocated here for a NIC
 * to register. */
struct dpuf_region {
    uint64_t size;
    void *host;      /* the host mapping (host memory), else NULL */
    uint8_t *dev;    /* the region as the kernels address it */
    size_t alloc;    /* bytes allocated (GPU memory) */
    bool registered; /* host memory registered with the GPU */
};

/* The region of `size` bytes: `host`'s mapping, or GPU memory when host is
 * NULL. Call with the device current; region_release frees what it got. */
static inline int region_open(dpuf_region *r, int device, void *host, uint64_t size) {
    r->size = size;
    if (host != NULL) {
        int can_map = 0;
        DPUF_CHECK(cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device));
        if (!can_map) return set_error("device %d cannot map host memory", device), -1;
        r->host = host;
        DPUF_CHECK(cudaHostRegister(host, size, cudaHostRegisterMapped | cudaHostRegisterPortable));
        r->registered = true;
        DPUF_CHECK(cudaHostGetDevicePointer((void **)&r->dev, host, 0));
        return 0;
    }
    const driver_api *drv = driver();
    if (!drv) return -1;
    r->alloc = (size + GPU_REGION_GRANULE - 1) / GPU_REGION_GRANULE * GPU_REGION_GRANULE;
    DPUF_CHECK(cudaMalloc((void **)&r->dev, r->alloc));
    DPUF_CHECK(cudaMemset(r->dev, 0, r->alloc));
    /* Synchronous memory operations on it (region_write's copies) complete
     * before they return, whatever the NIC or the kernels do. */
    const unsigned int one = 1;
    DPUF_CHECK(drv->cuPointerSetAttribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, (CUdeviceptr)r->dev));
    return 0;
}

/* Best effort, as the libraries' other releases: a failure is recorded and
 * the rest still goes. Only once the kernels have stopped. */
static inline void region_release(dpuf_region *r) {
    if (r->registered) DPUF_NOTE(cudaHostUnregister(r->host));
    if (r->host == NULL && r->dev) DPUF_NOTE(cudaFree(r->dev));
    memset(r, 0, sizeof *r);
}

/* Copy bytes into the region: a host memcpy, or a cudaMemcpy into GPU memory
 * (call with the device current). */
static inline int region_write(const dpuf_region *r, uint64_t offset, const void *data, uint64_t n) {
    if (!range_inside(offset, n, r->size))
        return set_error("write [%llu, +%llu) lies outside the region (%llu bytes)", (unsigned long long)offset,
                         (unsigned long long)n, (unsigned long long)r->size), -1;
    if (n == 0) return 0;
    if (r->host != NULL) {
        memcpy((uint8_t *)r->host + offset, data, n);
        return 0;
    }
    /* Legacy default stream: it does not wait for the non-blocking streams
     * of the persistent kernels. */
    DPUF_CHECK(cudaMemcpy(r->dev + offset, data, n, cudaMemcpyHostToDevice));
    return 0;
}

/* A dma-buf fd for a GPU region (cuMemGetHandleForAddressRange), and the
 * region's offset in it (call with the device current). */
static inline int region_dmabuf_fd(const dpuf_region *r, int32_t *fd, uint64_t *offset) {
    if (r->host != NULL) return set_error("the region is host memory"), -1;
    const driver_api *drv = driver();
    if (!drv) return -1;
    int handle = -1;
    DPUF_CHECK(drv->cuMemGetHandleForAddressRange(&handle, (CUdeviceptr)r->dev, r->alloc,
                                                  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
    *fd = handle;
    *offset = 0;
    return 0;
}

#endif /* DPUF_CUDA_DRIVER_CUH */
