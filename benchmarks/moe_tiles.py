"""The mixture-of-experts grouped GEMM's tiles, and its grouping, by batch, against the
bandwidth bound of reading the routed experts' weights once (GPU time, CUDA graphs).

For Qwen3-30B-A3B's shapes (or ``--model-config``'s), each batch of T tokens routes
each token to ``top_k`` distinct experts drawn at random (uniform routing, as
``benchmarks.model_step`` assumes). Each of the two projections (gate_up with SwiGLU,
gathering the tokens' rows; down, reading the pairs' rows) runs every candidate tile
(``layers.moe.MoeTile``: rows, columns, warps, stages; the K step stays the engine's,
part of the bits), the engine's table's among them. A candidate counts only when its
output is bit for bit the reference tile's (``MOE_TILE``). A graph of ``--reps``
launches draws another routing for each launch, so the experts read change from
launch to launch as they do from layer to layer; the bound is the distinct experts'
bytes of each launch over the copy bandwidth measured in the same run. The grouping
is timed too: the engine's, spread over programs (``_group_spread``), beside torch's
sort and scans (``_group_with_torch``, the reference it equals).

    python -m benchmarks.moe_tiles --batch 1 8 64 256 512 2048
    python -m benchmarks.moe_tiles --model-config benchmarks/configs/qwen3-30b-a3b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import record
from benchmarks.linear_tiles import timed
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers import moe
from dpu_frontend.model.layers.moe import MOE_TILE, MoeTile

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "qwen3-30b-a3b.json"
#: Few rows: narrow column blocks and deep pipelines, to put enough programs on the
#: GPU to stream the experts; many rows: taller and wider blocks, that read an
#: expert's weights once for more of its pairs.
CANDIDATES: list[MoeTile] = list(dict.fromkeys(
    [MOE_TILE, *moe.MOE_TILES_FEW, *moe.MOE_TILES_MANY]
    + [MoeTile(16, bn, 4, s) for bn in (16, 32, 64, 128) for s in (3, 4, 5)]
    + [MoeTile(16, bn, 8, s) for bn in (64, 128) for s in (3, 4)]
    + [MoeTile(bm, bn, w, s) for bm, bn, w in ((32, 64, 4), (32, 128, 4), (64, 64, 4),
                                               (64, 128, 4), (64, 128, 8), (128, 128, 8))
       for s in (3, 4)]))


def routings(tokens: int, experts: int, top_k: int, count: int,
             gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` routings of ``tokens`` tokens: each token's ``top_k`` distinct experts,
    uniformly drawn, [tokens, top_k] int32."""
    device = gen.device
    return [torch.rand((tokens, experts), generator=gen, device=device).topk(top_k).indices
            .to(torch.int32) for _ in range(count)]


def measure(config: ModelConfig, tokens: int, reps: int, iters: int, bandwidth: float,
            gen: torch.Generator, weights: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Every candidate on both projections at ``tokens`` rows, and the two groupings."""
    assert config.moe is not None
    experts, top_k = config.moe.num_experts, config.moe.top_k
    hidden, inner = config.hidden_size, config.moe.intermediate
    gate_up, down = weights
    device = gate_up.device
    ids = routings(tokens, experts, top_k, reps, gen)
    pairs_n = tokens * top_k
    distinct = statistics.mean(float(torch.unique(i).numel()) for i in ids)
    bound_us = {"gate_up": distinct * 2 * inner * hidden * 2 / bandwidth * 1e6,
                "down": distinct * hidden * inner * 2 / bandwidth * 1e6}
    x = (torch.randn((tokens, hidden), generator=gen, device=device) * 0.5).to(torch.bfloat16)
    h = (torch.randn((pairs_n, inner), generator=gen, device=device) * 0.5).to(torch.bfloat16)
    groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for bm in {t.block_m for t in CANDIDATES}:
        groups[bm] = [moe.group_by_expert(i, experts, bm) for i in ids]
    table = dict(zip(("gate_up", "down"), moe.moe_tiles(pairs_n, experts), strict=True))
    result: dict[str, Any] = {"tokens": tokens, "pairs": pairs_n, "distinct_experts": distinct,
                              "bound_us": bound_us, "tiles": {},
                              "table": {k: str(v) for k, v in table.items()}}
    for name, a, w, gather, gated in (("gate_up", x, gate_up, True, True),
                                      ("down", h, down, False, False)):
        def run(tile: MoeTile, i: int, a: torch.Tensor = a, w: torch.Tensor = w,
                gather: bool = gather, gated: bool = gated) -> torch.Tensor:
            pairs, block_expert = groups[tile.block_m][i % reps]
            return moe.moe_gemm(a, w, pairs, block_expert, pairs_n, top_k, gather=gather,
                                gated=gated, tile=tile)

        reference = run(MOE_TILE, 0)
        times: dict[str, float | str] = {}
        for tile in CANDIDATES:
            try:
                got = run(tile, 0)
            except Exception as exc:  # out of resources: not a candidate
                times[str(tile)] = type(exc).__name__
                continue
            if not torch.equal(got, reference):
                times[str(tile)] = "inexact"
                continue
            times[str(tile)] = timed(partial(run, tile), iters, reps)
        result["tiles"][name] = times
    blocks = -(-pairs_n // moe.MOE_BLOCK_M) + min(experts, pairs_n)
    result["group_us"] = {
        "torch": timed(lambda i: moe._group_with_torch(ids[i % reps], experts,
                                                       moe.MOE_BLOCK_M, blocks), iters, reps),
        "spread": timed(lambda i: moe._group_spread(ids[i % reps], experts,
                                                    moe.MOE_BLOCK_M, blocks), iters, reps)}
    return result


def report(result: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    tokens = result["tokens"]
    lines = [f"T={tokens:>4} ({result['pairs']} pairs, {result['distinct_experts']:.1f} "
             f"experts a launch): grouping torch {result['group_us']['torch']:.1f} us,"
             f" spread {result['group_us']['spread']:.1f} us"]
    figures: dict[str, Any] = {f"T{tokens} grouping us (torch / spread)":
                               "{torch:.1f} / {spread:.1f}".format(
                                   **result["group_us"])}
    for name, times in result["tiles"].items():
        bound = result["bound_us"][name]
        exact = {t: v for t, v in times.items() if isinstance(v, float)}
        best = min(exact, key=exact.__getitem__)
        table = str(result["table"][name])
        current = exact[table]
        lines.append(f"  {name:7}: bound {bound:6.1f} us; engine's {table} {current:6.1f} us "
                     f"({current / bound:4.2f}x); best exact {best} {exact[best]:6.1f} us "
                     f"({exact[best] / bound:4.2f}x)")
        lines.append("           " + "  ".join(
            f"{t} {v:.1f}" if isinstance(v, float) else f"{t} {v}" for t, v in times.items()))
        figures[f"T{tokens} {name} us (engine's {table} / best exact {best} / bound)"] = (
            f"{current:.1f} / {exact[best]:.1f} / {bound:.1f}")
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=Path, default=DEFAULT_CONFIG, metavar="FILE",
                        help="a mixture of experts' config.json (default: Qwen3-30B-A3B's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 512, 2048])
    parser.add_argument("--reps", type=int, default=20, help="launches a timed graph holds")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    config = ModelConfig.load(args.model_config)
    if config.moe is None:
        parser.error(f"{args.model_config} is not a mixture of experts")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(5)
    m = config.moe
    gate_up = (torch.randn((m.num_experts, 2 * m.intermediate, config.hidden_size),
                           generator=gen, device=device) * 0.03).to(torch.bfloat16)
    down = (torch.randn((m.num_experts, config.hidden_size, m.intermediate), generator=gen,
                        device=device) * 0.03).to(torch.bfloat16)
    figures: dict[str, Any] = {"copy bandwidth, GB/s": round(bandwidth / 1e9, 1),
                               "experts (count, top k, intermediate, hidden)":
                               f"{m.num_experts}, {m.top_k}, {m.intermediate}, "
                               f"{config.hidden_size}", "device": torch.cuda.get_device_name()}
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for tokens in args.batch:
        result = measure(config, tokens, args.reps, args.iters, bandwidth, gen, (gate_up, down))
        lines, more = report(result)
        print("\n".join(lines), flush=True)
        figures |= more
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    record("moe_tiles", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
