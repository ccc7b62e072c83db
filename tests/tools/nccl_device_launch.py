"""Can a CUDA graph holding an NCCL all-reduce launch from the device? (issue 27: the
collective inside the step graphs that the GPU scheduler launches from the GPU.)

Each rank a process on its own GPU over NCCL (``torch.distributed``), an all-reduce
captured in a graph kept for instantiation (``torch.cuda.CUDAGraph(keep_graph=True)``,
as ``model/gpu_scheduler.py`` keeps the step graphs), then, through the CUDA runtime:

- the graph's node types (``cudaGraphGetNodes``, ``cudaGraphNodeGetType``): device
  launch takes kernel, memcpy, memset and child-graph nodes alone (CUDA Programming
  Guide, "Device Graph Requirements"; ../shared/GPU.md has what the project's H100
  refused);
- ``cudaGraphInstantiateWithParams`` with ``cudaGraphInstantiateFlagDeviceLaunch``, as
  ``scheduler.cu``'s ``device_exec`` does, and the upload; on a refusal its result
  code and the refused node's type;
- the graph replayed from the host, its sum checked, so that a graph that instantiates
  is also one that adds.

Once for each setting of ``NCCL_GRAPH_MIXING_SUPPORT`` (NCCL's default, 1, inserts an
external event wait and record around each captured collective, which device launch
refuses; 0 leaves them out: NCCL's src/misc/strongstream.cc), each in processes of its
own since NCCL reads it at start, and with ``NCCL_P2P_USE_CUDA_MEMCPY=1`` (proxy work:
a host node) as the case that must be refused.

    python -m tests.tools.nccl_device_launch              # 2 GPUs
    python -m tests.tools.nccl_device_launch --ranks 4 --json out.json

It needs PyTorch with NCCL and as many GPUs as ranks. docs/gpu.md ("Issue 27: NCCL in
device-launched graphs") has what it gave.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.tools.cpu_tensor_parallel import free_port

#: cudaGraphNodeType's values (driver_types.h), by name.
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait-event", 7: "event-record", 8: "ext-semaphore-signal",
              9: "ext-semaphore-wait", 10: "mem-alloc", 11: "mem-free", 12: "batch-mem-op",
              13: "conditional"}
#: The kinds of node a device-launched graph may hold.
DEVICE_LAUNCHABLE = {"kernel", "memcpy", "memset", "graph"}
#: cudaGraphInstantiateFlagDeviceLaunch.
DEVICE_LAUNCH = 4
#: The settings tried: (name, environment).
SETTINGS: list[tuple[str, dict[str, str]]] = [
    ("NCCL's default (graph mixing on)", {}),
    ("NCCL_GRAPH_MIXING_SUPPORT=0", {"NCCL_GRAPH_MIXING_SUPPORT": "0"}),
    ("NCCL_GRAPH_MIXING_SUPPORT=0, NCCL_P2P_USE_CUDA_MEMCPY=1",
     {"NCCL_GRAPH_MIXING_SUPPORT": "0", "NCCL_P2P_USE_CUDA_MEMCPY": "1"}),
]


class InstantiateParams(ctypes.Structure):
    """cudaGraphInstantiateParams (driver_types.h)."""

    _fields_ = [("flags", ctypes.c_ulonglong), ("uploadStream", ctypes.c_void_p),
                ("errNode_out", ctypes.c_void_p), ("result_out", ctypes.c_int)]


def cudart() -> ctypes.CDLL:
    """The CUDA runtime that torch has loaded (its soname, found among the process's
    libraries first)."""
    major = int((torch.version.cuda or "0").split(".")[0])
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no CUDA runtime library to call (libcudart)")


def node_types(rt: ctypes.CDLL, graph: int) -> list[str]:
    count = ctypes.c_size_t(0)
    check(rt, rt.cudaGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)),
          "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(rt, rt.cudaGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)),
          "cudaGraphGetNodes")
    types = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        check(rt, rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)),
              "cudaGraphNodeGetType")
        types.append(NODE_TYPES.get(kind.value, str(kind.value)))
    return types


def check(rt: ctypes.CDLL, err: int, what: str) -> None:
    if err != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {rt.cudaGetErrorString(err).decode()} ({err})")


def device_launch(rt: ctypes.CDLL, graph: int, stream: int) -> dict[str, Any]:
    """The graph instantiated for device launch and uploaded, or why not."""
    params = InstantiateParams(flags=DEVICE_LAUNCH)
    exec_ = ctypes.c_void_p()
    err = rt.cudaGraphInstantiateWithParams(ctypes.byref(exec_), ctypes.c_void_p(graph),
                                            ctypes.byref(params))
    if err != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        refused: dict[str, Any] = {"instantiated": False, "error": err,
                                   "message": rt.cudaGetErrorString(err).decode(),
                                   "result": params.result_out}
        if params.errNode_out:
            kind = ctypes.c_int(-1)
            rt.cudaGraphNodeGetType(ctypes.c_void_p(params.errNode_out), ctypes.byref(kind))
            refused["refused_node"] = NODE_TYPES.get(kind.value, str(kind.value))
        rt.cudaGetLastError()  # the refusal is not left for torch's next call to find
        return refused
    upload = rt.cudaGraphUpload(exec_, ctypes.c_void_p(stream))
    rt.cudaGraphExecDestroy(exec_)
    return {"instantiated": True, "uploaded": upload == 0, "upload_error": upload}


def rank_main(rank: int, size: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, device_id=torch.device("cuda", rank))
    rt = cudart()
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)  # NCCL's communicator and buffers, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=side):
        dist.all_reduce(x)
    raw = int(graph.raw_cuda_graph())
    types = node_types(rt, raw)
    launch = device_launch(rt, raw, side.cuda_stream)
    total = size * (size + 1) // 2
    x.fill_(float(rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    report = {"rank": rank, "nodes": types,
              "device_launchable_types": all(t in DEVICE_LAUNCHABLE for t in types),
              "device_launch": launch, "replayed_sum_right": bool((x == total).all())}
    all_reports: list[Any] = [None] * size
    dist.all_gather_object(all_reports, report)
    if rank == 0:
        Path(out).write_text(json.dumps(all_reports))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every rank's findings here")
    parser.add_argument("--child", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one setting's ranks, in this process's environment
        mp.spawn(rank_main, (args.ranks, free_port(), args.child), nprocs=args.ranks)
        return 0
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"{args.ranks} ranks need {args.ranks} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{args.ranks} x {torch.cuda.get_device_name(0)}")
    found: dict[str, Any] = {}
    for name, env in SETTINGS:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"nccl-device-launch-{os.getpid()}.json"
        child = subprocess.run(
            [sys.executable, "-m", "tests.tools.nccl_device_launch", "--ranks",
             str(args.ranks), "--child", str(out)], env={**os.environ, **env},
            capture_output=True, text=True, timeout=300, check=False)
        if child.returncode != 0 or not out.exists():
            found[name] = {"failed": child.returncode, "stderr": child.stderr[-3000:]}
            print(f"{name}: the ranks failed (rc {child.returncode})\n{child.stderr[-3000:]}")
            continue
        reports = json.loads(out.read_text())
        out.unlink()
        found[name] = reports
        first = reports[0]
        launch = first["device_launch"]
        verdict = ("instantiates for device launch and uploads" if launch["instantiated"]
                   and launch["uploaded"] else
                   f"refused: {launch.get('message')} (result {launch.get('result')}, "
                   f"node {launch.get('refused_node', '?')})")
        same = all(r["nodes"] == first["nodes"] and r["device_launch"] == launch
                   for r in reports)
        print(f"{name}: nodes {first['nodes']}; {verdict}; replayed sum right on every "
              f"rank: {all(r['replayed_sum_right'] for r in reports)}"
              + ("" if same else "; the ranks differ: see the JSON"))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
