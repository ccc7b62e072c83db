"""The Llama chain on a machine without a GPU: SmolLM2-135M-Instruct's GGUF file as setup
installs it, through ``GgufCheckpoint``, ``Params.load`` and ``Llama.forward`` run by
Triton's interpreter on the CPU in float32, greedy, beside transformers loading the same
file itself (its own dequantization and permutation):

    TRITON_INTERPRET=1 python -m tests.tools.cpu_llama "What is the capital of France?" 8

It needs PyTorch (a CPU build), Triton and ``accelerate`` (transformers' GGUF loader)
beside the test tools. A forward of the whole sequence a token: about two minutes a
token on a development machine. docs/gpu.md ("Issue 25, first steps") has what it gave.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import transformers

from dpu_frontend.model import registry
from dpu_frontend.model.gguf_checkpoint import GgufCheckpoint, load_config
from dpu_frontend.model.layers.attention import ATTN_ROWS, Attention, KvCache
from dpu_frontend.model.models.llama import Llama
from dpu_frontend.model.weights import Params
from dpu_frontend.text import smollm2
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.tokenizer import Vocabulary

PAGE = 32


def prefill(model: Llama, ids: list[int]) -> Any:
    """The last position's float32 logits after one prefill of ``ids``."""
    t = len(ids)
    pages = -(-t // PAGE)
    rows = ATTN_ROWS // model.config.group_size

    def i32(values: list[int]) -> Any:
        return torch.tensor(values, dtype=torch.int32)

    attn = Attention(positions=torch.arange(t), cache_slots=torch.arange(t),
                     tables=torch.arange(pages, dtype=torch.int32)[None],
                     tile_seq=torch.zeros(-(-t // rows), dtype=torch.int32),
                     tile_row=torch.arange(0, t, rows, dtype=torch.int32),
                     q_start=i32([0]), q_len=i32([t]), ctx_start=i32([0]))
    hidden = model.forward(torch.tensor(ids), attn)
    return model.logits(hidden[-1:])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("tokens", type=int)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the kernels run in Triton's interpreter")
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
        mine = prefill(model, ours)
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
