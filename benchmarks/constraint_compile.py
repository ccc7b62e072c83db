"""Structured output's compile step on the DPU side: for each constraint, the time to
compile it into the token automaton the GPU walks, and the automaton's size
(``text.constraints``), beside the bare limit measured in the same run: outlines-core's
``Index`` alone over the same vocabulary, which the compiler runs and then packs.

Each constraint is compiled by a fresh compiler sharing one vocabulary (built once, its
time printed), so nothing comes from the cache.

    python -m benchmarks.constraint_compile
    python -m benchmarks.constraint_compile --tokenizer build/assets/tokenizers/llama3_1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import record
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.constraints import ConstraintCompiler, ConstraintSpec
from dpu_frontend.text.tokenizer import Vocabulary
from tests.constraint_cases import ORDER, PERSON

CONSTRAINTS = {
    "choice of 3": ConstraintSpec.choice(["yes", "no", "maybe so (a+b)?"]),
    "regex [0-9]{3}-[a-z]{1,5}": ConstraintSpec.regex(r"[0-9]{3}-[a-z]{1,5}"),
    "schema: person (enum, bounded strings and array)": ConstraintSpec.json_schema(PERSON),
    "schema: order (nested, pattern, anyOf)": ConstraintSpec.json_schema(ORDER),
    "json_object (any object)": ConstraintSpec.json_object(),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a tokenizer directory (default: the bundled Qwen3 one)")
    args = ap.parse_args(argv)
    vocab = Vocabulary.load(args.tokenizer or default_tokenizer_dir())
    eos = vocab.eos_token_ids[0]
    start = time.perf_counter()
    shared = ConstraintCompiler(vocab.tokenizer, eos, max_automaton_bytes=1 << 30)
    vocabulary = shared.vocabulary()
    figures: dict[str, object] = {"tokenizer": str(vocab.source),
                                  "vocabulary built once, s": round(time.perf_counter() - start, 2)}
    from outlines_core import Index

    for name, spec in CONSTRAINTS.items():
        compiler = ConstraintCompiler(vocab.tokenizer, eos, max_automaton_bytes=1 << 30)
        compiler._vocabulary = vocabulary
        pattern = spec.pattern()
        start = time.perf_counter()
        Index(pattern, vocabulary)
        bare = time.perf_counter() - start
        start = time.perf_counter()
        automaton = compiler.compile(spec)
        took = time.perf_counter() - start
        dense = sum(1 for at in automaton.mask_at if at >= 0)
        figures[name] = (f"compile {took:.2f} s (bare limit: outlines-core's Index "
                         f"{bare:.2f} s), {automaton.states} states ({dense} dense), "
                         f"{len(automaton.list_tokens):,} listed, {automaton.nbytes / 1e6:.2f} MB")
    record("constraint_compile", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
