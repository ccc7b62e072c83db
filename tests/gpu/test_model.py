"""The Qwen3 engine on a real GPU, against HF ``transformers``' own Qwen3 with the
same weights (docs/gpu.md, "The model engine"). Each test prints what it measured."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from dpu_frontend.model.config import QWEN3_0_6B, ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.layers.sampler import batch_params
from dpu_frontend.model.metadata import SamplingRows
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.sampling import sample as reference_sample
from dpu_frontend.model.scheduler import Batch, Work
from dpu_frontend.ring.records import SamplingParams

pytestmark = pytest.mark.gpu

SEED = 20261126
#: A top-2 logit margin below this excuses a greedy divergence in float32.
TIE_MARGIN = 1e-4
#: bf16: a top-2 margin above this is beyond both engines' rounding differences.
CLEAR_MARGIN = 0.2


def prompts(n: int, seed: int, low: int = 8, high: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def engine(dtype: str, *, num_blocks: int, weights: Path | None = None,
           config: ModelConfig | None = None, max_batched_tokens: int = 2048,
           max_seqs: int = 256, max_model_len: int = 4096, top_logprobs: int = -1) -> ModelEngine:
    config = config or ModelConfig.default()
    runner = ModelRunner(config, RunnerOptions(dtype=dtype, weights=weights, weight_seed=SEED,
                                               num_blocks=num_blocks, max_seqs=max_seqs,
                                               max_model_len=max_model_len))
    runner.load()
    return ModelEngine(config, runner, EngineOptions(max_batched_tokens=max_batched_tokens,
                                                     top_logprobs=top_logprobs))


def hf_model(config_dict: dict[str, Any], state: dict[str, torch.Tensor],
             dtype: torch.dtype) -> Any:
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config_dict.items()
                                             if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "eager"
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(hf_config).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def hf_forward(model: Any, ids: torch.Tensor, past: Any) -> Any:
    with torch.no_grad():
        return model(ids, past_key_values=past, use_cache=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32_engine() -> Iterator[ModelEngine]:
    yield engine("float32", num_blocks=512)
    torch.cuda.empty_cache()


def test_float32_greedy_matches_transformers(fp32_engine: ModelEngine) -> None:
    ps = prompts(16, SEED)
    ours = fp32_engine.generate(ps, [greedy(64)] * len(ps))
    model = hf_model(QWEN3_0_6B, fp32_engine.runner.state_dict(),
                     torch.float32)
    excused, worst = 0, 0.0
    for i, prompt in enumerate(ps):
        out = hf_forward(model, torch.tensor([prompt], device="cuda"), None)
        theirs, margins = [], []
        for _ in range(64):
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            token = int(torch.argmax(logits))
            theirs.append(token)
            out = hf_forward(model, torch.tensor([[token]], device="cuda"), out.past_key_values)
        mine = ours[i].tokens
        assert len(mine) == 64
        diverge = next((j for j in range(64) if mine[j] != theirs[j]), None)
        if diverge is not None:
            print(f"prompt {i}: diverges at token {diverge}, top-2 margin {margins[diverge]:.3g}")
            assert margins[diverge] < TIE_MARGIN, (i, diverge, margins[diverge])
            excused += 1
        worst = max(worst, min(margins))
    print(f"float32 greedy: 16 prompts x 64 tokens, {16 - excused} identical, {excused} excused "
          f"by a tie; smallest top-2 margin seen {worst:.3g}")
    del model


def test_logprobs_match_transformers_log_softmax(fp32_engine: ModelEngine) -> None:
    """A request's own ``logprobs`` (5 alternatives), against transformers' log-softmax
    of the same teacher-forced sequence, both in float32."""
    ps = prompts(4, SEED + 9)
    outs = fp32_engine.generate(ps, [replace(greedy(16), logprobs=5)] * len(ps))
    model = hf_model(QWEN3_0_6B, fp32_engine.runner.state_dict(),
                     torch.float32)
    worst, same_top = 0.0, 0
    for prompt, out in zip(ps, outs, strict=True):
        assert len(out.logprobs) == len(out.tokens) == 16 and all(len(t) == 5 for t in out.top)
        ids = torch.tensor([prompt + out.tokens], device="cuda")
        with torch.no_grad():
            expected = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        for j, token in enumerate(out.tokens):
            row = expected[len(prompt) - 1 + j]
            worst = max(worst, abs(out.logprobs[j] - float(row[token])),
                        *(abs(lp - float(row[t])) for t, lp in out.top[j]))
            same_top += [t for t, _ in out.top[j]] == torch.topk(row, 5).indices.tolist()
    print(f"logprobs vs transformers' log_softmax (float32, 4 x 16 tokens, top 5): max |diff| "
          f"{worst:.2e}; same top-5 ids in {same_top} of 64 positions")
    assert worst < 1e-3
    assert same_top >= 62  # a near tie among the 5th and 6th may swap them
    del model


def bf16_logits_match(eng: ModelEngine, model: Any, seqs: list[list[int]], what: str) -> None:
    """Teacher-forced bf16 logits of ``eng`` against transformers' ``model`` (bf16): the
    mean |difference| under 0.05 of the logits' std and the largest under 0.5 of it,
    and the same argmax wherever transformers' top two are clearly apart."""
    worst_abs, mean_abs, agree, clear, total = 0.0, [], 0, 0, 0
    for i, ids in enumerate(seqs):
        mine = full_logits(eng, ids, slot=i)
        theirs = hf_forward(model, torch.tensor([ids], device="cuda"), None).logits[0].float()
        diff = (mine - theirs).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        mean_abs.append(float(diff.mean()))
        # HF's logits are bf16: its argmax is a coin toss where the top two are within
        # a rounding step. Where they are clearly apart, ours must agree.
        top2 = torch.topk(theirs, 2, dim=-1).values
        apart = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
        agree += int(((mine.argmax(-1) == theirs.argmax(-1)) & apart).sum())
        clear += int(apart.sum())
        total += len(ids)
    scale = float(theirs.std())
    print(f"{what}: bf16 teacher-forced logits over {total} positions: max |diff| "
          f"{worst_abs:.3f}, mean |diff| {np.mean(mean_abs):.4f}, logit std {scale:.3f}; argmax "
          f"agrees at {agree} of the {clear} positions whose top-2 margin exceeds {CLEAR_MARGIN}")
    assert np.mean(mean_abs) < 0.05 * scale
    assert worst_abs < 0.5 * scale
    assert agree == clear


def test_bfloat16_teacher_forced_logits_match_transformers() -> None:
    eng = engine("bfloat16", num_blocks=256)
    model = hf_model(QWEN3_0_6B, eng.runner.state_dict(), torch.bfloat16)
    bf16_logits_match(eng, model, prompts(4, SEED + 1, low=200, high=400), "Qwen3-0.6B")


def full_logits(eng: ModelEngine, ids: list[int], slot: int) -> torch.Tensor:
    """Every position's logits for ``ids`` (one prefill, outside the scheduler)."""
    sched = eng.scheduler
    seq = sched.add(10_000 + slot, len(ids), greedy(1), 0)
    sched.waiting.remove(seq)
    seq.slot = slot
    assert seq.table.reserve(len(ids))
    eng.runner.load_prompt(seq, ids)
    batch = Batch(works=[Work(seq, 0, len(ids), False)])
    attn, input_ids, _ = eng.runner._eager(eng.runner._inputs(batch))
    hidden = eng.runner.model.forward(input_ids, attn)
    seq.table.release()
    return eng.runner.model.logits(hidden)


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[ModelEngine]:
    yield engine("bfloat16", num_blocks=4096, top_logprobs=5)
    torch.cuda.empty_cache()


MIXED = [
    SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=48, temperature=1.2, top_k=40, min_p=0.05, seed=2**63 + 5,
                   presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                   ignore_eos=True),
]


def test_batching_is_invisible(bf16_engine: ModelEngine) -> None:
    targets = prompts(3, SEED + 2)
    alone = [bf16_engine.generate([p], [params])[0].tokens for p, params in zip(targets, MIXED, strict=True)]
    crowd = prompts(61, SEED + 3)
    rng = random.Random(SEED)
    crowd_params = [replace(rng.choice(MIXED), seed=rng.randrange(2**64)) for _ in crowd]
    together = bf16_engine.generate(targets + crowd, MIXED + crowd_params)
    for i in range(3):
        assert together[i].tokens == alone[i], f"sequence {i} changed inside a batch of 64"
    print("3 sequences (greedy; seeded top-p; seeded top-k, min-p, penalties): identical alone "
          "and in a batch of 64")


def test_sampler_matches_the_reference(bf16_engine: ModelEngine) -> None:
    """The GPU sampler draws what the NumPy reference draws, from the same logits."""
    runner = bf16_engine.runner
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    logits = torch.randn((len(MIXED) * 20, runner.config.vocab_size), generator=gen,
                         device="cuda") * 3
    params = [replace(MIXED[i % 3], presence_penalty=0.0, frequency_penalty=0.0,
                      repetition_penalty=1.0, seed=1000 + i) for i in range(logits.shape[0])]
    rows = [(p, p.seed or 0, i) for i, p in enumerate(params)]
    drawn = runner.sampler.draw(logits, batch_params(
        SamplingRows.from_params(rows, runner.config.vocab_size), runner.device)).tolist()
    host = logits.cpu().numpy()
    same = sum(drawn[i] == reference_sample(host[i], p, p.seed or 0, i) for i, p in enumerate(params))
    print(f"GPU sampler = NumPy reference on {same} of {len(params)} rows")
    assert same >= len(params) - 1  # a last-ulp log() difference may flip a near tie


def test_logprobs_match_log_softmax(bf16_engine: ModelEngine) -> None:
    ids = prompts(1, SEED + 4)[0]
    out = bf16_engine.generate([ids], [greedy(4)])[0]
    assert len(out.logprobs) == 4 and all(len(t) == 5 for t in out.top)
    logits = full_logits(bf16_engine, ids + out.tokens, slot=200)
    expected = torch.log_softmax(logits, dim=-1)
    for j, token in enumerate(out.tokens):
        row = expected[len(ids) - 1 + j]
        assert abs(out.logprobs[j] - float(row[token])) < 1e-3
        assert out.top[j][0][0] == token  # greedy: the drawn token is the most likely
        assert [t for t, _ in out.top[j]] == torch.topk(row, 5).indices.tolist()


def test_chunked_prefill_equals_one_prefill() -> None:
    ids = prompts(1, SEED + 5, low=3000, high=3001)[0]
    results = []
    for budget in (4096, 256):
        eng = engine("bfloat16", num_blocks=256, max_batched_tokens=budget, top_logprobs=0)
        results.append(eng.generate([ids], [greedy(16)])[0])
        del eng
        torch.cuda.empty_cache()
    one, chunked = results
    assert chunked.tokens == one.tokens
    assert chunked.logprobs == one.logprobs  # bitwise: batch-invariant kernels
    print("a 3,000-token prompt prefilled in one pass and in 256-token chunks: same 16 tokens, "
          "same log probabilities bit for bit")


def test_blocks_reused_after_cancel_and_full_cache_waits() -> None:
    eng = engine("bfloat16", num_blocks=64, max_model_len=1024, max_seqs=32)  # 2,048 tokens
    pool = eng.scheduler.pool
    ps = prompts(24, SEED + 6, low=100, high=300)
    params = [SamplingParams(max_tokens=64, temperature=0.7, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    # Cancel mid-generation: every block comes back.
    for i in range(8):
        eng.add(1000 + i, ps[i], params[i])
    for _ in range(5):
        eng.step()
    assert pool.free < pool.num_blocks
    for i in range(8):
        eng.cancel(1000 + i)
    assert pool.free == pool.num_blocks and eng.idle
    # Now more than the cache holds at once: admission waits, decodes may preempt.
    waited = 0
    out: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        eng.add(i, p, sp)
    while not eng.idle:
        for ev in eng.step():
            if ev.token is not None:
                out[ev.seq_id].append(ev.token)
        waited = max(waited, len(eng.scheduler.waiting))
    preempted = eng.scheduler.preemptions
    assert pool.free == pool.num_blocks
    # Each equals the sequence run alone in a roomy cache: nothing was corrupted.
    roomy = engine("bfloat16", num_blocks=1024, max_model_len=1024)
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        assert roomy.generate([p], [sp])[0].tokens == out[i], f"sequence {i} differs"
    print(f"64-block cache, 24 sequences of 100-300 + 64 tokens: up to {waited} waiting, "
          f"{preempted} preemptions, every sequence equal to its run alone")


def test_graphs_and_overlapped_steps_equal_the_eager_path() -> None:
    """Decode graphs and mixed graphs (prefill chunks beside decodes: a 256-token
    budget makes the 12 prompts' prefills interleave with the first ones' decodes),
    with the engine's steps overlapped and not, against eager serial steps."""
    ps = prompts(12, SEED + 7)
    params = [replace(MIXED[i % 3], seed=i) for i in range(len(ps))]
    results: dict[tuple[bool, bool], list[tuple[list[int], list[float]]]] = {}
    steps: dict[tuple[bool, bool], dict[str, int]] = {}
    for graphs in (True, False):
        runner = ModelRunner(ModelConfig.default(), RunnerOptions(
            weight_seed=SEED, num_blocks=512, max_seqs=16, cuda_graphs=graphs))
        runner.load()
        for overlap in ((True, False) if graphs else (False,)):
            eng = ModelEngine(runner.config, runner, EngineOptions(
                top_logprobs=2, max_batched_tokens=256, overlap=overlap))
            out = eng.generate(ps, params)
            assert eng.idle and eng.scheduler.pool.free == eng.scheduler.pool.num_blocks
            results[graphs, overlap] = [(c.tokens, c.logprobs) for c in out]
            steps[graphs, overlap] = dict(runner.steps)
            del eng
        del runner
        torch.cuda.empty_cache()
    eager = results[False, False]
    assert results[True, False] == eager and results[True, True] == eager
    graphed = steps[True, False]  # the runner's counts after its first engine
    assert graphed["mixed graph"] > 0 and graphed["decode graph"] > 0 and graphed["eager"] == 0
    assert steps[True, True]["eager"] == 0
    assert steps[False, False]["eager"] == sum(steps[False, False].values())
    print(f"12 sequences, steps as CUDA graphs ({graphed}), overlapped or not, and eager: "
          "same tokens, same log probabilities bit for bit")


def test_padding_ids_are_never_drawn() -> None:
    """The model's vocabulary is padded past the tokenizer's: the sampler draws only
    the tokenizer's ids (here a limit of 1,000, so that random weights would hit the
    rest almost every time)."""
    runner = ModelRunner(ModelConfig.default(), RunnerOptions(
        weight_seed=SEED, num_blocks=128, max_seqs=8, max_model_len=2048, vocab_limit=1000,
        cuda_graphs=False))
    runner.load()
    eng = ModelEngine(runner.config, runner, EngineOptions())
    out = eng.generate(prompts(4, SEED + 8), [greedy(32)] + [replace(MIXED[i], max_tokens=32)
                                                             for i in range(1, 3)] + [greedy(8)])
    drawn = [t for c in out for t in c.tokens]
    assert drawn and max(drawn) < 1000
