"""Tensor parallelism's all-reduce over NVLink peer memory (``gpu/allreduce.cu``,
``layers.collective.PeerMemoryGroup``) on 2 and 4 GPUs, each rank a process: its bits
equal ``GatheredGroup``'s (NCCL's all-gather, then the rank-order sum) for bfloat16 and
float32 messages from one element to 4 MiB, one-shot and two-shot, eager, back to
back with each rank pausing at random (one ahead starts the next call while another
still reads), replayed from a CUDA graph (the epochs live in GPU memory, so a
replay is a new call); and a stalled rank ends the others' calls with a fault that
names it. Needs a machine with 2 GPUs (4 for the 4-rank case); ``CUDA_VISIBLE_DEVICES``
as it comes."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpu_frontend.gpu.runtime import ALLREDUCE, build, default_build_dir
from dpu_frontend.model.layers.collective import GatheredGroup, PeerMemoryGroup
from tests.tools.cpu_tensor_parallel import free_port

pytestmark = pytest.mark.gpu

#: Elements: one, odd sizes that cut unevenly into the ranks and blocks, and sizes on
#: both sides of the one-shot bound (256 KiB).
SIZES = (1, 7, 4099, 65_536, 131_073, 1 << 20)
MAX_BYTES = 4 << 20
DRIFTING = 40  # back-to-back calls with random pauses
REPLAYS = 3


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
        # Back to back, each rank pausing at random before each call, so that one ahead
        # starts the next call while another still reads this one's buffers: one-shot
        # and two-shot in turn (8 KiB, then 256 KiB and 2 bytes), checked afterwards.
        pause = random.Random(rank)
        xs, outs = [], []
        for k in range(DRIFTING):
            n = 4099 if k % 2 == 0 else 131_073
            xs.append(torch.randn(n, device="cuda", generator=torch.Generator(
                device="cuda").manual_seed(100 * rank + k)).to(torch.bfloat16))
            torch.cuda._sleep(pause.randrange(0, 2_000_000))
            outs.append(peer.all_reduce(xs[-1]))
        torch.cuda.synchronize()
        for x, out in zip(xs, outs, strict=True):
            assert torch.equal(bits(out), bits(reference.all_reduce(x)))
            checked += 1
        # Replayed from a graph, a one-shot call and a two-shot one: each replay new
        # calls (their epochs in GPU memory), the inputs rewritten in place.
        small = torch.zeros(4099, device="cuda", dtype=torch.bfloat16)
        large = torch.zeros(131_073, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            peer.all_reduce(small)  # warm-up outside the capture
            peer.all_reduce(large)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out_small, out_large = peer.all_reduce(small), peer.all_reduce(large)
        for replay in range(REPLAYS):
            for x in (small, large):
                x.copy_(torch.randn(x.numel(), device="cuda", generator=torch.Generator(
                    device="cuda").manual_seed(rank * 10 + replay)).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(out_small), bits(reference.all_reduce(small)))
            assert torch.equal(bits(out_large), bits(reference.all_reduce(large)))
            checked += 1
        dist.barrier()
        peer.close()
        result[rank] = checked
    finally:
        dist.destroy_process_group()


def need_gpus(size: int) -> None:
    """A test of ``size`` ranks, one a GPU, skips on a machine with fewer."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"{size} ranks need {size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")


def run_ranks(main: Any, size: int) -> dict[int, Any]:
    """``main(rank, size, port, library, result)`` on ``size`` ranks, a process a GPU,
    the library built here: what each rank put in ``result``."""
    need_gpus(size)
    library = str(build(default_build_dir(), ALLREDUCE, arch="sm_90"))
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(main, args=(size, free_port(), library, result), nprocs=size)
        return dict(result)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [2, 4])
def test_the_peer_memory_all_reduce_gives_the_gathered_sums_bits(size: int) -> None:
    assert run_ranks(rank_main, size) == {
        r: 2 * len(SIZES) + DRIFTING + REPLAYS for r in range(size)}
    print(f"{size} ranks: the peer-memory all-reduce gave the gathered rank-order sum's "
          f"bits for {2 * len(SIZES)} messages, {DRIFTING} drifting back-to-back calls and "
          f"{REPLAYS} graph replays of a one-shot and a two-shot call")


def stalled_rank_main(rank: int, size: int, port: int, library: str, result: Any) -> None:
    """Rank 1 makes no call (its kernel stopped, as it were): rank 0's call ends in its
    patience, and its fault word names rank 1 at READY; rank 1, which waited for no one,
    has none. (The host build's tests hold the rest: the fault stays, every rank's.)"""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        peer = PeerMemoryGroup(Path(library), MAX_BYTES, patience_s=0.5)
        x = torch.ones(4099, device="cuda", dtype=torch.bfloat16)
        if rank != 1:
            peer.all_reduce(x)
        torch.cuda.synchronize()  # ends: a stalled peer no longer hangs the call
        result[rank] = peer.fault()
        dist.barrier()
        peer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_stalled_rank_ends_the_others_calls_with_its_name() -> None:
    assert run_ranks(stalled_rank_main, 2) == {
        0: "rank 0's all-reduce waited past its patience for rank 1 at READY: that "
           "rank's kernel stopped or stalls",
        1: None}
