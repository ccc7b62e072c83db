"""A noisy co-tenant, for Blink's experiment (issue 13): a busy loop on each of the given
host cores and a memory-bandwidth hog, in child processes, while a measurement runs.

The interference the experiment asks for is "a busy-loop process on every host core
except the daemon's, plus a memory-bandwidth hog". ``interference(cores)`` starts a
spinner pinned to each core of ``cores`` but the first, and on the first the hog: a
process that copies a buffer larger than the last-level cache back and forth, so that
it takes memory bandwidth from whatever shares the socket (the host-driven scheduler's
launches, the GPU's host-side copies). Each child exits with the context, and with
its parent (``PR_SET_PDEATHSIG``): a measurement that dies leaves no load behind.

    python -m benchmarks.interference --cores 2-15 --seconds 60    # standalone
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from benchmarks.common import cpu_seconds, record

#: The hog's two buffers, each well past a server's last-level cache (tens of MiB).
HOG_MIB = 256

#: A child's first lines: die with the parent (prctl PR_SET_PDEATHSIG = 1, SIGKILL = 9),
#: then stay on one core.
_PRELUDE = """
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)
os.sched_setaffinity(0, {int(sys.argv[1])})
"""
_SPIN = _PRELUDE + """
while True:
    pass
"""
_HOG = _PRELUDE + """
size = int(sys.argv[2]) << 20
a, b = bytearray(size), bytearray(b"\\x5a" * size)
while True:  # each slice assignment is one memcpy of the whole buffer
    a[:] = b
    b[:] = a
"""


def parse_cores(spec: str) -> list[int]:
    """``"2-5,8"`` -> ``[2, 3, 4, 5, 8]`` (taskset's list syntax)."""
    cores: list[int] = []
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        first, last = int(low), int(high or low)
        if first > last:
            raise ValueError(f"core range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"core list {spec!r} names a core twice")
    return cores


@dataclass
class Interference:
    """The running co-tenant: its processes and the cores each holds."""

    cores: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def cpu_seconds(self) -> float:
        """CPU the co-tenant has burnt so far, all its processes together."""
        return sum(cpu_seconds(pid) for pid in self.pids)

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)


@contextlib.contextmanager
def interference(cores: Sequence[int], *, hog_mib: int = HOG_MIB) -> Iterator[Interference]:
    """The hog on ``cores[0]``, a spinner on each of the others, for the ``with`` block."""
    if not cores:
        raise ValueError("interference needs at least one core")
    load = Interference(list(cores))
    try:
        for i, core in enumerate(cores):
            code, args = (_HOG, [str(core), str(hog_mib)]) if i == 0 else (_SPIN, [str(core)])
            load.procs.append(subprocess.Popen([sys.executable, "-c", code, *args]))
        yield load
    finally:
        for proc in load.procs:
            proc.kill()
        for proc in load.procs:
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", required=True, help="taskset list: the hog on the first")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--hog-mib", type=int, default=HOG_MIB)
    args = ap.parse_args(argv)
    cores = parse_cores(args.cores)
    with interference(cores, hog_mib=args.hog_mib) as load:
        time.sleep(args.seconds)
        busy = load.cpu_seconds() / args.seconds
    record("interference", {"cores": args.cores, "seconds": args.seconds,
                            "cores busy (of the cores given)": round(busy, 2),
                            "processes": len(cores)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
