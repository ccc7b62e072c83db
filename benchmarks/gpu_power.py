"""GPU power while a measurement runs, from ``nvidia-smi``, for tokens per joule (issue 13).

``PowerSampler`` runs ``nvidia-smi --query-gpu=power.draw --format=csv,noheader,nounits
-lms PERIOD`` beside the measurement and keeps every reading with the time it came.
``energy(start, end)`` integrates the readings over a window (trapezoids, the ends
held at the nearest reading), in joules; tokens over joules is the experiment's
efficiency figure. The board's power sensor updates on its own schedule (tens of ms
on an H100), so windows of seconds are what it measures well.

    with PowerSampler() as power:
        start = time.monotonic(); ...; end = time.monotonic()
        joules = power.energy(start, end)
"""

from __future__ import annotations

import bisect
import itertools
import shutil
import subprocess
import threading
import time
from types import TracebackType

#: How often nvidia-smi is asked to print a reading.
PERIOD_MS = 100


class PowerSampler:
    """Readings of one GPU's board power, taken in a background thread."""

    def __init__(self, gpu: int = 0, period_ms: int = PERIOD_MS,
                 command: str = "nvidia-smi") -> None:
        path = shutil.which(command)
        if path is None:
            raise RuntimeError(f"{command} is not on PATH: GPU power cannot be read here")
        self._argv = [path, f"--id={gpu}", "--query-gpu=power.draw",
                      "--format=csv,noheader,nounits", f"-lms={period_ms}"]
        self._times: list[float] = []
        self._watts: list[float] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self.bad_lines = 0  # "[N/A]", "[Unknown Error]": a board without a power sensor

    def __enter__(self) -> PowerSampler:
        self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-power", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join()
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                watts = float(line.strip())
            except ValueError:
                self.bad_lines += 1
                continue
            with self._lock:
                self._times.append(time.monotonic())
                self._watts.append(watts)

    @property
    def readings(self) -> int:
        with self._lock:
            return len(self._times)

    def energy(self, start: float, end: float) -> float:
        """Joules between two ``time.monotonic()`` instants, from the readings."""
        if end <= start:
            raise ValueError("the window ends before it starts")
        with self._lock:
            times, watts = list(self._times), list(self._watts)
        if not times:
            raise RuntimeError("no power reading arrived (nvidia-smi printed none)")
        return integrate(times, watts, start, end)

    def mean_watts(self, start: float, end: float) -> float:
        return self.energy(start, end) / (end - start)


def integrate(times: list[float], watts: list[float], start: float, end: float) -> float:
    """The area under the piecewise-linear power curve through the readings, between
    ``start`` and ``end``; before the first reading and after the last, held flat."""
    def at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if i == 0:
            return watts[0]
        if i == len(times):
            return watts[-1]
        t0, t1 = times[i - 1], times[i]
        if t1 == t0:
            return watts[i]
        return watts[i - 1] + (watts[i] - watts[i - 1]) * (t - t0) / (t1 - t0)

    points = [start, *(t for t in times if start < t < end), end]
    return sum((b - a) * (at(a) + at(b)) / 2 for a, b in itertools.pairwise(points))
