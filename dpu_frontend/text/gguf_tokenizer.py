"""The tokenizer a GGUF file carries, as the daemon loads tokenizers: a ``tokenizer.json``
and a ``tokenizer_config.json`` (its special tokens, its chat template).

A GGUF file has no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, each
token's type and the special tokens' ids as metadata (``tokenizer.ggml.*``), and the
chat template as ``tokenizer.chat_template``. ``build`` makes the tokenizer those
describe the way transformers' GGUF conversion makes it
(``transformers.integrations.gguf``), so that both encode every text alike (tested on
SmolLM2-135M-Instruct's file): a byte-level BPE over the file's tokens and merges,
split by GPT-2's pattern, its control tokens (type 3) matched whole as special tokens
and its user-defined ones (type 4) as added tokens. A file whose tokenizer is another
kind (sentencepiece's ``llama``, ``t5``), or whose ``tokenizer.ggml.pre`` names a
split of its own (Llama 3's, Qwen2's), is refused with the reason: served wrong, its
prompts would be other tokens than the model was trained on.

The standard library and ``tokenizers`` only, as the daemon.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from dpu_frontend.gguf import GgufError, GgufFile
from dpu_frontend.text.token_bytes import byte_level_alphabet

#: ``tokenizer.ggml.pre`` values split by GPT-2's pattern, as transformers splits every
#: value it has no pattern of its own for. (llama.cpp splits ``smollm`` digit by digit
#: first; transformers' conversion, which the equality is held to, does not.)
GPT2_SPLIT_PRE = ("default", "gpt2", "smollm")
CONTROL, USER_DEFINED = 3, 4
#: The special tokens' roles, by their ``tokenizer.ggml`` id key.
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
               "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def build(f: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of ``f`` and its ``tokenizer_config.json``; GgufError for a
    tokenizer this does not build."""
    m = f.metadata
    kind = m.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"tokenizer.ggml.model {kind!r}: this builds byte-level BPE "
                        "tokenizers (gpt2) only")
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre not in GPT2_SPLIT_PRE:
        raise GgufError(f"tokenizer.ggml.pre {pre!r} splits text its own way: not "
                        f"implemented (GPT-2's split serves {', '.join(GPT2_SPLIT_PRE)})")
    tokens, merges = m.get("tokenizer.ggml.tokens"), m.get("tokenizer.ggml.merges")
    types = m.get("tokenizer.ggml.token_type") or [1] * len(tokens or ())
    if not isinstance(tokens, list) or not isinstance(merges, list) or len(types) != len(tokens):
        raise GgufError("the tokenizer needs tokenizer.ggml.tokens, .merges and a "
                        ".token_type per token")
    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    spellings = set(alphabet.values())

    def spelled(token: str) -> str:
        # A token outside the byte alphabet is a control token llama.cpp wrote as text.
        return token if set(token) <= spellings else "".join(
            alphabet[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): i for i, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        if not left or not right:
            raise GgufError(f"merge {merge!r} is not two tokens")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet would add an id past the
    # model's vocabulary: llama.cpp mislabels some; transformers leaves them out too.
    tokenizer.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, kind_ in zip(tokens, types, strict=True)
        if kind_ == CONTROL and set(token) <= spellings])
    tokenizer.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, kind_ in zip(tokens, types, strict=True)
        if kind_ == USER_DEFINED and token in vocab])
    config: dict[str, Any] = {}
    for role, key in SPECIAL_IDS.items():
        token_id = m.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
                raise GgufError(f"tokenizer.ggml.{key} {token_id!r} is not a token")
            config[role] = tokens[token_id]
    add_bos = bool(m.get("tokenizer.ggml.add_bos_token", False))
    bos = config.get("bos_token")
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, vocab[spelled(bos)])])
    template = m.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    context = m.get(f"{m.get('general.architecture')}.context_length")
    if isinstance(context, int) and context > 0:
        config["model_max_length"] = context
    config |= {"add_bos_token": add_bos, "tokenizer_class": "PreTrainedTokenizerFast",
               "source": f"GGUF: {m.get('general.name', 'unnamed')}"}
    return tokenizer, config


def write(f: GgufFile, dest: Path) -> None:
    """``build``'s two files into ``dest``, each replaced in one rename."""
    tokenizer, config = build(f)
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in (("tokenizer.json", tokenizer.to_str()),
                       ("tokenizer_config.json", json.dumps(config, ensure_ascii=False, indent=1))):
        partial = dest / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(dest / name)
