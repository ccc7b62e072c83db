"""Files that hold secrets (the control-plane secret, API keys): read only when private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dpu_frontend.errors import StartupError


def read_private(path: Path, what: str) -> bytes:
    """``path``'s bytes; ``what`` names the file in errors. The file must be readable by
    its owner only: a secret others can read protects nothing."""
    try:
        mode = os.stat(path).st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise StartupError(f"cannot read {what} {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"{what} {path} is open to others "
                           f"(mode {stat.S_IMODE(mode):o}): chmod 600 it")
    return data
