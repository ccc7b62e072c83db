"""The sampler's race in one kernel (``layers.race``) and programmatic dependent launch
(``layers.pdl``), on a real GPU: neither changes a bit of what the engine draws."""

from __future__ import annotations

import random
from typing import cast

import pytest
import torch

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.layers import pdl
from dpu_frontend.model.layers.race import race
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.sampling import _MASK32, _TOKEN_MUL, U_MAX, fmix32
from dpu_frontend.ring.records import SamplingParams

pytestmark = pytest.mark.gpu

SEED = 20261128


def torch_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race as the sampler ran it in torch passes before the kernel."""
    ids = torch.arange(probs.shape[1], dtype=torch.int64, device=probs.device)
    # fmix32 is typed for NumPy; given tensors it returns a tensor.
    bits = cast(torch.Tensor, fmix32(keys[:, None] ^ ((ids * _TOKEN_MUL) & _MASK32)[None, :]))
    u = (((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24).clamp_(max=float(U_MAX))
    return torch.argmax(probs / -torch.log(u), dim=-1)


@pytest.mark.parametrize("vocab", [151936, 49152, 1000])
def test_the_race_is_the_torch_passes_bit_for_bit(vocab: int) -> None:
    """Every row's token equals the torch passes' (the same hash, uniform, logarithm and
    quotient): probabilities of a softmax, with dropped tokens (0), a row with one token
    left, a row of zeros (token 0, as argmax says) and a NaN (the first NaN wins, as
    argmax says); and each row alone draws what it draws in the batch."""
    gen = torch.Generator(device="cuda").manual_seed(SEED + vocab)
    rows = 300
    probs = torch.softmax(torch.randn((rows, vocab), generator=gen, device="cuda") * 3, dim=-1)
    probs[1::3, : vocab // 3] = 0.0
    probs[5] = 0.0
    probs[5, vocab - 1] = 1.0
    probs[6] = 0.0
    probs[7, vocab // 2] = float("nan")
    probs[7, vocab - 2] = float("nan")
    keys = torch.randint(0, 2**62, (rows,), generator=gen, device="cuda")
    want = torch_race(probs, keys)
    got = race(probs, keys)
    assert torch.equal(got, want)
    assert int(got[5]) == vocab - 1 and int(got[6]) == 0 and int(got[7]) == vocab // 2
    for i in random.Random(SEED).sample(range(rows), 20):
        assert int(race(probs[i:i + 1], keys[i:i + 1])[0]) == int(got[i])
    print(f"vocabulary {vocab}: {rows} rows, the kernel's race = the torch passes' bit for bit")


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
