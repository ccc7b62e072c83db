"""The offline engine's tokens and log probabilities on a fixed workload, as one digest.

A restructuring of the engine must not change a token: run this on the tree
before and the tree after, on the same GPU, and compare the digests (and the
JSON, to find the first sequence that differs). The workload mixes what the
engine-equality tests exercise: greedy, seeded temperature, top-k, top-p and
min-p, penalties, log probabilities with 5 alternatives, prompts long enough to
be prefilled in chunks beside decodes, in CUDA graphs and eagerly.

    python -m benchmarks.engine_tokens --out build/tokens.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

import torch

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.ring.records import SamplingParams

SEED = 20261127


def workload(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(SEED)
    kinds = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.8, seed=7),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=8),
        SamplingParams(max_tokens=40, temperature=0.7, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, seed=9),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=5),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, logprobs=5, seed=10),
    ]
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.choice((5, 60, 300, 700)))]
               for _ in range(n)]
    return prompts, [kinds[i % len(kinds)] for i in range(n)]


Sequence = dict[str, list[object] | int]


def run(graphs: bool, n: int) -> list[Sequence]:
    """Each sequence's tokens, log probabilities (float hex: every bit), alternatives."""
    runner = ModelRunner(ModelConfig.default(), RunnerOptions(
        weight_seed=SEED, num_blocks=1024, max_seqs=32, max_model_len=2048, cuda_graphs=graphs))
    runner.load()
    engine = ModelEngine(runner.config, runner, EngineOptions(max_batched_tokens=512))
    prompts, params = workload(n)
    out = engine.generate(prompts, params)
    del engine, runner
    torch.cuda.empty_cache()
    return [{"tokens": list(c.tokens), "logprobs": [float(x).hex() for x in c.logprobs],
             "top": [[[t, float(v).hex()] for t, v in alt] for alt in c.top],
             "finish": int(c.finish)} for c in out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    graphs, eager = run(True, args.sequences), run(False, args.sequences)
    result = {"graphs": graphs, "eager": eager}
    text = json.dumps(result, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if args.out is not None:
        args.out.write_text(text)
    tokens = sum(len(c["tokens"]) for c in graphs if isinstance(c["tokens"], list))
    print(f"{torch.cuda.get_device_name()}: {args.sequences} sequences, {tokens} tokens, "
          f"graphs == eager: {graphs == eager}, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
