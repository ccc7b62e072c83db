"""The tokenizer built from a GGUF file's metadata (``dpu_frontend.text.gguf_tokenizer``),
on small files written as llama.cpp writes them: the same encodings as transformers'
GGUF conversion, its special and added tokens whole, BOS where the file asks for it,
and what it does not build refused with the reason."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from dpu_frontend.gguf import GgufError, open_gguf
from dpu_frontend.text import gguf_tokenizer
from dpu_frontend.text.token_bytes import byte_level_alphabet
from dpu_frontend.text.tokenizer import Vocabulary

#: transformers' GGUF tokenizer conversion (untyped; it needs no torch).
CONVERSION: Any = importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
BYTES = list(byte_level_alphabet())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in", "e r"]
#: Every byte, the merges' results, a control token, a user-defined one, and a control
#: token llama.cpp mislabels (spelled with a space, outside the byte alphabet).
TOKENS = ["<|endoftext|>", "<s>", *BYTES, "Ġt", "he", "Ġthe", "in", "Ġin", "er", "<think>",
          "<bad token>"]
TYPES = [3, 3, *[1] * (len(BYTES) + 6), 4, 3]


def write(path: Path, **change: Any) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(1024)
    w.add_tokenizer_model(change.get("model", "gpt2"))
    w.add_tokenizer_pre(change.get("pre", "smollm"))
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    if not change.get("no_merges"):
        w.add_token_merges(MERGES)
    w.add_bos_token_id(change.get("bos", 1))
    w.add_eos_token_id(0)
    w.add_add_bos_token(change.get("add_bos", False))
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_tokenizer(metadata: dict[str, Any]) -> Any:
    """What ``AutoTokenizer.from_pretrained(gguf_file=...)`` builds from this metadata
    (its reader needs torch; the metadata here is ours, the conversion theirs)."""
    renames: dict[str, str] = CONVERSION.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
    backend, _ = CONVERSION.convert_gguf_tokenizer(metadata["general.architecture"],
                                                   tokenizer_dict)
    return backend


def test_a_small_vocabulary_encodes_as_transformers_conversion(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write(path)
    with open_gguf(path) as f:
        ours, config = gguf_tokenizer.build(f)
        theirs = transformers_tokenizer(f.metadata)
        gguf_tokenizer.write(f, tmp_path / "tok")
    for text in ("the thin inner", " the", "<|endoftext|>the<think>in", "é 日本 🤖",
                 "<bad token> stays bytes", "  \n\t x"):
        assert ours.encode(text).ids == theirs.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    the = TOKENS.index("Ġthe")
    assert ours.encode(" the").ids == [the]
    assert ours.encode("<think>").ids == [TOKENS.index("<think>")]
    assert ours.encode("<|endoftext|>").ids == [0]
    assert ours.get_vocab_size() == len(TOKENS)  # the mislabelled token added nothing
    assert config == {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                      "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                      "model_max_length": 1024, "add_bos_token": False,
                      "tokenizer_class": "PreTrainedTokenizerFast", "source": "GGUF: unnamed"}
    vocab = Vocabulary.load(tmp_path / "tok")
    assert vocab.eos_token_ids == (0,) and vocab.model_max_length == 1024
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["bos_token"] == "<s>"


def test_a_file_that_asks_for_bos_gets_it(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write(path, add_bos=True)
    with open_gguf(path) as f:
        tokenizer, config = gguf_tokenizer.build(f)
    assert config["add_bos_token"] is True
    assert tokenizer.encode(" the").ids == [1, TOKENS.index("Ġthe")]
    assert tokenizer.encode(" the", add_special_tokens=False).ids == [TOKENS.index("Ġthe")]


@pytest.mark.parametrize(("change", "message"), [
    ({"model": "llama"}, "tokenizer.ggml.model 'llama': this builds byte-level BPE"),
    ({"pre": "llama-bpe"}, "tokenizer.ggml.pre 'llama-bpe' splits text its own way"),
    ({"no_merges": True}, "needs tokenizer.ggml.tokens, .merges"),
    ({"bos": 10_000}, "tokenizer.ggml.bos_token_id 10000 is not a token"),
])
def test_what_it_does_not_build_is_refused(tmp_path: Path, change: dict[str, Any],
                                           message: str) -> None:
    path = tmp_path / "t.gguf"
    write(path, **change)
    with open_gguf(path) as f, pytest.raises(GgufError, match=message):
        gguf_tokenizer.build(f)
