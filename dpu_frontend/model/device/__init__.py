"""The model engine's device code, beside its Python twins.

``record_writer.*`` publishes a step's records from the GPU (its Python twin and
host driver: ``dpu_frontend.model.publish``); ``sched_core.h`` is the continuous
batching of ``dpu_frontend.model.scheduler`` in C, which ``scheduler.cu`` runs
inside the GPU (``--scheduler gpu``, driven by ``dpu_frontend.model.gpu_scheduler``)
and ``sched_host.c`` builds for the host (``sched_core.py``, the CI tests). They
include the ring's device side from ``dpu_frontend/gpu``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from dpu_frontend.gpu.runtime import CudaSources
from dpu_frontend.gpu.runtime import source_dir as ring_dir


def source_dir() -> Path:
    return Path(str(files("dpu_frontend.model.device")))


_DIRS = (source_dir(), ring_dir())
#: The record writer (``dpu_frontend.model.publish``).
RECORDS = CudaSources("libdpuf_records", "record_writer.cu",
                      ("record_writer.h", "record_writer.cuh", "cuda_host.cuh", "ring_protocol.h"),
                      _DIRS)
#: The scheduler inside the GPU (``dpu_frontend.model.gpu_scheduler``): device graph launch
#: needs the device runtime, so relocatable device code and libcudadevrt.
SCHEDULER = CudaSources("libdpuf_sched", "scheduler.cu",
                        ("scheduler.h", "sched_core.h", "record_writer.cuh", "record_writer.h",
                         "automaton_pool.cuh", "ring_device.cuh", "cuda_host.cuh", "cuda_driver.cuh",
                         "device_info.h", "ring_protocol.h"),
                        _DIRS, flags=("-rdc=true", "-lcudadevrt"))
#: The scheduler's core built for the host (``sched_core.py``, the tests).
SCHED_HOST = CudaSources("libdpuf_sched_host", "sched_host.c", ("sched_core.h",), _DIRS)
