"""The test tokenizers installed by ``python -m tests.tools.assets`` (deploy/dev.sh does it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dpu_frontend.text import smollm2
from dpu_frontend.text.assets import default_tokenizer_dir

ASSETS = Path(os.environ.get("DPU_FRONTEND_ASSETS", Path(__file__).parent.parent / "build/assets"))
TOKENIZERS = ("qwen3", "llama3_1", "gpt2", "mistral")


def tokenizer_dir(name: str) -> Path:
    """The folder of a test tokenizer; a missing one skips, or fails where assets are required."""
    if name == "qwen3":
        return default_tokenizer_dir()
    folder = ASSETS / "tokenizers" / name
    if not (folder / "tokenizer.json").is_file():
        message = f"test tokenizer {name} missing in {folder}: python -m tests.tools.assets"
        if os.environ.get("DPU_FRONTEND_REQUIRE_ASSETS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return folder


#: Where SmolLM2 is installed: the venv, or ``DPU_FRONTEND_SMOLLM2_PREFIX`` (the GPU
#: machine's install, ``python -m dpu_frontend.text.smollm2 --prefix DIR``).
SMOLLM2_PREFIX = Path(os.environ.get("DPU_FRONTEND_SMOLLM2_PREFIX", sys.prefix))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file as deploy/dev.sh's setup installs it
    (``python -m dpu_frontend.text.smollm2``); missing, it skips, or fails where assets
    are required."""
    if not smollm2.is_installed(SMOLLM2_PREFIX):
        message = (f"SmolLM2 missing in {smollm2.gguf_path(SMOLLM2_PREFIX)}: "
                   f"{sys.executable} -m dpu_frontend.text.smollm2")
        if os.environ.get("DPU_FRONTEND_REQUIRE_ASSETS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return smollm2.gguf_path(SMOLLM2_PREFIX)


def smollm2_tokenizer() -> Path:
    """The tokenizer installed beside it."""
    smollm2_gguf()
    return smollm2.tokenizer_dir(SMOLLM2_PREFIX)
