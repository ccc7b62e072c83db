"""Tensor parallelism's model side on a machine without a GPU: each rank a process of its
own (``torch.distributed``'s gloo over loopback), its weights cut by
``tensor_parallel.Shard`` (random, and loaded from a checkpoint this tool writes), its
decoder run by Triton's interpreter in float32 over its own KV cache with
``layers.collective.GatheredGroup`` adding each layer's partial sums in rank order,
against the same model on one rank: every position's logits of a prefill.

    TRITON_INTERPRET=1 python -m tests.tools.cpu_tensor_parallel
    TRITON_INTERPRET=1 python -m tests.tools.cpu_tensor_parallel --models llama --sizes 2

With ``--device cuda`` rank r runs on GPU r, over NCCL, the kernels compiled (no
interpreter), on a machine with as many GPUs as the largest size. It needs PyTorch and
Triton. docs/gpu.md ("Issue 27, first step") has what it gave.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpu_frontend.model import checkpoint, registry
from dpu_frontend.model.checkpoint import Checkpoint
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers.attention import KvCache
from dpu_frontend.model.layers.collective import GatheredGroup, TensorGroup
from dpu_frontend.model.tensor_parallel import Shard
from dpu_frontend.model.weights import Params
from tests.tools.cpu_llama import PAGE, RANDOM, prefill

#: Small models of each architecture: 8 query and 2 KV heads of 64 (4 ranks share KV
#: heads), a vocabulary no rank count divides.
SHAPES: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "vocab_size": 203,
    "eos_token_id": 2, "torch_dtype": "float32"}
#: cpu_llama's random architectures, and Qwen3's with its tied head.
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "rope_theta": 1000000.0, "tie_word_embeddings": True},
    **{name: RANDOM[name] for name in ("llama3.1", "phi3", "qwen3_moe")},
}
SEED = 5


def logits(config: ModelConfig, ids: torch.Tensor, device: torch.device, *,
           weights: Path | None, shard: Shard | None = None,
           group: TensorGroup | None = None) -> torch.Tensor:
    """Every position's logits of one prefill, on one rank (``shard``) or the whole model."""
    table = registry.spec(config.architecture).weights
    if weights is None:
        params = Params.random(table, config, torch.float32, device, SEED, shard=shard)
    else:
        with Checkpoint.scan(weights, config) as source:
            params = Params.load(table, source, config, torch.float32, device, shard=shard)
    local = shard.local_config if shard is not None else config
    shape = (local.num_layers, 2, local.num_kv_heads, PAGE, local.head_dim)
    cache = KvCache(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
    model = registry.decoder_class(config.architecture)(local, params, cache, 256, group)
    return prefill(model, ids).cpu()


def rank_main(rank: int, size: int, port: int, kind: str, config: ModelConfig,
              ids: torch.Tensor, weights: Path | None, out: Path) -> None:
    device = torch.device(kind, rank if kind == "cuda" else None)
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        result = logits(config, ids, device, weights=weights, shard=Shard(config, size, rank),
                        group=GatheredGroup())
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_checkpoint(config: ModelConfig, folder: Path) -> Path:
    """The random model's tensors as an HF checkpoint, in bf16 (a float32 one would be
    loaded as views of the CPU's mapped file, which the checkpoint then cannot unmap)."""
    table = registry.spec(config.architecture).weights
    params = Params.random(table, config, torch.float32, torch.device("cpu"), SEED)
    state = params.state_dict(table, config)
    checkpoint.write(folder / "model.safetensors", {
        name: ("BF16", tuple(t.shape), t.bfloat16().view(torch.int16).numpy().tobytes())
        for name, t in state.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")})
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1: on the CPU the kernels run in Triton's "
                     "interpreter")
    if args.device == "cuda":
        # No NVLink multicast, in this process and the ranks it starts (the device tool's
        # KINDS.md: it can put a host's shared GPUs out of service).
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                          NVSHMEM_DISABLE_NVLS="1")
    device = torch.device(args.device)
    failed = 0
    for name in args.models:
        config = ModelConfig.from_dict(MODELS[name] | SHAPES, name)
        ids = torch.randint(0, config.vocab_size, (24,),
                            generator=torch.Generator().manual_seed(1))
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_checkpoint(config, Path(tmp))
            for weights in (None, folder):
                whole = logits(config, ids, device, weights=weights)
                for size in args.sizes:
                    out = Path(tmp) / f"rank0-{size}.pt"
                    mp.spawn(rank_main, (size, free_port(), args.device, config, ids, weights,
                                         out), nprocs=size)
                    split = torch.load(out)
                    error = (split - whole).abs().max().item()
                    same = int((split.argmax(-1) == whole.argmax(-1)).sum())
                    ok = split.shape == whole.shape and error < 1e-4 and same == len(ids)
                    failed += not ok
                    print(f"{name}, {'checkpoint' if weights else 'random'} weights, "
                          f"{size} ranks: logits {tuple(split.shape)}, max |difference| "
                          f"{error:.2e} (scale {whole.abs().max().item():.2f}), greedy "
                          f"{same}/{len(ids)} positions the same: {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
