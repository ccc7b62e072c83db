"""The linear layers' tiles, by weight shape and row-count bucket, against the bandwidth
bound of reading the weight once and against cuBLAS (GPU time, from CUDA graphs).

The kernel must stay batch-invariant (dpu_frontend/model/layers/linear.py): a
tile is a candidate only when its output is **bit for bit** the reference
tile's, at every row count tried, so that changing it changes no token. For
each linear of the given models (each as the model calls it: gate_up with
SwiGLU fused, o_proj and down with the residual add, the LM head to float32)
and each row count, the benchmark times every candidate tile of that count's
bucket (CUDA events around a graph of ``--reps`` launches, median of
``--iters``), the table's tile, and ``torch.matmul`` (cuBLAS, its plain bf16
product) in the same run, beside the bound: the weight's bytes over the copy
bandwidth measured in the same run. Each launch reads another copy of the
weight, enough copies to overflow L2, as a model's layers do. Candidates load by
pointers or by the TMA (names ending in ``t``, ``tw`` where the loop is
warp-specialized); with ``--splits``, the splits
run in one program or spread over programs (``s``), all against the bits of the
reference tile in the same split. With ``--fp8``, the decoder layers' linears run
as ``--quantization fp8`` runs them (FP8 weights and rows, the FP8 tables and
candidates, the bound at a byte an element), beside cuBLAS's FP8 product
(``torch._scaled_mm``, row and channel scales); the LM heads stay in bf16 and are
not timed.

    python -m benchmarks.linear_tiles                         # Qwen3-0.6B shapes
    python -m benchmarks.linear_tiles --model-config benchmarks/configs/qwen3-8b.json
    python -m benchmarks.linear_tiles --json tiles.json      # every measurement
    python -m benchmarks.linear_tiles --fp8 --model-config benchmarks/configs/qwen3-8b.json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks.common import record
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers import linear
from dpu_frontend.model.layers.linear import FP8_REFERENCE_TILE, REFERENCE_TILE, Tile
from dpu_frontend.model.layers.quant import FP8, Fp8Rows, Fp8Weight, quantize_rows, quantize_weight

#: Past 128 rows: tiles that read the weight once for 128-256 rows, or that put more
#: programs on the GPU, 64 or 128 deep in K; by pointers, or by the TMA in a persistent
#: grid, its loop as one stream of instructions or warp-specialized (``Tile.ws``).
LARGE_TMA: list[Tile] = [Tile(bm, bn, bk, w, s, tma=True) for bm, bn, bk, w, s in (
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 4, 3), (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
    (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (128, 128, 128, 8, 3),
    (128, 64, 128, 8, 3))]
LARGE: list[Tile] = (
    [Tile(bm, bn, 64, w, s) for bm, bn, w in ((128, 128, 8), (128, 256, 8), (256, 128, 8))
     for s in (3, 4)]
    + [Tile(64, 64, 64, 4, 4), Tile(64, 32, 128, 4, 5), Tile(64, 64, 128, 4, 5),
       Tile(64, 64, 128, 4, 4), Tile(64, 128, 128, 4, 3), Tile(64, 128, 128, 4, 4),
       Tile(128, 64, 128, 4, 4), Tile(128, 128, 128, 8, 3)]
    # Triton 3.6's compiler asserts on the warp-specialized 64 x 256 tile at 4 warps
    # (DotOpMmaSmemLoader: "Instruction shape is too large for the layout"), which ends the
    # process, and its 128 x 64 tiles at 4 warps compile for more than a minute without
    # an end (H200, 2026-12-01 and -02): those have no twin. ``probe_aborts`` leaves out
    # any other that ends or stalls a child.
    + LARGE_TMA + [t._replace(ws=True) for t in LARGE_TMA
                   if (t.block_m, t.block_n, t.warps) not in ((64, 256, 4), (128, 64, 4))])
#: Candidate tiles per row-count bucket (linear.M_BUCKETS): narrow tiles deep in K for
#: a few rows (enough programs to stream the weight), tall ones for many.
CANDIDATES: tuple[list[Tile], ...] = (
    [Tile(16, bn, bk, 4, s) for bn in (16, 32, 64) for bk in (128, 256) for s in (4, 6)],
    [Tile(bm, bn, 128, 4, s) for bm in (32, 64) for bn in (32, 64, 128) for s in (3, 5)]
    + [Tile(64, bn, bk, 4, 4, tma=True) for bn, bk in ((32, 128), (64, 64), (64, 128),
                                                       (128, 64))],
    [Tile(bm, bn, 64, w, s, tma) for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4),
                                                   (128, 128, 8)) for s in (3, 4)
     for tma in (False, True)]
    + [Tile(64, bn, 128, 4, s) for bn in (32, 64) for s in (4, 5)]
    + [Tile(64, 128, 128, 4, 3), Tile(128, 64, 128, 4, 4)]
    + [Tile(64, bn, 128, 4, 4, tma=True) for bn in (32, 64)],
    LARGE,
    LARGE,
)
#: FP8 candidates: 64 rows or more, warps in fours (linear.FP8_BUCKET_TILES says why), 128
#: or 256 deep in K (128 or 256 bytes a row, as 16-bit tiles 64 or 128 deep).
FP8_SMALL: list[Tile] = (
    [Tile(64, bn, bk, 4, s) for bn in (16, 32, 64) for bk in (128, 256) for s in (3, 5)]
    + [Tile(64, bn, bk, 4, 4, tma=True) for bn, bk in ((32, 128), (32, 256), (64, 256))])
FP8_LARGE: list[Tile] = (
    [Tile(64, bn, bk, 4, s) for bn in (64, 128) for bk in (128, 256) for s in (3, 4)]
    + [Tile(128, bn, 128, 8, s) for bn in (128, 256) for s in (3, 4)]
    + [Tile(bm, bn, 128, w, s, tma=True) for bm, bn, w, s in (
        (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3))])
FP8_CANDIDATES: tuple[list[Tile], ...] = (FP8_SMALL, FP8_SMALL, FP8_LARGE, FP8_LARGE, FP8_LARGE)
#: Weights per timed graph are rotated through this many bytes, beyond any L2.
ROTATE_BYTES = 256 << 20


@dataclass(frozen=True)
class Shape:
    """One linear of a decoder layer (or the head), as the model calls it."""

    name: str
    n: int  # the weight's rows (a gated weight: gate and up)
    k: int
    out_dtype: torch.dtype = torch.bfloat16
    gated: bool = False
    residual: bool = False


def shapes(config: ModelConfig) -> list[Shape]:
    """The model's products that ``linear`` runs: a mixture of experts' MLP is the
    router's (the experts' products are ``layers.moe``'s grouped GEMM, not these)."""
    c = config
    mlp = ([Shape("router", c.moe.num_experts, c.hidden_size)] if c.moe is not None else
           [Shape("gate_up", 2 * c.intermediate_size, c.hidden_size, gated=True),
            Shape("down", c.hidden_size, c.intermediate_size, residual=True)])
    return [Shape("qkv", c.q_size + 2 * c.kv_size, c.hidden_size),
            Shape("o_proj", c.hidden_size, c.q_size, residual=True), *mlp,
            Shape("lm_head", c.vocab_size, c.hidden_size, out_dtype=torch.float32)]


def timed(call: Callable[[int], object], iters: int, reps: int = 20) -> float:
    """Microseconds per call, GPU time only: ``call(i)`` for i in range(reps) captured in
    a CUDA graph (the engine replays its kernels from graphs, so a launch costs nothing
    there); ``i`` picks the launch's copy of the inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(0)  # compiles, and settles the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
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


def entry(split: int, tile: Tile) -> str:
    return f"S{split}/{tile}"


def measure(shape: Shape, batches: list[int], splits: list[int], iters: int, bandwidth: float,
            gen: torch.Generator, fp8: bool = False, ws_only: bool = False,
            aborts: frozenset[Tile] = frozenset()) -> dict[str, Any]:
    """Every candidate of each row count's bucket in each K split, the tables' choice
    and cuBLAS. A candidate counts when it gives its split's reference bits.
    ``ws_only``: of the candidates, the warp-specialized ones alone; ``aborts``: tiles
    left out, whose compile ends the process (``probe_aborts``)."""
    device = torch.device("cuda")
    n, k = shape.n, shape.k
    element = 1 if fp8 else 2
    copies = max(1, min(32, -(-ROTATE_BYTES // (n * k * element))))
    reps = max(20, copies)  # a graph's launches read every copy
    drawn = (torch.randn((n, k), generator=gen, device=device) * 0.05 for _ in range(copies))
    weights: list[torch.Tensor] | list[Fp8Weight] = (
        [quantize_weight(w) for w in drawn] if fp8 else [w.to(torch.bfloat16) for w in drawn])
    out_n = n // 2 if shape.gated else n
    bound_us = n * k * element / bandwidth * 1e6
    dtype = FP8 if fp8 else torch.bfloat16
    reference_tile = FP8_REFERENCE_TILE if fp8 else REFERENCE_TILE
    candidates = FP8_CANDIDATES if fp8 else CANDIDATES
    table_split = linear.linear_split(n, k, dtype)
    if fp8:
        splits = []  # FP8 shapes take no split
    rows: dict[str, Any] = {"n": n, "k": k, "bound_us": bound_us, "split": table_split,
                            "fp8": fp8, "batches": {}}
    for m in batches:
        x16 = torch.randn((m, k), generator=gen, device=device).to(torch.bfloat16)
        # FP8 rows are quantized once, outside the timing: the norm before the layer makes
        # them (or quant.quantize_rows, a launch of its own, for o_proj and down).
        x: torch.Tensor | Fp8Rows = quantize_rows(x16) if fp8 else x16
        residual = (torch.randn((m, out_n), generator=gen, device=device).to(torch.bfloat16)
                    if shape.residual else None)

        def run(split: int, tile: Tile | None, i: int = 0, x: torch.Tensor | Fp8Rows = x,
                residual: torch.Tensor | None = residual) -> torch.Tensor:
            return linear.linear(x, weights[i % copies], shape.out_dtype, gated=shape.gated,
                                 residual=residual, tile=tile, split=split)

        table = linear.linear_tile(n, k, dtype, m)
        times: dict[str, float | str] = {}
        for split in dict.fromkeys([table_split, *splits]):
            if not linear.split_fits(k, split, reference_tile.block_k):
                continue  # the reference's K blocks do not split so: no candidates
            reference = run(split, reference_tile)
            first = (Fp8Rows(x.data[:1], x.scale[:1], x.dtype) if isinstance(x, Fp8Rows)
                     else x[:1])
            alone = run(split, reference_tile, x=first,
                        residual=None if residual is None else residual[:1])
            if not torch.equal(alone, reference[:1]):
                raise SystemExit(f"{shape.name}: the reference tile's row 0 differs alone and "
                                 f"among {m} rows: the kernel is not batch-invariant")
            tiles = [table, reference_tile, *(t for t in candidates[linear.bucket(m)]
                                              if (t.ws or not ws_only) and t not in aborts)]
            if split > 1:  # the splits one after the other in a program, or spread
                tiles += [t._replace(spread=True) for t in tiles if not t.tma]
            operands = ((x.data, weights[0].data) if isinstance(x, Fp8Rows)
                        and isinstance(weights[0], Fp8Weight) else (x16, weights[0]))
            if not linear.tma_fits(*operands):  # a TMA tile would run the pointer kernel
                tiles = [t for t in tiles if not t.tma]
            for tile in dict.fromkeys(tiles):
                try:
                    got = run(split, tile)
                except Exception as exc:  # out of resources, or K's split: not a candidate
                    times[entry(split, tile)] = type(exc).__name__
                    continue
                if not torch.equal(got, reference):
                    times[entry(split, tile)] = "inexact"
                    continue
                times[entry(split, tile)] = timed(partial(run, split, tile), iters, reps)

        # cuBLAS's FP8 product takes 16 rows or more: fewer run as 16.
        padded = x if m >= 16 or not fp8 else quantize_rows(x16.new_zeros((16, k)))

        def cublas(i: int, x16: torch.Tensor = x16,
                   rows: torch.Tensor | Fp8Rows = padded) -> torch.Tensor:
            w = weights[i % copies]
            if isinstance(rows, Fp8Rows) and isinstance(w, Fp8Weight):
                return torch._scaled_mm(rows.data, w.data.T, scale_a=rows.scale[:, None],
                                        scale_b=w.scale[None, :], out_dtype=torch.bfloat16)
            return torch.matmul(x16, w.data.T if isinstance(w, Fp8Weight) else w.T)

        cublas_us = timed(cublas, iters, reps)
        exact = {t: v for t, v in times.items() if isinstance(v, float)}
        best = min(exact, key=lambda t: exact[t])
        rows["batches"][str(m)] = {
            "table": entry(table_split, table), "best": best, "cublas_us": cublas_us,
            "tiles": times}
    return rows


def report(name: str, rows: dict[str, Any]) -> tuple[str, dict[str, float]]:
    bound = float(rows["bound_us"])
    figures: dict[str, float] = {"bound_us": round(bound, 1)}
    lines = [f"{name} [N {rows['n']}, K {rows['k']}]: bound {bound:.1f} us"]
    for m, b in rows["batches"].items():
        tiles = b["tiles"]

        def shown(name: str, tiles: dict[str, Any] = tiles) -> str:
            """A timing and its ratio to the bound, or why there is none."""
            us = tiles.get(name, "not run")
            return f"{us:7.1f} us ({us / bound:4.2f}x)" if isinstance(us, float) else f"{us:>16}"

        reference = entry(int(rows["split"]), FP8_REFERENCE_TILE if rows.get("fp8")
                          else REFERENCE_TILE)
        lines.append(f"  M={m:>4}: table {b['table']:>20} {shown(b['table'])}"
                     f"  best {b['best']:>20} {shown(b['best'])}"
                     f"  reference {shown(reference)}"
                     f"  cuBLAS {b['cublas_us']:7.1f} us ({b['cublas_us'] / bound:4.2f}x)")
        # The candidates that did not count, by why (inexact bits, or an exception's
        # name): the log says so, not the JSON alone.
        left = {t: v for t, v in tiles.items() if not isinstance(v, float)}
        if left:
            lines.append("          not counted: " + ", ".join(f"{t} ({v})" for t, v in left.items()))
        figures |= {f"M{m}_{what}_us": round(float(tiles[b[what]]), 1) for what in ("table", "best")
                    if isinstance(tiles.get(b[what]), float)}
        figures[f"M{m}_cublas_us"] = round(b["cublas_us"], 1)
    return "\n".join(lines), figures


def best_per_split(rows: dict[str, Any], splits: list[int], buckets: int) -> list[str]:
    """Per split: the best exact tile of each bucket (the least mean time over the bucket's
    row counts, each over its best), and the sum over the row counts of those tiles."""
    batches: dict[str, dict[str, Any]] = rows["batches"]
    lines = []
    for split in splits:
        chosen, total = [], 0.0
        for b in range(buckets):
            ms = [m for m in batches if linear.bucket(int(m)) == b]
            if not ms:
                chosen.append("-")
                continue
            timings = [batches[m]["tiles"] for m in ms]
            names = [t for t in timings[0] if t.startswith(f"S{split}/")
                     and all(isinstance(ts.get(t), float) for ts in timings)]
            if not names:
                chosen.append("none")
                continue
            fastest = [min(float(ts[t]) for t in names) for ts in timings]
            pick = min(names, key=lambda t: sum(float(ts[t]) / f
                                                for ts, f in zip(timings, fastest, strict=True)))
            chosen.append(pick.split("/")[1])
            total += sum(float(ts[pick]) for ts in timings)
        lines.append(f"    split {split}: sum {total:8.1f} us: ({', '.join(chosen)})")
    return lines


def probe(shape: Shape, skip: set[str]) -> None:
    """The ``--probe`` child: each warp-specialized tile not in ``skip`` run once at 256
    rows, ``try`` printed before and ``ok`` after, so that the parent reading the output
    knows which tile's compile ended the process or stalled it."""
    device = torch.device("cuda")
    x = torch.randn((256, shape.k), device=device).to(torch.bfloat16)
    w = (torch.randn((shape.n, shape.k), device=device) * 0.05).to(torch.bfloat16)
    residual = (torch.zeros((256, shape.n // 2 if shape.gated else shape.n), device=device,
                            dtype=torch.bfloat16) if shape.residual else None)
    split = linear.linear_split(shape.n, shape.k, torch.bfloat16)
    for tile in dict.fromkeys(t for t in LARGE if t.ws and str(t) not in skip):
        print(f"try {tile}", flush=True)
        try:
            linear.linear(x, w, shape.out_dtype, gated=shape.gated, residual=residual,
                          tile=tile, split=split)
            torch.cuda.synchronize()
        except Exception:  # a Python error is measure's to report: not an abort
            pass
        print(f"ok {tile}", flush=True)


#: A warp-specialized tile whose compile and first run take longer than this is left out.
PROBE_TILE_SECONDS = 60.0


def probe_aborts(model: list[str], shape: Shape) -> frozenset[Tile]:
    """The warp-specialized tiles whose compile ends the process on this shape (a
    compiler's assert in C++, as Triton 3.6's on some tiles, is no Python exception) or
    stalls past ``PROBE_TILE_SECONDS``: ``probe`` run in children, one again past each
    tile that ended or stalled one. Compiled kernels stay in Triton's cache, so the
    parent's own compiles cost nothing again."""
    skip: dict[str, str] = {}
    while True:
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.linear_tiles", *model, "--shapes", shape.name,
             "--probe", *(f"--probe-skip={t}" for t in sorted(skip))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        assert child.stdout is not None
        trying, began, stalled, pending = None, time.monotonic(), False, b""
        while True:
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            chunk = os.read(child.stdout.fileno(), 4096) if ready else None
            if chunk == b"":  # the child is gone
                break
            *lines, pending = (pending + (chunk or b"")).split(b"\n")
            for line in lines:  # whole lines only: no line waits in a buffer here
                word, _, name = line.decode().strip().partition(" ")
                if word == "try":
                    trying, began = name, time.monotonic()
                elif word == "ok" and name == trying:
                    print(f"  {shape.name}: {name} compiled and ran in "
                          f"{time.monotonic() - began:.1f} s", flush=True)
                    trying = None
            if trying is not None and time.monotonic() - began > PROBE_TILE_SECONDS:
                child.kill()
                stalled = True
                break
        rc = child.wait()
        if trying is None:
            if rc != 0:
                raise SystemExit(f"the probe of {shape.name} failed outside a tile (rc {rc})")
            for name, why in skip.items():
                print(f"  {shape.name}: {name} left out ({why})", flush=True)
            return frozenset(t for t in LARGE if str(t) in skip)
        skip[trying] = (f"no answer in {PROBE_TILE_SECONDS:.0f} s" if stalled else
                        f"its compile ended the process, rc {rc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=Path, action="append", metavar="FILE",
                        help="a model's config.json (repeat; default: Qwen3-0.6B's shapes)")
    parser.add_argument("--with-default", action="store_true",
                        help="the built-in Qwen3-0.6B shapes as well as the --model-config ones")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    parser.add_argument("--splits", type=int, nargs="+", default=[],
                        help="K splits to time beside each shape's own (linear.SPLIT_K)")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--fp8", action="store_true",
                        help="the layers' linears as --quantization fp8 runs them (no LM head)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in
                                                        shapes(ModelConfig.default())],
                        help="only these linears (default: all)")
    parser.add_argument("--ws-only", action="store_true",
                        help="of the candidates, only the warp-specialized TMA tiles (with "
                             "the table's tile, the reference and cuBLAS)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-skip", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configs: list[tuple[str, ModelConfig, Path | None]] = [
        (p.stem, ModelConfig.load(p), p) for p in args.model_config or []]
    if args.with_default or not configs:
        configs.insert(0, ("qwen3-0.6b", ModelConfig.default(), None))
    device = torch.device("cuda")
    # bytes moved per second, as benchmarks.model_step (a probe times nothing)
    bandwidth = 0.0 if args.probe else copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(1)
    # Triton's version beside the figures: its warp specialization on Hopper (the "w"
    # tiles) is recent, and an older one would time another loop.
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device),
                           "triton": triton.__version__,
                           "copy_bandwidth_GBps": bandwidth / 1e9, "models": {}}
    figures: dict[str, object] = {"device": out["device"], "triton": out["triton"],
                                  "copy_bandwidth_GBps": round(bandwidth / 1e9, 1)}
    if not args.probe:
        print(f"{out['device']}, Triton {triton.__version__}: copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s (read + write)")
    table: dict[str, list[str]] = {}
    for model, config, path in configs:
        out["models"][model] = {}
        for shape in shapes(config):
            if (args.shapes and shape.name not in args.shapes) or (
                    args.fp8 and shape.name == "lm_head"):
                continue
            if args.probe:
                probe(shape, set(args.probe_skip))
                continue
            # The warp-specialized tiles are probed in children first, whose aborts would
            # end this run (--ws-only times nothing else; the full sweep takes them too).
            aborts = frozenset() if args.fp8 else probe_aborts(
                [] if path is None else [f"--model-config={path}"], shape)
            rows = measure(shape, args.batch, args.splits, args.iters, bandwidth, gen, args.fp8,
                           args.ws_only, aborts)
            out["models"][model][shape.name] = rows
            text, shape_figures = report(f"{model} {shape.name}", rows)
            print(text, flush=True)
            figures |= {f"{model}_{shape.name}_{k}": v for k, v in shape_figures.items()}
            splits = list(dict.fromkeys([int(rows["split"]), *([] if args.fp8 else args.splits)]))
            table[f"{model} {shape.name} ({shape.n}, {shape.k})"] = best_per_split(
                rows, splits, len(CANDIDATES))
    if args.probe:
        return 0
    print("best exact tile per bucket (M <= " + ", ".join(map(str, linear.M_BUCKETS)) + ", more):")
    for name, lines in table.items():
        print(name)
        print("\n".join(lines))
    record("linear_tiles", figures)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
