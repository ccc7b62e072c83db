"""GPU tests need a CUDA GPU and nvcc: the CUDA peer is built and run for real.

Run them on a GPU machine with ``pytest -m gpu tests/gpu`` (docs/gpu.md gives the
whole command, as run through the device tool). Without a GPU they skip, unless
DPU_FRONTEND_REQUIRE_GPU=1: then a missing GPU is a failure. CI has no GPU and
does not collect them (``-m "not rdma and not gpu"``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.runtime import find_nvcc

#: The model engine's tests import torch, Triton and transformers at the top; where
#: those are missing (CI) they are not even collected, unless GPU tests are required.
_MODEL_STACK = ("torch", "triton", "transformers", "numpy")
if os.environ.get("DPU_FRONTEND_REQUIRE_GPU") != "1" and not all(
        importlib.util.find_spec(m) for m in _MODEL_STACK):
    collect_ignore = ["test_model.py", "test_model_serving.py", "test_record_writer.py",
                      "test_gpu_scheduler.py"]


@pytest.fixture(scope="session", autouse=True)
def cuda_gpu() -> None:
    problem = None
    try:
        find_nvcc()
    except StartupError as exc:
        problem = str(exc)
    if problem is None:
        smi = shutil.which("nvidia-smi")
        if smi is None or subprocess.run([smi, "-L"], capture_output=True, check=False).returncode:
            problem = "no NVIDIA GPU (nvidia-smi -L failed)"
    if problem is None:
        return
    if os.environ.get("DPU_FRONTEND_REQUIRE_GPU") == "1":
        pytest.fail(f"GPU tests required but: {problem}")
    pytest.skip(f"no CUDA GPU: {problem}")
