"""The model's decode step against its memory-bandwidth bound.

A decode step reads every weight once and the K and V of every token of every
sequence in the batch once. Its bound is those bytes over the GPU's copy
bandwidth, measured in the same run (a device-to-device copy of a 4 GiB
buffer: read and write counted). For each batch size the benchmark builds
that many sequences of ``--context`` tokens in the paged cache and times the
step from the host's call to its completion (metadata, forward, logits,
sampling), best and median of ``--iters``.

The model is Qwen3-0.6B's shapes, or ``--model-config FILE``'s (an HF
config.json; ``benchmarks/configs`` holds Qwen3-8B's and Qwen3-32B's), with
seeded random weights: the weights, the KV bytes per token and so the bound are
that config's. Each sequence decodes its own random token, and a mixture of
experts' bound counts the experts its step routed to (the step run once eagerly
with the router's choices recorded). The KV cache is what ``--memory-fraction``
of the GPU leaves after the weights (the runner's rule, as the model peer's);
the largest batch must fit in it, which the benchmark checks before it times
anything. This
drives ``ModelRunner`` directly, with no scheduler: the model peer's
``--scheduler`` (host or GPU) does not apply here; ``benchmarks.model_serving``
takes it.

    python -m benchmarks.model_step                         # bf16, Qwen3-0.6B shapes
    python -m benchmarks.model_step --batch 1 8 64 256 --context 1024
    python -m benchmarks.model_step --model-config benchmarks/configs/qwen3-8b.json
    python -m benchmarks.model_step --model-config benchmarks/configs/qwen3-32b.json --batch 1 8 64
    python -m benchmarks.model_step --model-config benchmarks/configs/qwen3-8b.json \
        --quantization fp8 --kv-cache-dtype fp8       # opt-in FP8, its own bound
    python -m benchmarks.model_step --model-config benchmarks/configs/qwen3-8b.json \
        --batch 64 256 --constrained                  # structured output's cost, alternated

(Qwen3-32B's 65.5 GB of bf16 weights leave an 80 GB card little room for the
KV cache at the default ``--memory-fraction`` 0.85: there, fewer sequences and
a larger fraction.)
"""

from __future__ import annotations

import argparse
import statistics
from array import array
from pathlib import Path

import torch

from benchmarks.common import record
from benchmarks.model_figures import (
    PROMPT_ID_HIGH,
    PROMPT_ID_LOW,
    Precision,
    describe,
    kv_blocks,
    load_config,
    step_bytes,
)
from dpu_frontend.model.automata import AutomatonPool
from dpu_frontend.model.blocks import BlockPool, BlockTable
from dpu_frontend.model.layers import moe
from dpu_frontend.model.options import KV_CACHE_DTYPES, QUANTIZATIONS, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.scheduler import Batch, Sequence, Status, Work
from dpu_frontend.ring.automaton import NONE, CheckedAutomaton, TokenAutomaton
from dpu_frontend.ring.records import SamplingParams


def copy_bandwidth(device: torch.device, size: int = 4 << 30) -> float:
    """Bytes moved per second by a device-to-device copy (read + write)."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    # Give the buffers back to the GPU: a model peer started after this (model_serving,
    # blink) sizes its KV cache from the free memory.
    torch.cuda.empty_cache()
    return 2 * size / best


def json_string_automaton(vocab: int, eos: int) -> CheckedAutomaton:
    """What a constrained decode step walks most of the time, a JSON string's inside:
    state 0, dense, takes all but a few hundred ids back to itself, lists 64 that leave
    it (the quote and escapes, to state 1) and allows the end; state 1, sparse, takes
    ``,`` ``}``-like ids (64 of them) back to state 0."""
    leave = list(range(1000, 1064))
    mask_words = (vocab + 31) // 32
    words = [0xFFFF_FFFF] * mask_words
    for t in range(2000, 2300):  # not allowed in a string
        words[t // 32] &= ~(1 << (t % 32)) & 0xFFFF_FFFF
    if vocab % 32:
        words[-1] &= (1 << (vocab % 32)) - 1
    return CheckedAutomaton.of(TokenAutomaton(
        vocab, eos, array("i", [0, 64, 128]), array("i", leave + list(range(3000, 3064))),
        array("i", [1] * 64 + [0] * 64), array("i", [0, NONE]), array("i", [0, NONE]),
        array("I", words)))


def constrain(runner: ModelRunner, batch: Batch, checked: CheckedAutomaton | None) -> None:
    """Every sequence of ``batch`` walks ``checked`` from its start (None: none does), as
    the engine's admission sets them."""
    pool = AutomatonPool(runner.automata.words)
    entry = pool.acquire(checked) if checked is not None else None
    for work in batch.works:
        seq = work.seq
        runner.slot_params.set(seq.slot, seq.params, seq.seed, constrained=entry is not None)
        runner.automata.attach(seq.slot, entry)


def decode_batch(runner: ModelRunner, pool: BlockPool, size: int, context: int,
                 temperature: float = 0.0) -> Batch:
    """``size`` sequences of ``context`` tokens, each decoding its own seeded random
    token: with one token for all, every row would route to the same experts of a
    mixture, which would read 8 experts a layer at any batch. ``temperature`` > 0: each
    draws at that temperature, seeded (the sampler's race), instead of greedily."""
    params = SamplingParams(max_tokens=1 << 20, temperature=temperature, ignore_eos=True)
    generator = torch.Generator().manual_seed(size)
    ids = torch.randint(PROMPT_ID_LOW, min(PROMPT_ID_HIGH, runner.config.vocab_size),
                        (size, context + 1), generator=generator)
    runner.slots.tokens[:size, :context + 1] = ids.to(runner.device)
    works = []
    for i in range(size):
        seq = Sequence(i, context, params, seed=i, limit=1 << 30, table=BlockTable(pool), slot=i,
                       computed=context, generated=1, status=Status.RUNNING)
        if not seq.table.reserve(context + 1):
            raise SystemExit(f"the KV cache has no room for {size} x {context} tokens")
        runner.slot_params.set(i, params, seed=i)  # as the engine's admission does
        works.append(Work(seq, context, 1, True))
    return Batch(works=works)


def experts_routed(runner: ModelRunner, batch: Batch) -> float | None:
    """The experts a layer of a mixture reads in ``batch``'s step, counted: the step run
    once eagerly with the router's choices recorded, averaged over the layers (None
    for a dense model). The graphs replay the same kernels on the same inputs."""
    if runner.config.moe is None:
        return None
    hit: list[int] = []
    route = moe.route

    def counting(logits: torch.Tensor, top_k: int,
                 norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = route(logits, top_k, norm_topk_prob)
        hit.append(int(torch.unique(ids).numel()))
        return ids, weights

    graphs, runner.graphs = runner.graphs, None
    moe.route = counting
    try:
        runner.step(batch)
        torch.cuda.synchronize()
    finally:
        moe.route, runner.graphs = route, graphs
    if len(hit) != runner.config.num_layers:
        raise RuntimeError(f"{len(hit)} routings counted in a step of "
                           f"{runner.config.num_layers} layers")
    return sum(hit) / len(hit)


def profile(runner: ModelRunner, batch: Batch) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.step(batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def step_times(runner: ModelRunner, batch: Batch, iters: int) -> list[float]:
    """Seconds of ``iters`` steps of ``batch``, each timed alone, after 3 to warm up."""
    for _ in range(3):
        runner.step(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.step(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                    help="the model peer's flag: FP8 linear weights (the bound counts them)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the model peer's flag: an FP8 KV cache (the bound counts it)")
    ap.add_argument("--model-config", type=Path, metavar="FILE",
                    help="the model's config.json (or a directory with one); the weights, "
                         "the KV bytes and the bound are its (default: Qwen3-0.6B's shapes)")
    ap.add_argument("--memory-fraction", type=float,
                    default=RunnerOptions().memory_fraction,
                    help="share of the GPU's memory in use once the KV cache is allocated "
                         "(the model peer's flag)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every sequence draws at this temperature, seeded (default 0: "
                         "greedy, the argmax alone)")
    ap.add_argument("--constrained", action="store_true",
                    help="also time each batch with every sequence walking a structured "
                         "output's automaton (a JSON string's inside), alternated with the "
                         "unconstrained step")
    ap.add_argument("--profile", action="store_true",
                    help="print the GPU kernels' share of the largest batch's step")
    args = ap.parse_args(argv)

    config, origin = load_config(args.model_config)
    biggest = max(args.batch)
    try:
        options = RunnerOptions(dtype=args.dtype, max_seqs=biggest,
                                max_model_len=args.context + 64,
                                memory_fraction=args.memory_fraction, cuda_graphs=not args.eager,
                                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as exc:
        ap.error(str(exc))
    runner = ModelRunner(config, options)
    runner.load()
    needed = kv_blocks(biggest, args.context + 1, runner.options.block_size)
    if runner.num_blocks < needed:
        raise SystemExit(f"the KV cache holds {runner.num_blocks} blocks of "
                         f"{runner.options.block_size} tokens; {biggest} x {args.context + 1} "
                         f"tokens need {needed}: smaller --batch or --context, or a larger "
                         f"--memory-fraction")
    bandwidth = copy_bandwidth(runner.device)
    precision = Precision.of_flags(args.quantization, args.kv_cache_dtype,
                                   torch.finfo(runner.dtype).bits // 8)
    # A mixture of experts reads more of its experts as the batch grows: per batch below.
    weight_bytes = precision.weight_bytes(config, 1)
    figures: dict[str, object] = {
        "device": torch.cuda.get_device_name(runner.device),
        "model config": origin, "model": describe(config), "dtype": args.dtype,
        "precision": precision.describe(),
        "copy bandwidth (bare limit), GB/s": round(bandwidth / 1e9, 1),
        "weights read a step at batch 1, GB": round(weight_bytes / 1e9, 3),
        "context": args.context,
        "KV cache blocks": runner.num_blocks, "CUDA graphs": not args.eager,
        "temperature": args.temperature,
    }
    checked = (json_string_automaton(config.vocab_size, config.eos_token_ids[0])
               if args.constrained else None)
    for size in args.batch:
        pool = BlockPool(runner.num_blocks, runner.options.block_size)
        batch = decode_batch(runner, pool, size, args.context, args.temperature)
        times = step_times(runner, batch, args.iters)
        if checked is not None:
            # Alternated, so that both see the same machine.
            free, walked = [], []
            for _ in range(2):
                constrain(runner, batch, checked)
                walked += step_times(runner, batch, args.iters // 2)
                constrain(runner, batch, None)
                free += step_times(runner, batch, args.iters // 2)
            figures[f"batch {size}: unconstrained / constrained step best, ms"] = (
                f"{min(free) * 1e3:.3f} / {min(walked) * 1e3:.3f}")
            figures[f"batch {size}: constrained / unconstrained"] = round(min(walked) / min(free), 4)
            # What the mask adds at the least: the logits read and the masked copy written.
            mask_bytes = 2 * 4 * size * config.vocab_size
            figures[f"batch {size}: the mask's bytes at the copy bandwidth, ms"] = round(
                mask_bytes / bandwidth * 1e3, 4)
        experts = experts_routed(runner, batch)
        weights, kv_bytes = step_bytes(config, size, args.context + 1, precision, experts)
        bound = (weights + kv_bytes) / bandwidth
        best, median = min(times), statistics.median(times)
        figures[f"batch {size}: step best / median, ms"] = f"{best * 1e3:.3f} / {median * 1e3:.3f}"
        figures[f"batch {size}: bound, ms ({weights / 1e9:.2f} GB weights + {kv_bytes / 1e9:.2f} "
                f"GB KV)"] = round(bound * 1e3, 3)
        if experts is not None:
            figures[f"batch {size}: experts a layer reads, counted"] = round(experts, 1)
        figures[f"batch {size}: step / bound"] = round(best / bound, 2)
    record("model_step", figures)
    if args.profile:
        profile(runner, decode_batch(runner, BlockPool(runner.num_blocks, runner.options.block_size),
                                     biggest, args.context, args.temperature))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
