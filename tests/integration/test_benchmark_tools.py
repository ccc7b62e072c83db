"""The benchmark tools for a few seconds each, so that they keep working: the load
generator (benchmarks.loadgen) against the shared stack, and benchmarks.idle_cost
on its own. They assert what was delivered and recorded, never how fast."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from benchmarks import (
    automaton_intake,
    common,
    frontend_load,
    frontend_scaling,
    idle_cost,
    light_load,
)
from benchmarks.loadgen import Job, Result, full_batch_tokens_per_s, run, schedule, summary
from tests.stack import Stack


def test_the_schedule_is_poisson_or_all_at_once() -> None:
    assert schedule(5, float("inf"), random.Random(1)) == [0.0] * 5
    times = schedule(2000, 100.0, random.Random(1))
    assert times == sorted(times) and 15 < times[-1] < 25  # 2,000 arrivals at 100/s


def test_the_full_batch_rate_leaves_out_the_tail() -> None:
    """Four answers of 10 tokens over 1, 2, 3 and 4 s, sent at once, and a server two
    wide: full until the third ends (3 s), when the fourth had given 3/4 of its tokens."""
    results = [Result(0.0, 0.0, float(d), 10, 10) for d in (1, 2, 3, 4)]
    assert full_batch_tokens_per_s(results, 2) == pytest.approx(37.5 / 3)
    assert full_batch_tokens_per_s(results, 5) == 0.0  # never that many in flight


@pytest.mark.parametrize("rate", [float("inf"), 200.0])
def test_every_request_streams_to_its_end(stack: Stack, rate: float) -> None:
    rng = random.Random(3)
    jobs = [Job([rng.randrange(100, 5000) for _ in range(rng.randrange(1, 30))],
                rng.randrange(1, 24)) for _ in range(40)]
    jobs.append(Job("Tell me about the ring.", 12))
    done = run(stack.base_url, jobs, rate, clients=2)
    assert len(done.results) == len(jobs) and done.clients == 2
    assert sorted(r.tokens for r in done.results) == sorted(j.max_tokens for j in jobs)
    assert all(r.events >= 1 and 0 < r.ttft <= r.duration for r in done.results)
    assert done.elapsed > 0 and done.client_cpu_s > 0
    figures = summary(done, "smoke")
    assert figures["smoke: mean tokens per request"] == round(
        sum(j.max_tokens for j in jobs) / len(jobs), 1)


def test_the_idle_cost_benchmark_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks.idle_cost for a moment: it starts its stack, opens its streams,
    measures and records (the figures themselves are not asserted)."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results.jsonl")
    assert idle_cost.main(["--streams", "20", "--seconds", "0.3"]) == 0
    entry = json.loads((tmp_path / "results.jsonl").read_text())
    assert entry["benchmark"] == "idle_cost" and entry["streams open"] == 20


def test_the_automaton_intake_benchmark_runs(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """benchmarks.automaton_intake on a 1 MB automaton: its requests go through a real ring
    layout, the first is checked, the later ones find its copy; recorded."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results.jsonl")
    assert automaton_intake.main(["--mb", "1", "--requests", "2"]) == 0
    entry = json.loads((tmp_path / "results.jsonl").read_text())
    assert entry["benchmark"] == "automaton_intake" and 0.9 < entry["automaton, MB"] < 1.1


def test_the_light_load_benchmark_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks.light_load for a moment: the saturated figure, then one load paced in
    replay (its streams in step and out of step) and in steps, each measured and
    recorded; this process's cores as before."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results.jsonl")
    cores = os.sched_getaffinity(0)
    assert light_load.main(["--loads", "4x20", "--seconds", "0.5", "--settle", "0.3"]) == 0
    assert os.sched_getaffinity(0) == cores
    entry = json.loads((tmp_path / "results.jsonl").read_text())
    assert entry["benchmark"] == "light_load"
    assert any(k.startswith("4 x 20 tokens/s (replay)") for k in entry)
    assert any(k.startswith("4 x 20 tokens/s (replay, out of step)") for k in entry)
    assert any(k.startswith("4 streams, a 20 ms step") for k in entry)


def test_the_frontend_load_benchmark_runs(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """benchmarks.frontend_load for a moment: the peer in GPU-like steps (a batch of 4
    for 8 requests: half of them wait), a closed loop of 4 streams for 2 s, admission,
    then the bare limits; it records, writes its JSON and its plots (figures not
    asserted)."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results.jsonl")
    out = tmp_path / "frontend.json"
    assert frontend_load.main(["--rates", "inf", "--requests", "8", "--streams", "4",
                               "--seconds", "2", "--admission", "2", "--step-ms", "5",
                               "--batch", "4", "--lengths", str(tmp_path / "none.json"),
                               "--cap", "8", "--json", str(out),
                               "--png", str(tmp_path / "plots")]) == 0
    figures = json.loads(out.read_text())
    assert figures["all at once: tokens/s delivered"] > 0
    assert figures["4 streams: tokens/s delivered"] > 0
    assert figures[f"4 streams: {frontend_load.DELIVERY}"].count(" / ") == 1
    assert "inter-token p50 / p90 / p99, ms (a step is 5)" in " ".join(figures)
    assert figures["4 streams: daemon events per CPU second / bare paced"] > 0
    assert figures["bare encode: prompts per CPU second (one thread)"] > 0
    assert [r["loop"] for r in figures["runs"]] == ["open", "closed"]
    assert (tmp_path / "plots" / "cpu_per_token_vs_streams.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.jsonl").read_text())["benchmark"] == "frontend_load"


def test_the_frontend_scaling_benchmark_runs(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """benchmarks.frontend_scaling for a moment: one worker (this machine has no core to
    spare for a second beside the load), 4 streams for 1 s; its JSON and its plot."""
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results.jsonl")
    out = tmp_path / "scaling.json"
    assert frontend_scaling.main(["--workers", "1", "--streams", "4", "--seconds", "1",
                                  "--step-ms", "5", "--lengths", str(tmp_path / "none.json"),
                                  "--cap", "8", "--json", str(out),
                                  "--png", str(tmp_path / "plots")]) == 0
    (point,) = json.loads(out.read_text())["points"]
    assert point["workers"] == 1 and point["events/s"] > 0 and point["of linear"] == 1.0
    assert (tmp_path / "plots" / "throughput_vs_workers.png").stat().st_size > 0
