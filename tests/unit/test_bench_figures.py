"""The model benchmarks' arithmetic (``benchmarks.model_figures``), without a GPU: the
bounds are the given model config's, and the model peer's engine counters give the
same figures whichever scheduler ran the engine."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks.model_figures import (
    BenchTokenizer,
    Precision,
    bound_tokens_per_s,
    counter_deltas,
    describe,
    engine_figures,
    experts_read,
    kv_blocks,
    load_config,
    own_bound_tokens_per_s,
    own_peer_flags,
    run_bound,
    step_bytes,
    weight_bytes_read,
)
from dpu_frontend.cli import MODEL_OPTIONS, build_parser
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.device.sched_core import ModelStats
from dpu_frontend.model.sampling import VARIANTS
from tests.assets import tokenizer_dir

CONFIGS = Path(__file__).parent.parent.parent / "benchmarks" / "configs"
QWEN3_8B = CONFIGS / "qwen3-8b.json"
#: Qwen3-8B by hand: the weights a decode step reads (bf16: every parameter but the
#: untied input embedding's 151,936 x 4,096, of which a step reads its own rows) and the
#: K and V of one token over its layers.
WEIGHTS_8B = (8_190_735_360 - 151_936 * 4_096) * 2
KV_8B = 2 * 36 * 8 * 128 * 2
BANDWIDTH = 4e12


@pytest.fixture(scope="module")
def qwen3_8b() -> ModelConfig:
    return ModelConfig.load(QWEN3_8B)


@pytest.mark.parametrize(("name", "shapes", "parameters"), [
    ("qwen3-8b", (36, 4096, 12288, 32, 8, 128), 8.19e9),
    ("qwen3-32b", (64, 5120, 25600, 64, 8, 128), 32.8e9),
])
def test_the_bundled_configs_are_qwen3s(name: str, shapes: tuple[int, ...],
                                        parameters: float) -> None:
    c = ModelConfig.load(CONFIGS / f"{name}.json")
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim) == shapes
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and not c.tie_word_embeddings
    assert (c.vocab_size, c.max_position, c.rope_theta, c.rms_norm_eps) == (
        151936, 40960, 1e6, 1e-6)
    assert c.eos_token_ids == (151645,) and c.dtype == "bfloat16"
    assert c.parameter_count() == pytest.approx(parameters, rel=2e-3)


def test_without_a_file_the_config_is_the_peers_default() -> None:
    config, origin = load_config(None)
    assert config == ModelConfig.default() and "Qwen3-0.6B" in origin
    config, origin = load_config(QWEN3_8B)
    assert config.num_layers == 36 and origin == str(QWEN3_8B)
    assert describe(config) == (
        "Qwen3ForCausalLM: 36 layers, hidden 4096, intermediate 12288, 32 query and 8 KV heads "
        "of 128, vocabulary 151936, untied LM head; 8.19B parameters")


def test_the_bounds_are_the_given_configs(qwen3_8b: ModelConfig) -> None:
    pairs = [(100, 200), (300, 100)]
    # Mean context per generated token: (200 * 200 + 100 * 350) / 300 = 250.
    want = 64 / ((WEIGHTS_8B + 64 * 250 * KV_8B) / BANDWIDTH)
    assert bound_tokens_per_s(qwen3_8b, pairs, 64, BANDWIDTH) == pytest.approx(want)
    assert bound_tokens_per_s(ModelConfig.default(), pairs, 64, BANDWIDTH) > 5 * want
    own = own_bound_tokens_per_s(qwen3_8b, 1000, 80e6, 200_000, BANDWIDTH)
    assert own == pytest.approx(200_000 / ((1000 * WEIGHTS_8B + 80e6 * KV_8B) / BANDWIDTH))
    assert own_bound_tokens_per_s(qwen3_8b, 0, 0, 0, BANDWIDTH) == 0.0


def test_a_decode_steps_bytes_and_blocks(qwen3_8b: ModelConfig) -> None:
    assert step_bytes(qwen3_8b, 256, 1025, Precision()) == (WEIGHTS_8B, 256 * 1025 * KV_8B)
    assert step_bytes(qwen3_8b, 1, 1, Precision(4)) == (2 * WEIGHTS_8B, 2 * KV_8B)
    # A sequence of 1,025 positions in 32-token blocks holds 33 of them.
    assert kv_blocks(256, 1025, 32) == 256 * 33 and kv_blocks(3, 64, 32) == 6


def host_report(**values: float) -> dict[str, Any]:
    """The host engine's ``kernel`` report: ``EngineStats`` and the loop's times."""
    keys = ("steps", "tokens", "scheduled_tokens", "context_tokens", "launch_s", "wait_s",
            "gpu_s", "judge_s", "engine_s", "loop_s", "sum_running", "sum_waiting")
    return {k: values.get(k, 0) for k in keys}


def gpu_report(**values: int) -> dict[str, Any]:
    """The GPU scheduler's, as ``GpuSchedulerKernel.kernel_stats`` builds it from the
    ``dpuf_model_stats`` mirror."""
    st = ModelStats()
    for name, value in values.items():
        setattr(st, name, value)
    out: dict[str, Any] = {name: int(getattr(st, name)) for name, _ in ModelStats._fields_
                           if name != "variants"}
    out.update({f"steps_{v}": int(st.variants[i]) for i, v in enumerate(VARIANTS)})
    return {"scheduler": "gpu", **out}


#: One run's figures, whichever scheduler counted it: 1,000 steps of 200 drawn and 250
#: scheduled tokens, 80,000 positions read a step, 6 ms of GPU time a step, 230
#: sequences running and 12 waiting a step.
HOST_BEFORE = host_report(steps=100, tokens=1000, scheduled_tokens=1500, context_tokens=2e5,
                          launch_s=1.0, wait_s=2.0, gpu_s=2.5, judge_s=0.5, engine_s=3.6,
                          loop_s=0.2, sum_running=1000, sum_waiting=0)
HOST_AFTER = host_report(steps=1100, tokens=201_000, scheduled_tokens=251_500,
                         context_tokens=80.2e6, launch_s=3.0, wait_s=7.0, gpu_s=8.5,
                         judge_s=1.5, engine_s=11.6, loop_s=0.7, sum_running=231_000,
                         sum_waiting=12_000)
GPU_BEFORE = gpu_report(steps=100, tokens=1500, sampled=1000, context_tokens=200_000,
                        ns_step=2_500_000_000, ns_idle=7_000_000_000, running=3, free_blocks=90,
                        sum_running=1000, ns_idle_waiting=1_000_000_000)
GPU_AFTER = gpu_report(steps=1100, tokens=251_500, sampled=201_000, context_tokens=80_200_000,
                       ns_step=8_500_000_000, ns_publish=100_000_000, ns_intake=50_000_000,
                       ns_schedule=20_000_000, ns_prepare=30_000_000, ns_idle=8_500_000_000,
                       running=250, free_blocks=10, preemptions=2, sum_running=231_000,
                       sum_waiting=12_000, ns_idle_waiting=1_250_000_000)
STEPS = "rate: engine steps, mean sampled / scheduled tokens"
GPU_TIME = "rate: per step, ms: GPU time"
BOUND = "rate: bound of the run's own steps (weights + KV read each step), output tokens/s"
HOST_WORK = "rate: per step, ms: engine (launch + wait for tokens + judge) / loop between steps"
GPU_PASS = ("rate: per step, ms: GPU scheduler's pass (publish + intake + schedule + prepare)")
GPU_IDLE = "rate: GPU scheduler idle (passes with nothing to run), s"
GPU_IDLE_WAITING = "rate: of which with sequences waiting (none could run), s"
OCCUPANCY = "rate: per step, mean running / waiting sequences"


def test_host_counters_give_the_figures(qwen3_8b: ModelConfig) -> None:
    figures = engine_figures("rate", qwen3_8b, HOST_BEFORE, HOST_AFTER, 14_000.0, BANDWIDTH)
    own = 200_000 / ((1000 * WEIGHTS_8B + 80e6 * KV_8B) / BANDWIDTH)
    assert figures == {
        STEPS: "1000, 200 / 250",
        HOST_WORK: "8.0 (2.0 + 5.0 + 1.0) / 0.5",
        GPU_TIME: 6.0,
        BOUND: f"{own:.0f} (the output rate is {14_000 / own:.2f} of it)",
        OCCUPANCY: "230 / 12",
    }


def test_gpu_scheduler_counters_give_the_same_figures(qwen3_8b: ModelConfig) -> None:
    """The GPU scheduler's report holds a string (``"scheduler": "gpu"``) and its own
    names: ``tokens`` through the model, ``sampled`` drawn, ns of the GPU's clock."""
    host = engine_figures("rate", qwen3_8b, HOST_BEFORE, HOST_AFTER, 14_000.0, BANDWIDTH)
    gpu = engine_figures("rate", qwen3_8b, GPU_BEFORE, GPU_AFTER, 14_000.0, BANDWIDTH)
    assert {k: gpu[k] for k in (STEPS, GPU_TIME, BOUND, OCCUPANCY)} == {
        k: host[k] for k in (STEPS, GPU_TIME, BOUND, OCCUPANCY)}
    assert gpu[GPU_PASS] == "0.2 (0.1 + 0.05 + 0.02 + 0.03)"
    assert (gpu[GPU_IDLE], gpu[GPU_IDLE_WAITING]) == (1.5, 0.25)
    assert set(gpu) == {STEPS, GPU_TIME, BOUND, GPU_PASS, GPU_IDLE, GPU_IDLE_WAITING, OCCUPANCY}


def test_a_peer_without_the_occupancy_counters_gives_the_rest() -> None:
    """An older peer's report has no sum_running (nor ns_idle_waiting): those figures
    are left out, the others given."""
    before, after = ({k: v for k, v in r.items() if not k.startswith(("sum_", "ns_idle_w"))}
                     for r in (GPU_BEFORE, GPU_AFTER))
    figures = engine_figures("rate", ModelConfig.default(), before, after, 14_000.0, BANDWIDTH)
    assert OCCUPANCY not in figures and GPU_IDLE_WAITING not in figures and GPU_IDLE in figures


@pytest.mark.parametrize(("name", "architecture", "parameters"), [
    ("llama-3-8b", "LlamaForCausalLM", 8_030_261_248),
    ("phi-4", "Phi3ForCausalLM", 14_659_507_200),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30_532_122_624),
])
def test_blinks_other_models_are_bundled(name: str, architecture: str, parameters: int) -> None:
    c = ModelConfig.load(CONFIGS / f"{name}.json")
    assert (c.architecture, c.parameter_count()) == (architecture, parameters)


def test_a_moe_step_reads_the_experts_its_batch_routes_to() -> None:
    """Qwen3-30B-A3B: a token reads attention, the router and 8 of 128 experts a layer,
    its published 3.3B active parameters with the embedding; a batch reads the experts
    uniform routing would hit; every expert without a batch."""
    c = ModelConfig.load(CONFIGS / "qwen3-30b-a3b.json")
    attention = (4096 + 1024) * 2048 + 2048 * 4096 + 2 * 128 + 2 * 2048
    expert, router, head = 3 * 768 * 2048, 128 * 2048, 151936 * 2048
    one = 48 * (attention + router + 8 * expert) + head + 2048
    assert one + head == pytest.approx(3.3e9, rel=0.02)
    assert weight_bytes_read(c, batch=1) == 2 * one
    assert experts_read(c, 1) == 8 and experts_read(c, 0) == 0
    assert experts_read(c, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert experts_read(c, 1024) == pytest.approx(128)
    assert weight_bytes_read(c) == 2 * (c.parameter_count() - head)
    assert weight_bytes_read(c, batch=64) < weight_bytes_read(c)
    weights, _ = step_bytes(c, 1, 100, Precision())
    assert weights == 2 * one
    # Experts counted in a step (model_step's) replace the uniform estimate.
    assert step_bytes(c, 64, 100, Precision(), experts=8)[0] == 2 * one
    assert weight_bytes_read(c, batch=64, experts=20.5) == 2 * one + round(48 * 12.5 * expert) * 2
    # A dense model reads every weight whatever the batch.
    dense = ModelConfig.load(QWEN3_8B)
    assert weight_bytes_read(dense, batch=1) == weight_bytes_read(dense) == WEIGHTS_8B
    assert experts_read(dense, 8) == 0


def test_a_step_reads_the_head_whole_and_an_untied_embedding_by_rows(
        qwen3_8b: ModelConfig) -> None:
    tied = ModelConfig.default()
    assert weight_bytes_read(tied) == tied.parameter_count() * 2
    assert weight_bytes_read(qwen3_8b) == WEIGHTS_8B
    assert weight_bytes_read(qwen3_8b, 4) == 2 * WEIGHTS_8B


def test_the_bound_is_the_configs(qwen3_8b: ModelConfig) -> None:
    """The same steps against Qwen3-0.6B's bytes (by hand: 596,049,920 parameters, 112 KiB
    of K and V a token) and Qwen3-8B's."""
    for config, weights, kv in ((ModelConfig.default(), 596_049_920 * 2, 112 * 1024),
                                (qwen3_8b, WEIGHTS_8B, KV_8B)):
        own = 200_000 / ((1000 * weights + 80e6 * kv) / BANDWIDTH)
        figures = engine_figures("rate", config, GPU_BEFORE, GPU_AFTER, 14_000.0, BANDWIDTH)
        assert figures[BOUND] == f"{own:.0f} (the output rate is {14_000 / own:.2f} of it)"


def test_a_run_without_steps_or_positions_has_no_bound(qwen3_8b: ModelConfig) -> None:
    idle = engine_figures("rate", qwen3_8b, GPU_AFTER, GPU_AFTER, 0.0, BANDWIDTH)
    assert idle[STEPS] == "0, 0 / 0" and idle[BOUND] == "-" and idle[GPU_TIME] == 0.0
    older = {k: v for k, v in GPU_AFTER.items() if k != "context_tokens"}
    assert engine_figures("rate", qwen3_8b, GPU_BEFORE, older, 14_000.0, BANDWIDTH)[BOUND] == "-"


def test_only_numbers_are_counters() -> None:
    assert counter_deltas({"scheduler": "gpu", "steps": 2, "gpu_s": 0.5},
                          {"scheduler": "gpu", "steps": 5, "gpu_s": 1.25, "new": 7,
                           "flag": True}) == {"steps": 3, "gpu_s": 0.75, "new": 7}


def test_the_stats_mirror_ends_with_the_automata_and_schedule_counters() -> None:
    """Added at the end (test_c_header holds every offset against the header): the
    context tokens, structured output's counters, the schedules whose decodes ran
    spread, then the running and waiting sequences summed by step and the idle time
    while some waited; the variants' array before them has five entries (the
    constrained sampler graphs)."""
    assert [name for name, _ in ModelStats._fields_[-9:]] == [
        "context_tokens", "constrained", "automata_copied", "automata_evicted",
        "automata_refused", "spread_schedules", "sum_running", "sum_waiting",
        "ns_idle_waiting"]
    assert ModelStats.context_tokens.offset == 184 and ctypes.sizeof(ModelStats) == 256


def test_the_serving_benchmark_hands_its_config_and_scheduler_to_the_peer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    flags = own_peer_flags(Path("qwen3-8b.json"), "gpu", ["--no-overlap",
                                                          "--scheduler-library=/s.so"])
    assert flags == ["--scheduler", "gpu", "--model-config", str(tmp_path / "qwen3-8b.json")]
    options = MODEL_OPTIONS.build(build_parser().parse_args(
        ["model-peer", *flags, "--no-overlap", "--scheduler-library=/s.so"]))
    assert (options.config, options.scheduler) == (tmp_path / "qwen3-8b.json", "gpu")
    assert own_peer_flags(None, "host", []) == ["--scheduler", "host"]


@pytest.mark.parametrize("extra", [["--model-config=/other.json"], ["--scheduler", "gpu"],
                                   ["--scheduler=host"], ["--model-conf=/other.json"],
                                   ["--sched", "gpu"]])
def test_the_peer_flags_the_bounds_depend_on_are_refused_as_peer_args(
        extra: list[str]) -> None:
    with pytest.raises(ValueError, match=r"pass --(model-config|scheduler) to the benchmark"):
        own_peer_flags(None, "host", extra)


#: Qwen3-8B's layers' linear weights by hand: per layer qkv (4,096 + 2 x 1,024) x 4,096, o_proj
#: 4,096 x 4,096, gate_up 2 x 12,288 x 4,096 and down 4,096 x 12,288; and their output
#: channels (a float32 scale each in FP8).
LINEAR_8B = 36 * (6144 * 4096 + 4096 * 4096 + 24576 * 4096 + 4096 * 12288)
CHANNELS_8B = 36 * (6144 + 4096 + 24576 + 4096)


def test_fp8_bounds_count_a_byte_an_element_and_the_scales(qwen3_8b: ModelConfig) -> None:
    assert qwen3_8b.linear_weights() == (LINEAR_8B, CHANNELS_8B)
    fp8 = Precision.of_flags("fp8", "fp8")
    assert fp8.weight_bytes(qwen3_8b) == WEIGHTS_8B - LINEAR_8B + CHANNELS_8B * 4
    # K and V, 8 heads of 128 in 36 layers: a byte an element and a float32 scale a head.
    assert fp8.kv_bytes_per_token(qwen3_8b) == 2 * 36 * 8 * (128 + 4)
    assert Precision.of_flags("fp8").kv_bytes_per_token(qwen3_8b) == KV_8B
    assert Precision.of_flags(kv_cache_dtype="fp8").weight_bytes(qwen3_8b) == WEIGHTS_8B
    assert step_bytes(qwen3_8b, 2, 10, fp8) == (fp8.weight_bytes(qwen3_8b),
                                                 20 * 2 * 36 * 8 * 132)
    own = own_bound_tokens_per_s(qwen3_8b, 10, 5e5, 1000, BANDWIDTH, fp8)
    assert own == pytest.approx(1000 / ((10 * fp8.weight_bytes(qwen3_8b) + 5e5 * 2 * 36 * 8 * 132)
                                        / BANDWIDTH))


def test_the_serving_benchmark_hands_its_precision_to_the_peer() -> None:
    flags = own_peer_flags(None, "host", [], Precision.of_flags("fp8", "fp8"))
    assert flags == ["--scheduler", "host", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    options = MODEL_OPTIONS.build(build_parser().parse_args(["model-peer", *flags]))
    assert (options.runner.quantization, options.runner.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(ValueError, match="pass --quantization to the benchmark"):
        own_peer_flags(None, "host", ["--quantization=fp8"])
    with pytest.raises(ValueError, match="pass --kv-cache-dtype to the benchmark"):
        own_peer_flags(None, "host", ["--kv-cache-dtype", "fp8"])


def test_the_benchmark_tokenizer_fits_the_model() -> None:
    """The bundled Qwen3 tokenizer serves Qwen3's shapes; Llama-3's vocabulary is smaller
    and the benchmark says which tokenizer to pass; GPT-2's stands in for Phi-4's, and
    the prompts' ids stay below its size."""
    qwen = BenchTokenizer.load(None, ModelConfig.load(QWEN3_8B))
    assert (qwen.size, qwen.flags()) == (151_669, [])
    llama = ModelConfig.load(CONFIGS / "llama-3-8b.json")
    with pytest.raises(ValueError, match=r"151669 ids, the model 128256: pass --tokenizer"):
        BenchTokenizer.load(None, llama)
    assert BenchTokenizer.load(tokenizer_dir("llama3_1"), llama).size == 128_256
    gpt2 = BenchTokenizer.load(tokenizer_dir("gpt2"), ModelConfig.load(CONFIGS / "phi-4.json"))
    assert gpt2.size == 50_257
    assert gpt2.flags() == ["--tokenizer", str(tokenizer_dir("gpt2").resolve())]
    ids = gpt2.prompt_ids(random.Random(1), 50_000)
    assert len(ids) == 50_000 and min(ids) >= 100 and max(ids) < 50_257
    assert 50_256 in gpt2.special and 50_256 not in ids  # <|endoftext|>
    assert max(qwen.prompt_ids(random.Random(1), 5000)) < 150_000


def test_a_runs_bound_is_its_steps_with_either_scheduler() -> None:
    """``run_bound`` is ``own_bound_tokens_per_s`` of the steps between two readings,
    from the host engine's counters or the GPU scheduler's."""
    qwen3_8b = ModelConfig.load(QWEN3_8B)
    host = {"steps": 1000, "tokens": 64_000, "scheduled_tokens": 70_000,
            "context_tokens": 30e6, "gpu_s": 9.0}
    want = own_bound_tokens_per_s(qwen3_8b, 1000, 30e6, 64_000, BANDWIDTH)
    zero = dict.fromkeys(host, 0)
    assert run_bound(qwen3_8b, zero, host, BANDWIDTH) == pytest.approx(want)
    gpu = {"scheduler": "gpu", "steps": 1000, "sampled": 64_000, "tokens": 70_000,
           "context_tokens": 30e6, "ns_step": 9e9}
    assert run_bound(qwen3_8b, {"scheduler": "gpu"}, gpu, BANDWIDTH) == pytest.approx(want)
    assert run_bound(qwen3_8b, zero, {k: v for k, v in host.items()
                                      if k != "context_tokens"}, BANDWIDTH) == 0.0
