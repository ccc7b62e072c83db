"""The daemon gives the C heap's free pages back once the tokenizer is loaded."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from dpu_frontend.daemon import release_free_memory
from dpu_frontend.text.assets import default_tokenizer_dir


def resident_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_the_tokenizers_parse_leaves_no_free_heap_resident() -> None:
    tokenizer = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    before = resident_kib()
    assert release_free_memory()  # glibc, as on every machine this runs on
    assert resident_kib() <= before
    assert tokenizer.encode("still whole").ids  # what was in use stays in use
