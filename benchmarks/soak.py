"""The long soak: tests/soak.py for as long as asked (30 minutes by default), recorded.

A daemon and a replay peer over shm, the load at ``--load`` of the capacity
measured at the start of the same run (printed beside the figures as the
limit), a fifth of the clients leaving mid-stream. It fails (exit 1) on any
unexpected error or 5xx, a descriptor kept, a request left in flight, or RSS
growing ``--rss-limit`` or more after the warm-up.

    python -m benchmarks.soak --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from benchmarks.common import record
from tests.soak import soak
from tests.stack import running_stack


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--warmup-minutes", type=float, default=5)
    parser.add_argument("--load", type=float, default=0.7, help="share of measured capacity")
    parser.add_argument("--disconnect", type=float, default=0.2,
                        help="share of clients that leave mid-stream")
    parser.add_argument("--rss-limit", type=float, default=0.05)
    args = parser.parse_args()
    with running_stack("shm", timeout=120) as stack:
        report = asyncio.run(soak(stack.base_url, stack.daemon.pid,
                                  duration_s=args.minutes * 60,
                                  warmup_s=args.warmup_minutes * 60, load=args.load,
                                  disconnect=args.disconnect))
    problems = report.problems(args.rss_limit)
    record("soak_shm", {**report.figures(), "load": args.load,
                        "limit: capacity measured in this run (requests/s)":
                            round(report.capacity_rps, 1),
                        "problems": problems or "none"})
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
