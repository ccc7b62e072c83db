"""LlamaForCausalLM, Phi3ForCausalLM and Qwen3MoeForCausalLM on a real GPU, against HF
``transformers``' own classes: small random configurations (Llama 3.1's RoPE scaling
among them), and SmolLM2-135M-Instruct's GGUF file as setup installs it
(``python -m dpu_frontend.text.smollm2``; on the GPU machine with ``--prefix`` and
``DPU_FRONTEND_SMOLLM2_PREFIX``). Each test prints what it measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.gguf_checkpoint import load_config
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import smollm2_gguf, smollm2_tokenizer
from tests.gpu.test_model import (
    TIE_MARGIN,
    bf16_logits_match,
    engine,
    greedy,
    hf_forward,
    prompts,
)

pytestmark = pytest.mark.gpu

#: SmolLM2-135M's shapes, 4 layers: GQA 3:1 at a head size of 64, a tied head.
SMALL_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 9,
    "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "vocab_size": 49152, "tie_word_embeddings": True,
    "eos_token_id": 2, "torch_dtype": "float32",
}


#: Llama 3.1's RoPE scaling (its published fields) on the same shapes: at a head size of
#: 64 and this base, frequencies fall in each of its three bands.
SMALL_LLAMA31: dict[str, Any] = SMALL_LLAMA | {
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072}


#: Phi-4's layout (fused qkv_proj and gate_up_proj, an untied head) at small shapes.
SMALL_PHI3: dict[str, Any] = SMALL_LLAMA | {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 640,
    "num_attention_heads": 5, "num_key_value_heads": 1, "tie_word_embeddings": False,
    "rope_theta": 250000.0, "sliding_window": None, "pad_token_id": 0,
}


#: Qwen3-30B-A3B's layout at small shapes: Qwen3's attention (q and k norms), every MLP
#: 16 experts of 128, 4 routed a token.
SMALL_MOE: dict[str, Any] = SMALL_LLAMA | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}

#: transformers' classes by model_type, untyped here: config and model go in pairs.
HF_CLASSES: dict[str, tuple[Any, Any]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's experts (``mlp.experts.{e}.gate_proj.weight``, ...) as transformers
    5 holds them: ``mlp.experts.gate_up_proj`` [experts, 2 I, H] (gate, then up) and
    ``mlp.experts.down_proj`` [experts, H, I]."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k}
    for layer in layers:
        count = len([k for k in state if k.startswith(f"{layer}.mlp.experts.")
                     and k.endswith(".down_proj.weight")])
        expert = [f"{layer}.mlp.experts.{e}." for e in range(count)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([state[p + "gate_proj.weight"], state[p + "up_proj.weight"]]) for p in expert])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [state[p + "down_proj.weight"] for p in expert])
    return out


def hf_llama(config_dict: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    config_class, model_class = HF_CLASSES[config_dict.get("model_type", "llama")]
    hf_config = config_class(**{k: v for k, v in config_dict.items()
                                if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "eager"
    # MoE: the loop over the experts the engine's rounding follows (not grouped_mm).
    hf_config._experts_implementation = "eager"
    with torch.device("cuda"):
        model = model_class(hf_config).to(torch.float32)
    missing, unexpected = model.load_state_dict(fused_experts(state), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def greedy_transformers(model: Any, prompt: list[int], n: int,
                        eos: int | None = None) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, ``n`` of them or up to (and without) ``eos``, and the
    top-2 logit margin of each choice (the one of ``eos`` too)."""
    out = hf_forward(model, torch.tensor([prompt], device="cuda"), None)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        token = int(torch.argmax(logits))
        if token == eos:
            break
        tokens.append(token)
        out = hf_forward(model, torch.tensor([[token]], device="cuda"), out.past_key_values)
    return tokens, margins


def same_greedy(ours: list[list[int]], model: Any, ps: list[list[int]], n: int) -> int:
    """Each of ``ours`` against transformers' greedy tokens; a divergence is excused only
    by a float32 tie. The count of identical sequences."""
    identical = 0
    for i, prompt in enumerate(ps):
        theirs, margins = greedy_transformers(model, prompt, n)
        diverge = next((j for j in range(n) if ours[i][j] != theirs[j]), None)
        if diverge is None:
            identical += 1
            continue
        print(f"prompt {i}: diverges at token {diverge}, top-2 margin {margins[diverge]:.3g}")
        assert margins[diverge] < TIE_MARGIN, (i, diverge, margins[diverge])
    return identical


@pytest.mark.parametrize("config_dict", [SMALL_LLAMA, SMALL_LLAMA31, SMALL_PHI3, SMALL_MOE],
                         ids=["llama", "llama3.1", "phi3", "qwen3_moe"])
def test_a_small_random_model_is_transformers_in_float32(config_dict: dict[str, Any]) -> None:
    config = ModelConfig.from_dict(config_dict, "small")
    eng = engine("float32", num_blocks=512, config=config)
    ps = [[t % 49152 for t in p] for p in prompts(16, 20261128)]
    ours = [r.tokens for r in eng.generate(ps, [greedy(64)] * len(ps))]
    model = hf_llama(config_dict, eng.runner.state_dict())
    identical = same_greedy(ours, model, ps, 64)
    print(f"small random {config.architecture} (4 layers), float32, 16 prompts x 64 tokens "
          f"batched: {identical} identical, {16 - identical} excused by a tie")
    del model, eng
    torch.cuda.empty_cache()


#: The first four are the README's; all sixteen are the equality test's prompts.
@pytest.mark.parametrize("config_dict", [SMALL_LLAMA, SMALL_PHI3, SMALL_MOE],
                         ids=["llama", "phi3", "qwen3_moe"])
def test_a_small_random_model_is_transformers_in_bfloat16(config_dict: dict[str, Any]) -> None:
    """Teacher-forced logits, with the Qwen3 test's bounds (an H200 probe measured a
    mean |difference| of 0.0071 of the logits' std for both)."""
    config = ModelConfig.from_dict(config_dict, "small")
    eng = engine("bfloat16", num_blocks=256, config=config)
    model = hf_llama(config_dict, eng.runner.state_dict()).to(torch.bfloat16)
    seqs = [[t % 49152 for t in p] for p in prompts(4, 20261129, low=150, high=300)]
    bf16_logits_match(eng, model, seqs, f"small random {config.architecture}")
    del model, eng
    torch.cuda.empty_cache()


QUESTIONS = ["What is the capital of France?", "What is 2 + 3?",
             "Name the largest planet in the solar system.", "Who wrote Romeo and Juliet?",
             "How many legs does a spider have?", "What colour is the sky on a clear day?",
             "Translate 'thank you' into French.", "What is the boiling point of water?",
             "Give me three words that rhyme with cat.", "What is a prime number?",
             "Write a haiku about the sea.", "Why do leaves change colour in autumn?",
             "What does a CPU do?", "List the days of the week.",
             "What is the opposite of hot?", "Explain what a ring buffer is in one sentence."]


def test_smollm2_answers_as_transformers_does(smollm2_reference: Any) -> None:
    vocab = Vocabulary.load(smollm2_tokenizer())
    assert vocab.chat_template is not None
    template = ChatTemplate(vocab.chat_template, vocab.special_tokens, "smollm2")
    ps = [vocab.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    eng = engine("float32", num_blocks=512, weights=smollm2_gguf(),
                 config=load_config(smollm2_gguf()))
    ours = [r.tokens for r in eng.generate(ps, [greedy(64)] * len(ps))]
    identical = same_greedy(ours, smollm2_reference, ps, 64)
    (eos,) = vocab.eos_token_ids
    texts = [vocab.decode(t[:t.index(eos)] if eos in t else t) for t in ours]
    for q, text in zip(QUESTIONS[:4], texts, strict=False):
        print(f"{q!r} -> {text!r}")
    assert "Paris" in texts[0] and "5" in texts[1]
    print(f"SmolLM2-135M-Instruct (GGUF, Q4_1), float32, {len(ps)} chat prompts x 64 tokens "
          f"batched: {identical} token for token transformers' (gguf_file=), "
          f"{len(ps) - identical} excused by a tie")
    del eng
    torch.cuda.empty_cache()
