"""The inter-token latency is counted in place and added to its histogram in one go
(``Samples``): a scrape must read what one ``observe`` per sample would have given."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_frontend.metrics import FLUSH_EVERY, Metrics, Samples

NAME = "dpu_frontend_inter_token_latency_seconds"


def histogram_samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    (family,) = [m for m in metrics.registry.collect() if m.name == NAME.removesuffix("_total")]
    return {(s.name, s.labels.get("le", "")): s.value for s in family.samples
            if not s.name.endswith("_created")}


@given(st.lists(st.floats(0, 100, allow_nan=False) | st.sampled_from([0.001, 0.02, 100.0]),
                max_size=200))
def test_samples_add_up_to_one_observe_each(amounts: list[float]) -> None:
    batched, direct = Metrics(), Metrics()
    samples = Samples(batched.itl)
    for amount in amounts:
        samples.add(amount)
        direct.itl.observe(amount)
    samples.flush()
    got, want = histogram_samples(batched), histogram_samples(direct)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_a_long_stream_shows_in_the_histogram_before_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = Metrics()
    clock = iter(float(t) for t in range(10_000))
    monkeypatch.setattr("dpu_frontend.metrics.time.monotonic", lambda: next(clock))
    timer = metrics.request(arrival=0.0)
    for tokens in range(1, FLUSH_EVERY + 2):  # the first gives TTFT, then FLUSH_EVERY gaps
        timer.on_delta(0, tokens)
    assert histogram_samples(metrics)[(NAME + "_count", "")] == FLUSH_EVERY
    timer.on_delta(0, FLUSH_EVERY + 3)  # two tokens in one delta: one sample, of half the gap
    assert histogram_samples(metrics)[(NAME + "_count", "")] == FLUSH_EVERY
    timer.finish(prompt_tokens=5)
    assert histogram_samples(metrics)[(NAME + "_count", "")] == FLUSH_EVERY + 1
    assert histogram_samples(metrics)[(NAME + "_sum", "")] == FLUSH_EVERY + 0.5



def test_a_write_of_unknown_arrival_is_not_a_sample() -> None:
    metrics = Metrics()
    timer = metrics.request(arrival=0.0)
    timer.on_write(0.0)  # a delta whose record's arrival is not known
    timer.finish(prompt_tokens=1)
    assert metrics.registry.get_sample_value("dpu_frontend_delivery_seconds_count") == 0
