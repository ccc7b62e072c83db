"""The model engine's settings and the ``model-peer`` flags that build them.

No torch here: the CLI parses and validates these on any machine (a bad flag
is a usage error before a GPU is touched), and CI tests them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
RECORDS = ("gpu", "host")
SCHEDULERS = ("host", "gpu")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How the model is placed on the GPU."""

    dtype: str = "bfloat16"
    device: int = 0
    #: Checkpoint directory (HF layout, safetensors); None: seeded random weights.
    weights: Path | None = None
    weight_seed: int = 0
    block_size: int = 32
    #: KV cache blocks; 0: as many as ``memory_fraction`` of the GPU leaves.
    num_blocks: int = 0
    memory_fraction: float = 0.85
    max_seqs: int = 256
    max_model_len: int = 8192
    #: Decode steps as CUDA graphs (one per batch-size bucket); False: eager.
    cuda_graphs: bool = True
    #: Token ids the sampler may draw: the tokenizer's (a model's vocabulary is padded,
    #: Qwen3's 151,936 rows for the tokenizer's 151,669 ids); 0: every row.
    vocab_limit: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size {self.block_size}: 16, 32 or 64")
        if not 0.1 <= self.memory_fraction <= 0.98:
            raise ValueError(f"memory_fraction {self.memory_fraction} is outside [0.1, 0.98]")
        if self.vocab_limit < 0:
            raise ValueError("vocab_limit must be >= 0")
        if self.num_blocks < 0 or self.max_seqs < 1 or self.max_model_len < 2:
            raise ValueError("num_blocks >= 0, max_seqs >= 1 and max_model_len >= 2")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_batched_tokens: int = 2048
    #: Log probabilities with this many alternatives for every sequence (-1: only
    #: for the requests that ask).
    top_logprobs: int = -1
    #: Build and launch the next step while the GPU runs this one (ModelEngine.step).
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be positive")
        if not -1 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs is -1 (none) or 0-20")


@dataclass(frozen=True, slots=True)
class ModelPeerOptions:
    """``dpu-frontend model-peer``: the model, where it runs, how it batches."""

    #: A config.json (or a directory with one); None: the checkpoint's, else Qwen3-0.6B's.
    config: Path | None
    runner: RunnerOptions
    engine: EngineOptions
    #: Who writes the response records: "gpu", the record writer kernel behind each
    #: step (dpu_frontend/model/publish.py); "host", the peer's Python loop.
    records: str = "gpu"
    #: A prebuilt libdpuf_records.so; None: built with nvcc on first use.
    records_library: Path | None = None
    #: Who runs the engine loop: "host", this process (model/peer.py, the baseline);
    #: "gpu", a persistent scheduler kernel that launches each step itself
    #: (model/gpu_scheduler.py), the host out of the token path.
    scheduler: str = "host"
    #: A prebuilt libdpuf_sched.so; None: built with nvcc on first use.
    scheduler_library: Path | None = None

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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    r, e = RunnerOptions(), EngineOptions()
    add = parser.add_argument
    add("--weights", type=Path, default=None, metavar="DIR",
        help="HF-layout safetensors checkpoint (default: seeded random weights: real "
             "arithmetic, gibberish text)")
    add("--model-config", type=Path, default=None, metavar="FILE",
        help="config.json of the model (default: the checkpoint's, else Qwen3-0.6B's shapes)")
    add("--dtype", choices=DTYPES, default=r.dtype)
    add("--device", type=int, default=r.device, help="CUDA device index")
    add("--weight-seed", type=int, default=r.weight_seed, help="seed of the random weights")
    add("--max-seqs", type=int, default=r.max_seqs, help="sequences in a batch (default %(default)s)")
    add("--max-model-len", type=int, default=r.max_model_len,
        help="longest prompt + output, tokens (default %(default)s)")
    add("--kv-blocks", type=int, default=r.num_blocks,
        help="KV cache blocks, 0: what --memory-fraction of the GPU leaves (default %(default)s)")
    add("--block-size", type=int, default=r.block_size, choices=(16, 32, 64),
        help="tokens per KV block (default %(default)s)")
    add("--memory-fraction", type=float, default=r.memory_fraction)
    add("--max-batched-tokens", type=int, default=e.max_batched_tokens,
        help="tokens per engine step: decodes plus prefill chunks (default %(default)s)")
    add("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
        help="run every step eagerly")
    add("--overlap", action=argparse.BooleanOptionalAction, default=e.overlap,
        help="launch the next step while the GPU runs this one (default: %(default)s; "
             "see docs/gpu.md)")
    add("--records", choices=RECORDS, default="gpu",
        help="who writes the response records: a GPU kernel behind each step (default), or "
             "the host's loop (the baseline)")
    add("--records-library", type=Path, default=None, metavar="SO",
        help="a prebuilt libdpuf_records.so (default: built with nvcc on first use)")
    add("--scheduler", choices=SCHEDULERS, default="host",
        help="who runs the engine loop: this process (host, the baseline), or a persistent "
             "kernel that launches every step from the GPU (gpu: no host CPU per token)")
    add("--scheduler-library", type=Path, default=None, metavar="SO",
        help="a prebuilt libdpuf_sched.so (default: built with nvcc on first use)")


def model_peer_options(args: argparse.Namespace) -> ModelPeerOptions:
    """From the parsed flags; a ValueError names what is wrong."""
    runner = RunnerOptions(
        dtype=args.dtype, device=args.device, weights=args.weights, weight_seed=args.weight_seed,
        block_size=args.block_size, num_blocks=args.kv_blocks,
        memory_fraction=args.memory_fraction, max_seqs=args.max_seqs,
        max_model_len=args.max_model_len, cuda_graphs=args.cuda_graphs,
    )
    return ModelPeerOptions(args.model_config, runner,
                            EngineOptions(max_batched_tokens=args.max_batched_tokens,
                                          overlap=args.overlap),
                            records=args.records, records_library=args.records_library,
                            scheduler=args.scheduler, scheduler_library=args.scheduler_library)
