"""Schemathesis against the served /openapi.json: every check, over every operation.

A real daemon and echo peer over shm, with an API key, so that the
authentication checks (a request without the key must get 401) have
something to check. The run must find nothing: no 5xx, every response as
the document says, every schema-valid request accepted, every invalid one
refused, a 405 with its ``Allow`` header. At least ``MIN_CASES`` cases.

The seed is fixed, so a failure reproduces; set ``DPU_FRONTEND_FUZZ_SEED``
to explore others (the run prints the seed it used, and ``st replay`` each
failure's id). Bodies carrying a JSON schema or a regex to compile are left out
(``schemathesis_hooks.py`` says why). One worker: Debian 12's Python 3.11.2 trips over its own AST
recursion check ("AST constructor recursion depth mismatch", fixed in
3.11.5) when Hypothesis describes a strategy from two threads at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

from tests.stack import MODEL, running_stack

#: Bodies that carry a constraint to compile are left out (the module says why).
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")

KEY = "schemathesis-key-0123456789abcdef"
MIN_CASES = 1000
EXAMPLES_PER_OPERATION = 200  # 7 operations
SEED = os.environ.get("DPU_FRONTEND_FUZZ_SEED", "20261126")


def test_schemathesis_finds_nothing_with_every_check(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY}\n")
    keys.chmod(0o600)
    # echo: each answer is its prompt again, so no generated request runs for long.
    # On a loaded 2-core machine the first json_object compile has passed the default
    # bound of 20 s (a 400 before any case ran): 45 s, still under schemathesis' request
    # timeout, so that a case whose constraint compiles slowly gets its 400 in time.
    with running_stack("shm", mode="echo", timeout=120,
                       serve_args=("--api-key-file", str(keys),
                                   "--constraint-compile-timeout", "45")) as stack:
        # json_object, the one constraint the fuzzing sends that takes long to compile
        # (seconds, once: then it is cached), compiled before the clock of any case runs.
        with OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0,
                    timeout=120) as client:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={
                "response_format": {"type": "json_object"}})
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{stack.base_url}/openapi.json",
             "--checks", "all", "--max-examples", str(EXAMPLES_PER_OPERATION),
             "--workers", "1", "--seed", SEED, "--generation-database", "none",
             "--header", f"Authorization: Bearer {KEY}", "--request-timeout", "60",
             "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
            env=os.environ | {"SCHEMATHESIS_HOOKS": str(HOOKS)})
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-20000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated is not None, report[-5000:]
    assert int(generated.group(1)) >= MIN_CASES, report[-5000:]
