"""Once started, the daemon gives the C heap's free pages back (the tokenizer is loaded)
and tunes the garbage collector for the objects of its tokens."""

from __future__ import annotations

import gc
from pathlib import Path

from tokenizers import Tokenizer

from dpu_frontend.daemon import GC_THRESHOLDS, release_free_memory, tune_garbage_collector
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


def test_what_start_built_leaves_the_collectors_sight() -> None:
    thresholds = gc.get_threshold()
    built = [[i] for i in range(3)]  # tracked, as a started daemon's app and templates
    try:
        tune_garbage_collector()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() >= len(built)
        seen = {id(o) for o in gc.get_objects()}  # what collections still walk
        assert all(gc.is_tracked(o) and id(o) not in seen for o in built)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
