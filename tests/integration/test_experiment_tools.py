"""The tools of Blink's experiment (issue 13) that run without a GPU: the noisy co-tenant
(benchmarks.interference) and the power integration of benchmarks.gpu_power, this one
against a stand-in for nvidia-smi that prints readings as the real one does."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import interference
from benchmarks.gpu_power import PowerSampler, integrate


def eventually_true(check: Callable[[], bool], what: str, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_core_lists_read_as_taskset_writes_them() -> None:
    assert interference.parse_cores("2-5,8") == [2, 3, 4, 5, 8]
    assert interference.parse_cores("0") == [0]
    with pytest.raises(ValueError, match="backwards"):
        interference.parse_cores("5-2")
    with pytest.raises(ValueError, match="twice"):
        interference.parse_cores("1,0-2")


def test_the_co_tenant_holds_its_cores_while_it_runs_and_leaves_none_behind() -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    with interference.interference(cores, hog_mib=8) as load:
        assert load.running() and len(load.pids) == len(cores)
        eventually_true(lambda: all(os.sched_getaffinity(pid) == {core}
                                    for pid, core in zip(load.pids, cores, strict=True)),
                        "each process pinned to its core")
        pids = load.pids
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_energy_is_the_area_under_the_readings() -> None:
    times, watts = [1.0, 2.0, 3.0], [100.0, 300.0, 300.0]
    assert integrate(times, watts, 1.0, 3.0) == pytest.approx(200 + 300)
    assert integrate(times, watts, 0.0, 1.0) == pytest.approx(100)  # held before the first
    assert integrate(times, watts, 1.5, 2.0) == pytest.approx(0.5 * (200 + 300) / 2)
    assert integrate(times, watts, 3.0, 5.0) == pytest.approx(600)  # held after the last


def test_the_sampler_reads_nvidia_smi_and_skips_what_is_not_a_number(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo '[N/A]'\n"
                    "while :; do echo 250.00; sleep 0.01; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with PowerSampler(period_ms=10) as power:
        eventually_true(lambda: power.readings >= 5, "readings from nvidia-smi")
        now = time.monotonic()
        assert power.mean_watts(now - 1.0, now) == pytest.approx(250.0)
    assert power.bad_lines == 1


def test_no_nvidia_smi_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvidia-smi is not on PATH"):
        PowerSampler()
