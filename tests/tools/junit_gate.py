"""Sum JUnit XML reports and fail unless every required report ran tests and skipped none.

``python -m tests.tools.junit_gate build/native-junit.xml build/lower-bounds-junit.xml
--require-no-skips build/rdma-junit.xml`` prints a line per report, then one
closing line ``total: N passed, N failed, N skipped`` (over all reports: the
lower-bounds lane runs tests that the native report counts too), and exits 1
when a report is missing, ran no test, failed one, or (for the reports named
with --require-no-skips) skipped one: CI must never go green on skipped RDMA
tests.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in total:
            total[key] += int(suite.get(key, 0))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--require-no-skips", action="append", type=Path, default=[])
    args = parser.parse_args(argv)
    problems: list[str] = []
    passed = failed = skipped = 0
    for report in [*args.reports, *args.require_no_skips]:
        if not report.is_file():
            problems.append(f"{report}: missing (the suite did not run)")
            continue
        c = counts(report)
        bad = c["failures"] + c["errors"]
        ok = c["tests"] - bad - c["skipped"]
        print(f"  {report.name}: {ok} passed, {bad} failed, {c['skipped']} skipped")
        passed += ok
        failed += bad
        skipped += c["skipped"]
        if c["tests"] == 0:
            problems.append(f"{report}: no test collected")
        if bad:
            problems.append(f"{report}: {bad} failed")
        if report in args.require_no_skips and c["skipped"]:
            problems.append(f"{report}: {c['skipped']} skipped; these tests must run")
    for problem in problems:
        print(f"junit-gate: {problem}", file=sys.stderr)
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
