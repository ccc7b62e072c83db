/*
 * device_info.h: what the persistent kernels' libraries report of a GPU
 * before anything is allocated on it (dpuf_device_info_get in
 * libdpuf_peer.so, dpuf_model_device_info_get in libdpuf_sched.so): enough
 * to refuse a device the ring protocol's ordering rules cannot hold on, or
 * whose memory no NIC can register (dpu_frontend/gpu/registration.py).
 *
 * The Python side mirrors it (gpu/library.py, DeviceInfo); CI compiles this
 * header with a C compiler and checks the mirror's offsets against it.
 */
#ifndef DPUF_DEVICE_INFO_H
#define DPUF_DEVICE_INFO_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dpuf_device_info {
    char name[96];                 /*   0 */
    int32_t sm_count;              /*  96 */
    int32_t major;                 /* 100 compute capability */
    int32_t minor;                 /* 104 */
    int32_t gdr_writes_ordering;   /* 108 CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING */
    int32_t gdr_supported;         /* 112 CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED */
    int32_t dmabuf_supported;      /* 116 CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED */
    int32_t can_map_host;          /* 120 cudaDevAttrCanMapHostMemory */
    int32_t reserved;              /* 124 */
} dpuf_device_info;

#ifdef __cplusplus
}
#endif

#endif /* DPUF_DEVICE_INFO_H */
