"""The Llama chain on a machine without a GPU: SmolLM2-135M-Instruct's GGUF file as setup
installs it, through ``GgufCheckpoint``, ``Params.load`` and ``Llama.forward`` run by
Triton's interpreter on the CPU in float32, greedy, beside transformers loading the same
file itself (its own dequantization and permutation):

    TRITON_INTERPRET=1 python -m tests.tools.cpu_llama "What is the capital of France?" 8

or, with ``--random phi3`` (or ``llama``, ``llama3.1``), a two-layer model of random
weights written as an HF checkpoint (safetensors, bf16 values) through ``Checkpoint``,
``Params.load`` and the decoder, beside transformers' own class on the same weights,
every position's logits:

    TRITON_INTERPRET=1 python -m tests.tools.cpu_llama --random phi3

It needs PyTorch (a CPU build), Triton and ``accelerate`` (transformers' GGUF loader)
beside the test tools. A forward of the whole sequence a token: about two minutes a
token on a development machine. docs/gpu.md ("Issue 25, first steps") has what it gave.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from dpu_frontend.model import checkpoint, registry
from dpu_frontend.model.checkpoint import Checkpoint
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.gguf_checkpoint import GgufCheckpoint, load_config
from dpu_frontend.model.layers.attention import ATTN_ROWS, Attention, KvCache
from dpu_frontend.model.models.base import Decoder
from dpu_frontend.model.models.llama import Llama
from dpu_frontend.model.weights import Params
from dpu_frontend.text import smollm2
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.tokenizer import Vocabulary

PAGE = 32


def prefill(model: Decoder, ids: list[int] | Any) -> Any:
    """Every position's float32 logits after one prefill of ``ids`` from position 0 (on
    the device of the model's cache)."""
    t = len(ids)
    pages = -(-t // PAGE)
    rows = ATTN_ROWS // model.config.group_size
    dev = model.cache.k.device

    def i32(values: list[int]) -> Any:
        return torch.tensor(values, dtype=torch.int32, device=dev)

    attn = Attention(positions=torch.arange(t, device=dev),
                     cache_slots=torch.arange(t, device=dev),
                     tables=torch.arange(pages, dtype=torch.int32, device=dev)[None],
                     tile_seq=torch.zeros(-(-t // rows), dtype=torch.int32, device=dev),
                     tile_row=torch.arange(0, t, rows, dtype=torch.int32, device=dev),
                     q_start=i32([0]), q_len=i32([t]), ctx_start=i32([0]))
    return model.logits(model.forward(torch.as_tensor(ids, device=dev), attn))


#: The random models: two layers, GQA 2:1 at a head size of 64.
RANDOM: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rope_theta": 500000.0, "tie_word_embeddings": True},
    # Llama 3.1's RoPE scaling: at a head size of 64 and this base, frequencies fall in
    # each of its three bands (kept, interpolated, divided by the factor).
    "llama3.1": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "rope_theta": 500000.0, "tie_word_embeddings": False,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 1024}},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "rope_theta": 250000.0, "tie_word_embeddings": False, "sliding_window": None},
    # Qwen3-30B-A3B's layout: every MLP 8 experts of 64, 4 routed a token.
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "rope_theta": 1000000.0, "tie_word_embeddings": False, "num_experts": 8,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "head_dim": 64},
}
SHAPES = {"hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-5, "vocab_size": 50, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2, "torch_dtype": "float32"}


def checkpoint_tensors(name: str, array: Any) -> dict[str, Any]:
    """A transformers parameter as a checkpoint holds it: transformers 5 keeps a MoE
    layer's experts as [experts, 2 I, H] and [experts, H, I] tensors, a checkpoint one
    tensor an expert and projection (``mlp.experts.{e}.gate_proj.weight``, ...)."""
    prefix, _, last = name.rpartition("mlp.experts.")
    if last == "gate_up_proj":
        inner = array.shape[1] // 2
        return {f"{prefix}mlp.experts.{e}.{proj}.weight": part
                for e in range(array.shape[0])
                for proj, part in (("gate_proj", array[e, :inner]), ("up_proj", array[e, inner:]))}
    if last == "down_proj":
        return {f"{prefix}mlp.experts.{e}.down_proj.weight": array[e] for e in range(array.shape[0])}
    return {name: array}


def random_model(kind: str) -> None:
    config_dict = RANDOM[kind] | SHAPES
    hf_args = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    classes: dict[str, tuple[Any, Any]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    config_class, model_class = classes[config_dict["model_type"]]
    hf_config = config_class(**hf_args)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference: Any = model_class(hf_config)
    reference.eval()
    state: dict[str, Any] = {}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            # bf16 values, stored as bf16: Params.load copies them (it would keep a float32
            # tensor of the CPU's mapped file, which the checkpoint then cannot unmap).
            p.copy_((torch.randn_like(p) * 0.2).bfloat16().float())
            state.update(checkpoint_tensors(name, p.detach().numpy()))
    config = ModelConfig.from_dict(config_dict, kind)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.write(Path(tmp) / "model.safetensors", {
            name: ("BF16", array.shape, (array.view("<u4") >> 16).astype("<u2").tobytes())
            for name, array in state.items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")})
        with Checkpoint.scan(Path(tmp), config) as source:
            params = Params.load(registry.spec(config.architecture).weights, source, config,
                                 torch.float32, torch.device("cpu"))
    shape = (config.num_layers, 2, config.num_kv_heads, PAGE, config.head_dim)
    model = registry.decoder_class(config.architecture)(
        config, params, KvCache(torch.zeros(shape), torch.zeros(shape)), 256)
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    t = len(ids)
    ours = prefill(model, ids)
    with torch.no_grad():
        theirs = reference(ids[None]).logits[0].float()
    same = bool((ours.argmax(-1) == theirs.argmax(-1)).all())
    print(f"{config.architecture}: max |logit difference| over {t} positions "
          f"{float((ours - theirs).abs().max()):.2e} (logits up to "
          f"{float(theirs.abs().max()):.1f}); the same argmax everywhere: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("tokens", type=int, nargs="?", default=8)
    parser.add_argument("--random", choices=sorted(RANDOM),
                        help="a random two-layer model of this architecture instead")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the kernels run in Triton's interpreter")
    if args.random:
        random_model(args.random)
        return
    path = smollm2.gguf_path()
    config = load_config(path)
    with GgufCheckpoint.scan(path, config) as checkpoint:
        params = Params.load(registry.spec(config.architecture).weights, checkpoint, config,
                             torch.float32, torch.device("cpu"))
    vocab = Vocabulary.load(smollm2.tokenizer_dir())
    if vocab.chat_template is None:
        raise SystemExit("the tokenizer has no chat template")
    prompt = ChatTemplate(vocab.chat_template, vocab.special_tokens, "smollm2").render(
        [{"role": "user", "content": args.question}])
    ids = vocab.encode(prompt, add_special_tokens=True)
    reference: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference.eval()
    pages = -(-(len(ids) + args.tokens) // PAGE)
    shape = (config.num_layers, pages + 1, config.num_kv_heads, PAGE, config.head_dim)
    ours, theirs, worst, start = list(ids), list(ids), 0.0, time.monotonic()
    for step in range(args.tokens):
        model = Llama(config, params, KvCache(torch.zeros(shape), torch.zeros(shape)),
                      config.max_position)
        mine = prefill(model, ours)[-1]
        with torch.no_grad():
            other = reference(torch.tensor([theirs])).logits[0, -1].float()
        worst = max(worst, float((mine - other).abs().max()))
        ours.append(int(mine.argmax()))
        theirs.append(int(other.argmax()))
        print(f"{step} ({time.monotonic() - start:.0f} s): {vocab.decode(ours[len(ids):])!r} | "
              f"transformers {vocab.decode(theirs[len(ids):])!r}", flush=True)
    print(f"max |logit difference| {worst:.2e}; the same tokens: {ours == theirs}")


if __name__ == "__main__":
    main()
