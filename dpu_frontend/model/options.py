"""The model engine's settings (``dpu-frontend model-peer``), each field with its flag's help.

No torch here: the CLI parses and validates these on any machine (a bad flag
is a usage error before a GPU is touched), and CI tests them. A field without a
Doc is not a flag: the peer sets it (``vocab_limit``, from the tokenizer), or a
request does (``top_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpu_frontend.flags import about, flat

DTYPES = ("bfloat16", "float16", "float32")
#: ``--quantization``: none, or FP8 (e4m3) linear weights with a scale per output channel
#: and the activations quantized per row as they enter each linear layer.
QUANTIZATIONS = ("none", "fp8")
#: ``--kv-cache-dtype``: the model dtype (auto), or FP8 (e4m3) with a scale per token and head.
KV_CACHE_DTYPES = ("auto", "fp8")
RECORDS = ("gpu", "host")
SCHEDULERS = ("host", "gpu")
BLOCK_SIZES = (16, 32, 64)


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How the model is placed on the GPU."""

    dtype: str = field(default="bfloat16", metadata=about(
        "dtype of the weights and the KV cache", choices=DTYPES))
    quantization: str = field(default="none", metadata=about(
        "the decoder layers' linear weights in FP8 (e4m3, a scale per output channel), "
        "multiplied on FP8 tensor cores with the activations quantized per row; the "
        "embedding, the norms and the LM head stay in --dtype (on Hopper)",
        choices=QUANTIZATIONS))
    kv_cache_dtype: str = field(default="auto", metadata=about(
        "the KV cache's element: auto (--dtype) or fp8 (e4m3, a float32 scale per token "
        "and head; about half the bytes, so twice the tokens in the same memory; with "
        "--dtype bfloat16, on Hopper)",
        choices=KV_CACHE_DTYPES))
    device: int = field(default=0, metadata=about("CUDA device index"))
    weights: Path | None = field(default=None, metadata=about(
        "an HF checkpoint directory (safetensors), or a llama GGUF file (FILE.gguf: "
        "llama.cpp's, dequantized at load)", metavar="PATH",
        none="seeded random weights: real arithmetic, gibberish text"))
    weight_seed: int = field(default=0, metadata=about("seed of the random weights"))
    block_size: int = field(default=32, metadata=about(
        "tokens per KV block", choices=BLOCK_SIZES))
    num_blocks: int = field(default=0, metadata=about(
        "KV cache blocks, 0: what --memory-fraction of the GPU leaves", flag="--kv-blocks"))
    memory_fraction: float = field(default=0.85, metadata=about(
        "share of the GPU's memory in use once the KV cache is allocated, with --kv-blocks 0"))
    max_seqs: int = field(default=256, metadata=about("sequences in a batch"))
    max_model_len: int = field(default=8192, metadata=about("longest prompt + output, tokens"))
    # Decode steps as CUDA graphs, one per batch-size bucket; the flag turns them off.
    cuda_graphs: bool = field(default=True, metadata=about(
        "run every step eagerly", flag="--no-cuda-graphs"))
    # Structured output: the automata of constrained sequences, walked on the GPU
    # (model/automata.py); one copy per constraint, kept while room allows.
    automaton_pool_bytes: int = field(default=512 << 20, metadata=about(
        "GPU memory for structured output's automata (one copy per constraint; a request "
        "waits for admission while those in use fill it); 0: no structured output"))
    #: Token ids the sampler may draw: the tokenizer's (a model's vocabulary is padded,
    #: Qwen3's 151,936 rows for the tokenizer's 151,669 ids); 0: every row.
    vocab_limit: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.dtype == "float32" and (self.fp8_weights or self.fp8_kv):
            raise ValueError("FP8 weights and KV cache run beside a 16-bit --dtype "
                             "(bfloat16 or float16), not float32")
        if self.dtype == "float16" and self.fp8_kv:
            # Attention rounds the softmax weights times V's scales (amax / 448) to the
            # model dtype: in float16 the small heads' products fall below its normals.
            raise ValueError("an FP8 KV cache runs beside --dtype bfloat16 (in float16 the "
                             "values' scaled weights lose precision)")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size {self.block_size}: 16, 32 or 64")
        if not 0.1 <= self.memory_fraction <= 0.98:
            raise ValueError(f"memory_fraction {self.memory_fraction} is outside [0.1, 0.98]")
        if self.vocab_limit < 0:
            raise ValueError("vocab_limit must be >= 0")
        if self.automaton_pool_bytes < 0:
            raise ValueError("automaton_pool_bytes must be >= 0")
        if self.num_blocks < 0 or self.max_seqs < 1 or self.max_model_len < 2:
            raise ValueError("num_blocks >= 0, max_seqs >= 1 and max_model_len >= 2")

    @property
    def fp8_weights(self) -> bool:
        return self.quantization == "fp8"

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype == "fp8"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine batches and steps."""

    max_batched_tokens: int = field(default=2048, metadata=about(
        "tokens per engine step: decodes plus prefill chunks"))
    #: Log probabilities with this many alternatives for every sequence (-1: only
    #: for the requests that ask).
    top_logprobs: int = -1
    # Build and launch the next step while the GPU runs this one (ModelEngine.step).
    overlap: bool = field(default=True, metadata=about(
        "launch the next step while the GPU runs this one (see docs/gpu.md)"))

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be positive")
        if not -1 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs is -1 (none) or 0-20")


@dataclass(frozen=True, slots=True)
class ModelPeerOptions:
    """``dpu-frontend model-peer``: the model, where it runs, how it batches."""

    #: A config.json (or a directory with one).
    config: Path | None = field(default=None, metadata=about(
        "config.json of the model", flag="--model-config", metavar="FILE",
        none="the checkpoint's, else Qwen3-0.6B's shapes"))
    runner: RunnerOptions = field(default_factory=RunnerOptions, metadata=flat())
    engine: EngineOptions = field(default_factory=EngineOptions, metadata=flat())
    # Who writes the response records: "gpu", the record writer kernel behind each
    # step (dpu_frontend/model/publish.py); "host", the peer's Python loop.
    records: str = field(default="gpu", metadata=about(
        "who writes the response records: a GPU kernel behind each step (gpu), or the "
        "host's loop (host, the baseline)", choices=RECORDS))
    records_library: Path | None = field(default=None, metadata=about(
        "a prebuilt libdpuf_records.so", metavar="SO", none="built with nvcc on first use"))
    # Who runs the engine loop: "host", this process (model/peer.py, the baseline);
    # "gpu", a persistent scheduler kernel that launches each step itself
    # (model/gpu_scheduler.py), the host out of the token path.
    scheduler: str = field(default="host", metadata=about(
        "who runs the engine loop: this process (host, the baseline), or a persistent "
        "kernel that launches every step from the GPU (gpu: no host CPU per token)",
        choices=SCHEDULERS))
    scheduler_library: Path | None = field(default=None, metadata=about(
        "a prebuilt libdpuf_sched.so", metavar="SO", none="built with nvcc on first use"))

    def __post_init__(self) -> None:
        if self.records not in RECORDS:
            raise ValueError(f"records {self.records!r} is not one of {', '.join(RECORDS)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.scheduler == "gpu":
            if not self.runner.cuda_graphs:
                raise ValueError("--scheduler gpu launches captured steps: drop --no-cuda-graphs")
            if self.records != "gpu":
                raise ValueError("--scheduler gpu writes the records on the GPU: drop --records host")
            if self.runner.max_seqs > 1024:
                raise ValueError("--scheduler gpu runs at most 1024 sequences a step")
