"""The sampling specification (the NumPy reference the GPU sampler is tested against)."""

from __future__ import annotations

import numpy as np
import pytest

from dpu_frontend.model import sampling
from dpu_frontend.model.sampling import History, fmix32, kept_probabilities, sample
from dpu_frontend.ring.records import SamplingParams


def fmix32_plain(x: int) -> int:
    """MurmurHash3's fmix32 in plain uint32 arithmetic."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def params(**kw: float | int) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]


def logits(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_hash_matches_plain_uint32_arithmetic() -> None:
    xs = np.array([0, 1, 2, 0xFFFFFFFF, 0x12345678, 1 << 31], dtype=np.int64)
    assert fmix32(xs).tolist() == [fmix32_plain(int(x)) for x in xs]


def test_uniforms_are_in_the_open_interval_and_flat() -> None:
    u = sampling.uniforms(sampling.row_key(42, 0), 200_000)
    assert u.dtype == np.float32 and u.min() > 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert np.array_equal(u, sampling.uniforms(sampling.row_key(42, 0), 200_000))
    assert not np.array_equal(u, sampling.uniforms(sampling.row_key(42, 1), 200_000))
    assert sampling.row_key(2**64 - 1, 3) != sampling.row_key(2**63 - 1, 3)  # the high bits count


def test_the_top_hash_is_no_uniform_of_1() -> None:
    """A token whose 24 bits are all ones: (2^24 - 0.5) / 2^24 rounds to 1 in float32;
    its exponential -log(1) would be 0, and a dropped token's 0 / 0 a NaN that argmax
    takes (a token outside top-p, or outside a constraint, drawn). It is U_MAX instead."""
    keys = np.arange(1 << 25, dtype=np.int64)
    key = int(keys[(fmix32(keys) >> 8) == 0xFFFFFF][0])  # token 0's bits are fmix32(key)
    u = sampling.uniforms(key, 1)
    assert u[0] == sampling.U_MAX < 1
    assert (np.array([0.0], np.float32) / -np.log(u)).tolist() == [0.0]  # no NaN


def test_greedy_is_the_first_maximum() -> None:
    assert sample(logits(1, 3, 3, 2), params(temperature=0.0), 0, 0) == 1
    assert sample(logits(1, 3, 3, 2), params(temperature=1e-6), 0, 0) == 1


def test_penalties_follow_vllm() -> None:
    h = History(prompt=(0,), output=(1, 1, 2))
    out = sampling.apply_penalties(logits(2, 2, -2, 5),
                                   params(repetition_penalty=2.0, frequency_penalty=0.5,
                                          presence_penalty=0.25), h)
    # token 0: in the prompt only; 1: twice in the output; 2: once, negative; 3: unseen
    assert out.tolist() == [1.0, 1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 5.0]


def test_filters() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert np.count_nonzero(kept_probabilities(x, params(top_p=0.8))) == 2
    assert np.count_nonzero(kept_probabilities(x, params(top_p=0.81))) == 3
    assert np.count_nonzero(kept_probabilities(x, params(top_p=1e-6))) == 1
    assert np.count_nonzero(kept_probabilities(x, params(top_k=3))) == 3
    assert np.count_nonzero(kept_probabilities(x, params(min_p=0.29))) == 3  # 0.15 >= 0.5 * 0.29
    assert np.count_nonzero(kept_probabilities(x, params(min_p=0.31))) == 2
    tied = logits(1, 2, 2, 0)
    assert np.count_nonzero(kept_probabilities(tied, params(top_k=2))) == 2
    assert np.count_nonzero(kept_probabilities(tied, params(top_k=1))) == 2  # ties with the k-th stay


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_draws_follow_the_distribution(temperature: float) -> None:
    x = logits(0.0, 1.0, 2.0, -1.0, 0.5)
    p = np.exp(x / temperature) / np.exp(x / temperature).sum()
    n = 20_000
    counts = np.bincount([sample(x, params(temperature=temperature), seed, 0) for seed in range(n)],
                         minlength=5)
    # every bin within 5 standard deviations of its expectation
    assert np.all(np.abs(counts - n * p) < 5 * np.sqrt(n * p * (1 - p)) + 1)


def test_draws_are_a_function_of_seed_and_step() -> None:
    x = np.zeros(1000, dtype=np.float32)
    p = params(temperature=1.0)
    assert sample(x, p, 7, 3) == sample(x, p, 7, 3)
    assert len({sample(x, p, 7, step) for step in range(50)}) > 40
    assert len({sample(x, p, seed, 0) for seed in range(50)}) > 40


def test_log_softmax_and_top_logprobs() -> None:
    x = logits(1, 2, 3, 0)
    lp = sampling.log_softmax(x)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    top = sampling.top_logprobs(x, 2)
    assert [t for t, _ in top] == [2, 1] and np.isclose(top[0][1], lp[2])
