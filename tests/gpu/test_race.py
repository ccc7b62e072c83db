"""Programmatic dependent launch (``layers.pdl``) on a real GPU: it changes no bit of what
the engine draws."""

from __future__ import annotations

import random

import pytest
import torch

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.layers import pdl
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.ring.records import SamplingParams

pytestmark = pytest.mark.gpu

SEED = 20261128


def test_dependent_launch_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same prompts through two engines on the same weights, one launching the
    layers' kernels with programmatic dependent launch (the default on Hopper) and one
    without: the same tokens and log probabilities, greedy and seeded, in CUDA graphs."""
    config = ModelConfig.default()
    rng = random.Random(SEED)
    prompts = [[rng.randrange(100, 150000) for _ in range(rng.randrange(8, 300))]
               for _ in range(12)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i,
                             logprobs=3, ignore_eos=True)
              for i in range(len(prompts))]

    def run() -> list[tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]]:
        runner = ModelRunner(config, RunnerOptions(weight_seed=SEED, num_blocks=256))
        runner.load()
        engine = ModelEngine(config, runner, EngineOptions(top_logprobs=5))
        out = [(c.tokens, c.logprobs, c.top) for c in engine.generate(prompts, params)]
        del engine, runner
        torch.cuda.empty_cache()
        return out

    assert pdl.launch(torch.device("cuda"), (1,))["PDL"], "a Hopper GPU launches with PDL"
    with_pdl = run()
    monkeypatch.setattr(pdl, "_enabled", lambda device: False)
    assert not pdl.launch(torch.device("cuda"), (1,))["PDL"]
    assert run() == with_pdl
    print(f"{len(prompts)} prompts x 24 tokens, greedy and seeded: the same tokens and log "
          "probabilities with and without programmatic dependent launch")
