"""Opt-in FP8 on a real GPU (``--quantization fp8``, ``--kv-cache-dtype fp8``): the
scales and e4m3 values are torch's, every kernel is batch-invariant (a row's bits the
same alone and inside 1 to 512 rows, in every bucket), the fused forms equal the
unfused ones, and the engine in FP8 stays within stated bounds of bf16 (docs/gpu.md,
"Issue 24, third step"). Each test prints what it measured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
from openai import OpenAI

from benchmarks.linear_tiles import Shape, shapes
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.layers import linear
from dpu_frontend.model.layers.activation import silu_mul
from dpu_frontend.model.layers.attention import paged_attention
from dpu_frontend.model.layers.norm import rms_norm, rms_norm_fp8
from dpu_frontend.model.layers.quant import (
    FP8,
    INV_FP8_MAX,
    MIN_AMAX,
    dequantize,
    quantize_rows,
    quantize_weight,
)
from dpu_frontend.model.layers.rope import RotaryTable, qk_norm_rope
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.ring.records import SamplingParams
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary
from tests.gpu.test_model import full_logits, prompts
from tests.stack import MODEL, running_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="FP8 runs on Hopper GPUs or later")]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
SEED = 20261128
ROWS = (1, 2, 7, 16, 17, 40, 64, 65, 100, 128, 129, 200, 256, 257, 384, 512)


def bits(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes (torch compares e4m3 NaN-aware; the bytes are the bits)."""
    return t.view(torch.uint8)


def torch_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant's rule in torch, row by row over the last dimension."""
    amax = x.float().abs().amax(dim=-1).clamp_min(MIN_AMAX)
    scale = amax * INV_FP8_MAX
    return (x.float() / scale[..., None]).to(FP8), scale


def test_rows_quantize_as_torch_rounds_and_the_norm_fuses_it() -> None:
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    for k in (1024, 4096, 12288, 25600):
        x = (torch.randn((300, k), generator=gen, device="cuda") * 3).to(torch.bfloat16)
        x[5] = 0  # an all-zero row: scale MIN_AMAX / 448, values zero
        got = quantize_rows(x)
        want, scale = torch_quantize(x)
        assert torch.equal(got.scale, scale), k
        assert torch.equal(bits(got.data), bits(want)), k
        alone = quantize_rows(x[7:8])
        assert torch.equal(bits(alone.data[0]), bits(got.data[7])) and alone.scale[0] == got.scale[7]
    w = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).to(torch.bfloat16)
    h = torch.randn((300, 4096), generator=gen, device="cuda").to(torch.bfloat16)
    fused, unfused = rms_norm_fp8(h, w, 1e-6), quantize_rows(rms_norm(h, w, 1e-6))
    assert torch.equal(bits(fused.data), bits(unfused.data))
    assert torch.equal(fused.scale, unfused.scale)
    print("rows quantized as torch quantizes them (4 widths, a zero row), alone and in 300; "
          "the norm's FP8 output is rms_norm then quantize_rows, bit for bit")


def fp8_shapes() -> list[Shape]:
    """The decoder layers' linears of Qwen3-0.6B and 8B (the LM heads stay in bf16)."""
    return [s for c in (ModelConfig.default(), ModelConfig.load(CONFIGS / "qwen3-8b.json"))
            for s in shapes(c) if s.name != "lm_head"]


@pytest.mark.parametrize("shape", fp8_shapes(), ids=lambda s: f"{s.name}-{s.n}x{s.k}")
def test_an_fp8_row_has_its_bits_alone_in_every_bucket(shape: Shape) -> None:
    gen = torch.Generator(device="cuda").manual_seed(shape.n * 5 + shape.k)
    w = quantize_weight(torch.randn((shape.n, shape.k), generator=gen, device="cuda") * 0.05)
    out_n = shape.n // 2 if shape.gated else shape.n
    x = torch.randn((max(ROWS), shape.k), generator=gen, device="cuda").to(torch.bfloat16)
    residual = (torch.randn((max(ROWS), out_n), generator=gen, device="cuda").to(torch.bfloat16)
                if shape.residual else None)

    def call(m: int, tile: linear.Tile | None = None, rows: slice | None = None) -> torch.Tensor:
        rows = rows or slice(0, m)
        r = None if residual is None else residual[rows]
        return linear.linear(x[rows], w, gated=shape.gated, residual=r, tile=tile)

    alone = torch.cat([call(1, rows=slice(i, i + 1)) for i in range(max(ROWS))])
    table = {linear.linear_tile(shape.n, shape.k, FP8, m) for m in ROWS}
    # The table's tiles, each by pointers and by the TMA, and the reference.
    buckets = table | {t._replace(tma=not t.tma) for t in table} | {linear.FP8_REFERENCE_TILE}
    for m in ROWS:
        assert torch.equal(call(m), alone[:m]), f"{shape.name}: {m} rows, the table's tile"
        probes = sorted({0, (m - 1) // 2, m - 1})
        for tile in buckets:
            try:
                got = call(m, tile)
            except triton.runtime.OutOfResources:
                assert tile not in table, f"the table's {tile} does not fit {shape.name}"
                continue  # the other loader's variant of a table tile, too large here
            assert torch.equal(got[probes], alone[probes]), f"{m} rows, {tile}"
    # Against float32 sums of the same FP8 operands: the MMA's own accumulation error.
    rows = quantize_rows(x[:64])
    exact = (rows.data.float() * rows.scale[:, None]) @ dequantize(w, torch.float32).T
    plain = linear.linear(x[:64], w)
    err = float((plain.float() - exact).abs().max() / exact.abs().max())
    print(f"{shape.name} [{shape.n} x {shape.k}] FP8: {len(ROWS)} row counts x {len(buckets)} "
          f"tiles (TMA and pointers), every row its bits alone; max error against float32 "
          f"sums {err:.1e} of the largest output")
    assert err < 2e-2


def test_fp8_epilogues_are_the_unfused_layers_bit_for_bit() -> None:
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    gate_up = quantize_weight(torch.randn((6144, 1024), generator=gen, device="cuda") * 0.05)
    down = quantize_weight(torch.randn((1024, 3072), generator=gen, device="cuda") * 0.05)
    for m in (1, 33, 300):
        x = torch.randn((m, 1024), generator=gen, device="cuda").to(torch.bfloat16)
        assert torch.equal(linear.linear(x, gate_up, gated=True),
                           silu_mul(linear.linear(x, gate_up)))
        act = torch.randn((m, 3072), generator=gen, device="cuda").to(torch.bfloat16)
        h = torch.randn((m, 1024), generator=gen, device="cuda").to(torch.bfloat16)
        assert torch.equal(linear.linear(act, down, residual=h), h + linear.linear(act, down))
        assert torch.equal(linear.linear(quantize_rows(act), down), linear.linear(act, down))


PAGE, BLOCKS, HEADS, KV_HEADS, DIM = 16, 64, 32, 8, 128


def test_the_fp8_cache_holds_the_bf16_cache_quantized_and_attention_reads_it() -> None:
    gen = torch.Generator(device="cuda").manual_seed(SEED + 2)
    table = RotaryTable(DIM, 1e6, 4096, torch.bfloat16, torch.device("cuda"))
    t = BLOCKS * PAGE // 2
    qkv = torch.randn((t, (HEADS + 2 * KV_HEADS) * DIM), generator=gen, device="cuda")
    qkv = (qkv * 2).to(torch.bfloat16)
    norms = [(1 + 0.1 * torch.randn(DIM, generator=gen, device="cuda")).to(torch.bfloat16)
             for _ in range(2)]
    positions = torch.arange(t, device="cuda")
    slots = torch.arange(t, device="cuda")
    shape = (BLOCKS, KV_HEADS, PAGE, DIM)
    k16, v16 = (torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k8, v8 = (torch.zeros(shape, device="cuda", dtype=FP8) for _ in range(2))
    ks, vs = (torch.ones(shape[:3], device="cuda") for _ in range(2))
    q16 = qk_norm_rope(qkv.clone(), norms[0], norms[1], 1e-6, table.cos, table.sin, positions, k16, v16,
                       slots, HEADS, KV_HEADS)
    q8 = qk_norm_rope(qkv.clone(), norms[0], norms[1], 1e-6, table.cos, table.sin, positions, k8, v8,
                      slots, HEADS, KV_HEADS, ks, vs)
    assert torch.equal(q8, q16)
    for cache, scales, ref in ((k8, ks, k16), (v8, vs, v16)):
        want, scale = torch_quantize(ref)
        written = slots // PAGE  # the blocks written (whole ones: t is a multiple of PAGE)
        assert torch.equal(bits(cache[written.unique()]), bits(want[written.unique()]))
        assert torch.equal(scales[written.unique()], scale[written.unique()])

    # One sequence's prefill over the first t slots, against attention in float32 over the
    # values the FP8 cache stands for.
    tables = torch.arange(BLOCKS, dtype=torch.int32, device="cuda")[None, :]
    tiles = torch.arange(0, t, 16 // (HEADS // KV_HEADS), dtype=torch.int32, device="cuda")
    meta = (tables, torch.zeros_like(tiles), tiles, torch.zeros(1, dtype=torch.int32, device="cuda"),
            torch.tensor([t], dtype=torch.int32, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"), positions)
    out8, out16 = torch.empty_like(q8), torch.empty_like(q16)
    paged_attention(q8, k8, v8, *meta, out8, k_scale=ks, v_scale=vs)
    paged_attention(q16, k16, v16, *meta, out16)
    kd = (k8.float() * ks[..., None]).permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[:, :t]
    vd = (v8.float() * vs[..., None]).permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[:, :t]
    group = HEADS // KV_HEADS
    qf = q8.float().permute(1, 0, 2)
    scores = qf @ kd.repeat_interleave(group, 0).transpose(1, 2) * DIM ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, device="cuda").triu(1).bool(), float("-inf"))
    ref = (scores.softmax(-1) @ vd.repeat_interleave(group, 0)).permute(1, 0, 2)
    err8 = float((out8.float() - ref).abs().max())
    err16 = float((out16.float() - out8.float()).abs().max())
    print(f"FP8 cache: every written K and V torch's quantization of the bf16 cache's; "
          f"attention over it within {err8:.1e} of float32 attention over the dequantized "
          f"values, and {err16:.1e} of bf16 attention (outputs of magnitude "
          f"{float(ref.abs().max()):.2f})")
    # bf16 q and softmax weights (times V's scales) into the MMAs: about 0.4% of the
    # largest output on the H100; against bf16 attention, the cache's e4m3 rounding.
    assert err8 < 1e-2 * float(ref.abs().max())
    assert err16 < 0.1 * float(ref.abs().max())


def fp8_engine(quantization: str, kv: str, *, num_blocks: int = 4096) -> ModelEngine:
    config = ModelConfig.default()
    runner = ModelRunner(config, RunnerOptions(weight_seed=SEED, num_blocks=num_blocks,
                                               quantization=quantization, kv_cache_dtype=kv,
                                               max_model_len=4096))
    runner.load()
    return ModelEngine(config, runner, EngineOptions())


@pytest.fixture(scope="module")
def fp8_both() -> Iterator[ModelEngine]:
    yield fp8_engine("fp8", "fp8")
    torch.cuda.empty_cache()


def test_fp8_batching_is_invisible(fp8_both: ModelEngine) -> None:
    mixed = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]
    targets = prompts(2, SEED + 3)
    alone = [fp8_both.generate([p], [s])[0].tokens for p, s in zip(targets, mixed, strict=True)]
    crowd = prompts(62, SEED + 4)
    together = fp8_both.generate(targets + crowd, mixed + [mixed[i % 2] for i in range(62)])
    for i in range(2):
        assert together[i].tokens == alone[i], f"sequence {i} changed inside a batch of 64"
    print("FP8 weights and KV cache: 2 sequences (greedy; seeded top-p) identical alone and "
          "in a batch of 64")


#: The bounds per precision: the mean |logit difference| against bf16 over the logits'
#: standard deviation, and the share of positions whose bf16 top-2 margin exceeds 0.1
#: of it where the top-1 token agrees. Measured on the H100 (docs/gpu.md, "Issue 24,
#: third step"): 0.116 and 0.866 for FP8 weights, 0.042 and 0.993 for the FP8 cache,
#: 0.123 and 0.829 for both. Random weights give flat logits (std 0.65 over 151,936 ids, a top-2 margin
#: near 0.1 std at most positions): where a real model's distribution is peaked, the
#: same error flips far fewer tokens.
LOGIT_BOUNDS = {("fp8", "auto"): (0.15, 0.80), ("none", "fp8"): (0.06, 0.97),
                ("fp8", "fp8"): (0.16, 0.78)}


@pytest.mark.parametrize(("quantization", "kv"), list(LOGIT_BOUNDS))
def test_fp8_logits_stay_near_bf16(quantization: str, kv: str) -> None:
    """Teacher-forced logits of the same random weights, FP8 against bf16: the logit
    error, and the top-1 token where bf16's top two are apart, within the stated
    bounds."""
    seqs = prompts(8, SEED + 5, low=200, high=400)
    bf16 = fp8_engine("none", "auto", num_blocks=256)
    want = [full_logits(bf16, ids, slot=i) for i, ids in enumerate(seqs)]
    del bf16
    torch.cuda.empty_cache()
    eng = fp8_engine(quantization, kv, num_blocks=256)
    agree = clear = total = agree_wide = wide = 0
    mean_err, worst = [], 0.0
    for i, ids in enumerate(seqs):
        got, ref = full_logits(eng, ids, slot=i), want[i]
        diff = (got - ref).abs()
        mean_err.append(float(diff.mean()))
        worst = max(worst, float(diff.max()))
        top2 = torch.topk(ref, 2, dim=-1).values
        apart = (top2[:, 0] - top2[:, 1]) > 0.1 * float(ref.std())
        same = got.argmax(-1) == ref.argmax(-1)
        agree += int((same & apart).sum())
        clear += int(apart.sum())
        far = (top2[:, 0] - top2[:, 1]) > 0.5 * float(ref.std())
        agree_wide += int((same & far).sum())
        wide += int(far.sum())
        total += len(ids)
    scale = float(want[-1].std())
    print(f"--quantization {quantization} --kv-cache-dtype {kv} against bf16, {total} "
          f"positions: mean |diff| {np.mean(mean_err):.4f} ({np.mean(mean_err) / scale:.3f} "
          f"std), max {worst:.3f}, logit std {scale:.3f}; top-1 agrees at {agree} of the "
          f"{clear} positions whose bf16 top-2 margin exceeds 0.1 std ({agree / clear:.3f}), "
          f"and at {agree_wide} of the {wide} past 0.5 std")
    mean_bound, agree_bound = LOGIT_BOUNDS[quantization, kv]
    assert np.mean(mean_err) < mean_bound * scale
    assert agree >= agree_bound * clear


@pytest.mark.parametrize("scheduler", ["host", "gpu"])
def test_fp8_through_the_daemon_is_the_engines(scheduler: str) -> None:
    """``--quantization fp8 --kv-cache-dtype fp8`` behind the daemon, host loop and the
    scheduler inside the GPU: greedy and seeded completions are the engine's own tokens
    in the test process (batch-invariant FP8 kernels: the peer's batch is not the test's)."""
    vocab = Vocabulary.load(default_tokenizer_dir())
    config = ModelConfig.default()
    runner = ModelRunner(config, RunnerOptions(
        weight_seed=SEED, num_blocks=256, max_seqs=8, max_model_len=2048, quantization="fp8",
        kv_cache_dtype="fp8", vocab_limit=vocab.tokenizer.get_vocab_size()))
    runner.load()
    texts = ["The ring buffer in GPU memory", "Once upon a time"]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]
    expected = [vocab.decode(r.tokens) for r in ModelEngine(config, runner, EngineOptions())
                .generate([vocab.encode(t) for t in texts], params)]
    del runner
    torch.cuda.empty_cache()
    peer = ("--max-seqs", "16", "--max-model-len", "2048", "--kv-blocks", "256", "--weight-seed",
            str(SEED), "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--scheduler", scheduler)
    with running_stack("shm", timeout=600, peer_command="model-peer", peer_args=peer) as stack, \
            OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0) as c:
        for text, p, want in zip(texts, params, expected, strict=True):
            got = c.completions.create(model=MODEL, prompt=text, max_tokens=p.max_tokens,
                                       temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                                       extra_body={"ignore_eos": True})
            assert got.choices[0].text == want, (text, got.choices[0].text, want)
    print(f"FP8 weights and cache, --scheduler {scheduler}: greedy and seeded top-p "
          "completions through the daemon = the engine's tokens")
