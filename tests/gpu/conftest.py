"""GPU tests need a CUDA GPU and nvcc: the CUDA peer is built and run for real.

Run them on a GPU machine with ``pytest -m gpu tests/gpu`` (docs/gpu.md gives the
whole command, as run through the device tool). Without a GPU they skip, unless
DPU_FRONTEND_REQUIRE_GPU=1: then a missing GPU is a failure. CI has no GPU and
does not collect them (``-m "not rdma and not gpu"``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.runtime import find_nvcc
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary
from tests.stack import Stack

#: The model engine's tests import torch, Triton and transformers at the top; where
#: those are missing (CI) they are not even collected, unless GPU tests are required.
_MODEL_STACK = ("torch", "triton", "transformers", "numpy", "cupy")
if os.environ.get("DPU_FRONTEND_REQUIRE_GPU") == "1" or all(
        importlib.util.find_spec(m) for m in _MODEL_STACK):
    import torch

    from dpu_frontend.model.runner import ModelRunner
else:
    collect_ignore = ["test_attention.py", "test_constrained.py", "test_linear.py", "test_fp8.py",
                      "test_llama.py", "test_llama_serving.py", "test_moe.py", "test_qk_norm_rope.py",
                      "test_model.py", "test_model_serving.py", "test_record_writer.py",
                      "test_gpu_scheduler.py", "test_gpu_region.py", "test_race.py",
                      "test_tensor_parallel.py", "test_allreduce.py"]


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


@pytest.fixture(scope="module")
def offline(request: pytest.FixtureRequest) -> Iterator[ModelEngine]:
    """The host-driven engine in the test process, on the peer's weights (the module's
    ``SEED``) and with the module's ``OFFLINE`` runner sizes: what an answer through the
    daemon must equal, token for token. Its own KV cache sits beside the peer's; its
    memory is given back after the module."""
    config = ModelConfig.default()
    vocab = Vocabulary.load(default_tokenizer_dir())
    runner = ModelRunner(config, RunnerOptions(weight_seed=request.module.SEED,
                                               vocab_limit=vocab.tokenizer.get_vocab_size(),
                                               **request.module.OFFLINE))
    runner.load()
    yield ModelEngine(config, runner, EngineOptions())
    del runner
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def smollm2_reference() -> Iterator[Any]:
    """transformers' own reading of SmolLM2's GGUF file (``gguf_file=``, float32, on the
    GPU): its dequantizers, its un-permutation of Q and K, its tied head."""
    import transformers

    from tests.assets import smollm2_gguf

    path = smollm2_gguf()
    model: Any = transformers.LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    yield model.to("cuda").eval()
    del model
    torch.cuda.empty_cache()


HEALTHY_WITHIN_S = 600


@pytest.fixture
def healthy() -> Callable[[Stack], Awaitable[None]]:
    """``await healthy(stack)``: until the daemon's ``/health`` answers 200 (a restarted
    peer attached again; a model peer loads and captures first: ten minutes at most)."""

    async def wait(stack: Stack) -> None:
        async with aiohttp.ClientSession() as session, asyncio.timeout(HEALTHY_WITHIN_S):
            while True:
                async with session.get(f"{stack.base_url}/health") as health:
                    if health.status == 200:
                        return
                await asyncio.sleep(0.05)

    return wait
