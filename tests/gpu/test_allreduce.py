"""Tensor parallelism's all-reduce over NVLink peer memory (``gpu/allreduce.cu``,
``layers.collective.PeerMemoryGroup``) on 2 and 4 GPUs, each rank a process: its bits
equal ``GatheredGroup``'s (NCCL's all-gather, then the rank-order sum) for bfloat16 and
float32 messages from one element to 4 MiB, one-shot and two-shot, eager and replayed
from a CUDA graph (the epochs live in GPU memory, so a replay is a new call). Needs a
machine with 2 GPUs (4 for the 4-rank case); ``CUDA_VISIBLE_DEVICES`` as it comes."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpu_frontend.gpu.runtime import ALLREDUCE, build, default_build_dir
from dpu_frontend.model.layers.collective import GatheredGroup, PeerMemoryGroup

pytestmark = pytest.mark.gpu

#: Elements: one, odd sizes that cut unevenly into the ranks and blocks, and sizes on
#: both sides of the one-shot bound (256 KiB).
SIZES = (1, 7, 4099, 65_536, 131_073, 1 << 20)
MAX_BYTES = 4 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def rank_main(rank: int, size: int, port: int, library: str, result: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # KINDS.md: NVLink multicast stays off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        reference = GatheredGroup()
        peer = PeerMemoryGroup(Path(library), MAX_BYTES)
        checked = 0
        for dtype in (torch.bfloat16, torch.float32):
            for n in SIZES:
                if n * torch.finfo(dtype).bits // 8 > MAX_BYTES:
                    continue
                g = torch.Generator(device="cuda").manual_seed(1000 * rank + n)
                x = torch.randn(n, device="cuda", generator=g).to(dtype) * 3
                assert torch.equal(bits(peer.all_reduce(x)), bits(reference.all_reduce(x))), \
                    (dtype, n)
                checked += 1
        # Replayed from a graph: each replay a new call, its input rewritten in place.
        x = torch.empty(4099, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x.normal_()
            peer.all_reduce(x)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = peer.all_reduce(x)
        for replay in range(3):
            x.copy_(torch.randn(4099, device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(
                                    rank * 10 + replay)).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(reference.all_reduce(x)))
            checked += 1
        dist.barrier()
        peer.close()
        result[rank] = checked
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_the_peer_memory_all_reduce_gives_the_gathered_sums_bits(size: int) -> None:
    if torch.cuda.device_count() < size:
        pytest.skip(f"{size} ranks need {size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")
    library = str(build(default_build_dir(), ALLREDUCE, arch="sm_90"))
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(rank_main, args=(size, free_port(), library, result), nprocs=size)
        assert dict(result) == {r: 2 * len(SIZES) + 3 for r in range(size)}
    print(f"{size} ranks: the peer-memory all-reduce gave the gathered rank-order sum's "
          f"bits for {2 * len(SIZES)} messages and 3 graph replays")
