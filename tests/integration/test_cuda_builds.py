"""The CUDA sources compile with this machine's nvcc for sm_90, as the GPU machine
builds them, and the CUDA peer's library refuses parameters it cannot serve before it
touches a GPU. CI has nvcc and no GPU: the kernels themselves run on the GPU machine
(docs/gpu.md). Skipped where there is no nvcc."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dpu_frontend.config import PeerConfig
from dpu_frontend.gpu.launcher import CudaKernel
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig, automaton_pool_need
from dpu_frontend.gpu.runtime import (
    ALLREDUCE,
    PEER_SOURCES,
    CudaSources,
    PeerLibrary,
    build,
    find_nvcc,
)
from dpu_frontend.model.device import RECORDS, SCHEDULER

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file(),
    reason="no nvcc on this machine")

@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cuda-build")


@pytest.fixture(scope="module")
def peer_library(build_dir: Path) -> PeerLibrary:
    return PeerLibrary.load(build(build_dir, PEER_SOURCES, arch="sm_90", nvcc=find_nvcc()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sources", [PEER_SOURCES, RECORDS, SCHEDULER, ALLREDUCE],
                         ids=lambda s: s.library)
def test_each_cuda_library_builds_for_sm_90(build_dir: Path, sources: CudaSources) -> None:
    assert build(build_dir, sources, arch="sm_90", nvcc=find_nvcc()).stat().st_size > 0


def create_error(library: PeerLibrary, max_automaton_bytes: int = 4 << 20,
                 **fields: int) -> str:
    """What ``dpuf_peer_create`` says of the launcher's parameters for one channel of
    GPU_GEOMETRY's rings, ``fields`` changed in them as the C side sees them (it
    refuses, or fails at the missing GPU)."""
    geometry = replace(GPU_GEOMETRY, max_automaton_bytes=max_automaton_bytes)
    config = GpuPeerConfig(peer=PeerConfig(transport="shm", geometry=geometry))
    params = CudaKernel(config, [[5, 6, 7]], (0,), 151_936)._params(geometry.plan(instance=1), None)
    for name, value in fields.items():
        setattr(params, name, value)
    assert library.create(params) == 0  # no GPU here: never a peer
    return library.error()


#: Where a start that passed every check fails on a machine without a GPU.
NO_GPU = "cudaSetDevice(p->device) failed"


@pytest.mark.timeout(300)
def test_the_peer_refuses_an_automaton_pool_its_rings_overflow(peer_library: PeerLibrary) -> None:
    need = automaton_pool_need(4 << 20)
    assert "automaton_pool_bytes 5592320 < 5592448" in create_error(
        peer_library, automaton_pool_bytes=need - 128)
    assert "vocab and automaton_pool_bytes must be >= 1" in create_error(peer_library, vocab=0)
    # Enough (the launcher's default, and the least): the checks pass, the device fails.
    assert create_error(peer_library).startswith(NO_GPU)
    assert create_error(peer_library, automaton_pool_bytes=need).startswith(NO_GPU)
    # Rings without automata take no pool (the launcher passes none).
    assert create_error(peer_library, max_automaton_bytes=0).startswith(NO_GPU)
