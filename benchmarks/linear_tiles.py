"""Tile configurations of the engine's linear kernel, per weight shape, against the
bandwidth bound of reading the weight once (GPU time, from CUDA graphs).

The kernel must stay batch-invariant (dpu_frontend/model/layers): a
configuration is a candidate only when its output is **bit for bit** the
current configuration's, for every batch size tried, so that changing it
changes no token of any test. For each Qwen3-0.6B linear shape and batch
size (rows) the benchmark times every candidate (CUDA events, median of
``--iters``) and prints it beside the bound: the weight's bytes over the
copy bandwidth measured in the same run.

    python -m benchmarks.linear_tiles                    # bf16, batches 1 8 64 256
    python -m benchmarks.linear_tiles --json tiles.json  # every measurement
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import record
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers import linear

#: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages.
Tile = tuple[int, int, int, int, int]
CANDIDATES: list[Tile] = [
    (bm, bn, bk, w, s)
    for bm, bn, bk, w, s in itertools.product((64,), (32, 64, 128, 256), (64, 128), (4, 8),
                                              (3, 4, 5))
    if not (bn == 256 and bk == 128 and s == 5)  # beyond shared memory
]


def shapes(config: ModelConfig) -> dict[str, tuple[int, int, torch.dtype]]:
    """name: (N, K, output dtype) of every linear of a layer, and the LM head."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size, torch.bfloat16),
            "o_proj": (c.hidden_size, q, torch.bfloat16),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, torch.bfloat16),
            "down": (c.hidden_size, c.intermediate_size, torch.bfloat16),
            "lm_head": (c.vocab_size, c.hidden_size, torch.float32)}


def timed(call: Callable[[], object], iters: int, reps: int = 20) -> float:
    """Microseconds per call, GPU time only: ``reps`` calls captured in a CUDA graph
    (the engine replays its linears from graphs, so a launch costs nothing there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles, and settles the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3 / reps)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--shapes", nargs="+", choices=list(shapes(ModelConfig.default())),
                        help="only these linears (default: all)")
    parser.add_argument("--candidates", nargs="+", metavar="BMxBNxBKxWxS",
                        help="these tiles instead of the built-in list (each shape's current "
                             "tile is always timed too)")
    args = parser.parse_args(argv)
    candidates = ([tuple(int(v) for v in c.split("x")) for c in args.candidates]
                  if args.candidates else CANDIDATES)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)  # bytes moved per second, as benchmarks.model_step
    gen = torch.Generator(device=device).manual_seed(1)
    out: dict[str, object] = {"copy_bandwidth_GBps": bandwidth / 1e9, "shapes": {}}
    figures: dict[str, float] = {"copy_bandwidth_GBps": round(bandwidth / 1e9, 1)}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write of a device copy)")
    for name, (n, k, out_dtype) in shapes(ModelConfig.default()).items():
        if args.shapes and name not in args.shapes:
            continue
        w = torch.randn((n, k), generator=gen, device=device).to(torch.bfloat16)
        bound_us = n * k * 2 / bandwidth * 1e6
        rows: dict[str, dict[str, float | bool]] = {}
        current = linear.linear_tile(n, k, torch.bfloat16)
        for tile in dict.fromkeys([current, *candidates]):
            key = "x".join(map(str, tile))
            rows[key] = {}
            for m in args.batch:
                x = torch.randn((m, k), generator=gen, device=device).to(torch.bfloat16)
                base = linear.linear(x, w, out_dtype)
                try:
                    got = linear.linear(x, w, out_dtype, tile=tile)
                except Exception as exc:  # out of resources: not a candidate
                    rows[key]["error"] = True
                    print(f"{name} {key}: {type(exc).__name__}")
                    break
                if not torch.equal(base, got):
                    rows[key]["exact"] = False
                    break
                rows[key][str(m)] = timed(partial(linear.linear, x, w, out_dtype, tile=tile),
                                          args.iters)
            else:
                rows[key]["exact"] = True
        exact = {key: r for key, r in rows.items() if r.get("exact")}
        default = "x".join(map(str, linear.linear_tile(n, k, torch.bfloat16)))
        best = min(exact, key=lambda key: sum(float(exact[key][str(m)]) / float(
            exact[default][str(m)]) for m in args.batch))
        print(f"{name} [N {n}, K {k}]: bound {bound_us:.1f} us; "
              f"{len(exact)} of {len(rows)} tiles bit-exact")
        for key in dict.fromkeys((default, best)):
            times = "  ".join(f"M={m}: {float(exact[key][str(m)]):7.1f} us "
                              f"({float(exact[key][str(m)]) / bound_us:4.2f}x)"
                              for m in args.batch)
            print(f"  {'current' if key == default else 'best   '} {key:>16}  {times}")
        out["shapes"][name] = {"n": n, "k": k, "bound_us": bound_us,  # type: ignore[index]
                               "current": default, "best": best, "tiles": rows}
        last = str(args.batch[-1])
        figures[f"{name}_M{last}_current_us"] = round(float(exact[default][last]), 1)
        figures[f"{name}_M{last}_best_us"] = round(float(exact[best][last]), 1)
        figures[f"{name}_bound_us"] = round(bound_us, 1)
    record("linear_tiles", figures)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
