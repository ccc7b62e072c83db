"""A step graph as the host loop replays it, against the same graph instantiated for
device launch, as the GPU scheduler instantiates it (``cudaGraphInstantiateFlagDeviceLaunch``),
both launched from the host on one stream.

The GPU scheduler's steps at Qwen3-8B's shapes read 0.7 ms (6%) longer than the host
loop's at the same batch (docs/gpu.md, "Issue 24, ninth step"). Its graphs differ from
the host loop's in two ways: they are instantiated for device launch, and they are
tail-launched from the scheduler kernel. This benchmark times the first alone: the
decode step's forward graph (``--model-config``'s shapes, random weights, a batch of
``--context``-token sequences, as ``benchmarks.model_step`` builds it) replayed through
torch (host instantiation), and the same ``cudaGraph_t`` instantiated for device launch
and uploaded, launched with ``cuGraphLaunch``. Graphs of ``--reps`` back-to-back launches
are timed by CUDA events, median of ``--iters``; the bound (weights and KV bytes over the
copy bandwidth measured in the same run) is printed beside them.

    python -m benchmarks.device_launch --model-config benchmarks/configs/qwen3-8b.json --batch 1 64 256
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import record
from benchmarks.model_figures import Precision, describe, load_config, step_bytes
from benchmarks.model_step import copy_bandwidth, decode_batch
from dpu_frontend.model.blocks import BlockPool
from dpu_frontend.model.layers.attention import ATTN_ROWS
from dpu_frontend.model.metadata import step_inputs
from dpu_frontend.model.options import RunnerOptions
from dpu_frontend.model.runner import ModelRunner

#: CUDA's ``CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH``.
DEVICE_LAUNCH = 4


class Driver:
    """The three driver calls this needs, from ``libcuda`` (torch's context is current)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def device_launch_exec(self, graph: int, stream: int) -> ctypes.c_void_p:
        exec_ = ctypes.c_void_p()
        self.check("cuGraphInstantiateWithFlags", ctypes.byref(exec_), ctypes.c_void_p(graph),
                   ctypes.c_ulonglong(DEVICE_LAUNCH))
        self.check("cuGraphUpload", exec_, ctypes.c_void_p(stream))
        return exec_

    def launch(self, exec_: ctypes.c_void_p, stream: int) -> None:
        self.check("cuGraphLaunch", exec_, ctypes.c_void_p(stream))


def median_ms(launch: Callable[[], None], reps: int, iters: int) -> float:
    """Milliseconds a launch, median over ``iters`` runs of ``reps`` back to back."""
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", type=Path, metavar="FILE",
                    help="an HF config.json (default: Qwen3-0.6B's shapes)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10, help="launches a timed run holds")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    config, origin = load_config(args.model_config)
    biggest = max(args.batch)
    runner = ModelRunner(config, RunnerOptions(max_seqs=biggest,
                                               max_model_len=args.context + 64))
    runner.load(keep_graphs=True)
    assert runner.graphs is not None
    driver = Driver()
    bandwidth = copy_bandwidth(runner.device)
    precision = Precision.of_flags("none", "auto", torch.finfo(runner.dtype).bits // 8)
    figures: dict[str, object] = {
        "device": torch.cuda.get_device_name(runner.device), "model config": origin,
        "model": describe(config),
        "copy bandwidth (bare limit), GB/s": round(bandwidth / 1e9, 1)}
    stream = torch.cuda.current_stream()
    for size in args.batch:
        batch = decode_batch(runner, BlockPool(runner.num_blocks, runner.options.block_size),
                             size, args.context)
        inputs = step_inputs(batch, runner.options.block_size, ATTN_ROWS // config.group_size)
        graph = runner.graphs.graph_for(inputs)
        if graph is None:
            raise SystemExit(f"no captured graph holds a decode batch of {size}")
        graph.load(inputs, runner.graphs.scratch_slot)
        exec_ = driver.device_launch_exec(graph.graph.raw_cuda_graph(), stream.cuda_stream)
        host, device = [], []
        for _ in range(2):  # alternated, so that both see the same machine
            host.append(median_ms(graph.graph.replay, args.reps, args.iters))
            device.append(median_ms(partial(driver.launch, exec_, stream.cuda_stream),
                                    args.reps, args.iters))
        weights, kv = step_bytes(config, size, args.context + 1, precision, None)
        figures[f"batch {size} (graph of {graph.shape.seqs} sequences): forward, ms: host "
                f"instantiation / device-launch instantiation"] = (
            f"{min(host):.3f} / {min(device):.3f} ({min(device) / min(host):.3f}x)")
        figures[f"batch {size}: bound, ms"] = round((weights + kv) / bandwidth * 1e3, 3)
        driver.check("cuGraphExecDestroy", exec_)
    record("device_launch", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
