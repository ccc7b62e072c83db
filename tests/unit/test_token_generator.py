"""The reference peer's deterministic generator."""

from __future__ import annotations

import pytest

from dpu_frontend.config import PeerConfig
from dpu_frontend.peer.generator import StepBatch, TokenGenerator
from dpu_frontend.ring import FinishReason, GenerateRecord, ResponseRecord, SamplingParams

EOS = 99


def engine(mode: str = "replay", rate: float = 0.0, per_step: int = 4) -> TokenGenerator:
    return TokenGenerator(mode=mode, corpus_ids=[[1, 2, 3, 4, 5], [6, 7, 8]], eos_token_ids=[EOS],
                  tokens_per_s=rate, tokens_per_step=per_step)


def run(e: TokenGenerator, now: float = 0.0, steps: int = 50) -> list[ResponseRecord]:
    out: list[ResponseRecord] = []
    for i in range(steps):
        out += e.step(now + i, 100)
    return out


def tokens(records: list[ResponseRecord]) -> list[int]:
    return [t for r in records for t in r.tokens]


def admit(e: TokenGenerator, rid: int, prompt: tuple[int, ...], max_tokens: int,
          stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> None:
    params = SamplingParams(max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    e.admit(GenerateRecord(rid, 0, len(prompt), params), prompt, 0.0)


def test_replay_stops_at_the_document_end_without_emitting_eos() -> None:
    e = engine()
    admit(e, 1, (42,), max_tokens=100)
    records = run(e)
    assert records[-1].finish == FinishReason.STOP
    assert EOS not in tokens(records)
    assert all(len(r.tokens) <= 4 for r in records)
    assert e.active == 0 and e.stats.completed == 1


def test_max_tokens_gives_length() -> None:
    e = engine()
    admit(e, 1, (42,), max_tokens=2)
    records = run(e)
    assert len(tokens(records)) == 2 and records[-1].finish == FinishReason.LENGTH


def test_ignore_eos_continues_into_the_next_document() -> None:
    e = engine()
    admit(e, 1, (42,), max_tokens=12, ignore_eos=True)
    records = run(e)
    assert len(tokens(records)) == 12 and records[-1].finish == FinishReason.LENGTH


def test_stop_token_ids_stop_without_being_emitted() -> None:
    e = engine(mode="echo")
    admit(e, 1, (5, 6, 7, 8), max_tokens=10, stop_token_ids=(7,))
    records = run(e)
    assert tokens(records) == [5, 6] and records[-1].finish == FinishReason.STOP


def test_echo_returns_the_prompt() -> None:
    e = engine(mode="echo")
    admit(e, 1, (5, 6, 7), max_tokens=10)
    assert tokens(run(e)) == [5, 6, 7]


def test_rate_paces_tokens() -> None:
    e = engine(mode="echo", rate=10.0)
    admit(e, 1, tuple(range(1, 50)), max_tokens=40)
    assert len(tokens(e.step(0.0, 100))) == 1  # the first token at once
    assert len(tokens(e.step(0.55, 100))) == 5  # 10/s: five more by 0.55 s


def test_cancel_ends_with_a_cancelled_record() -> None:
    e = engine(mode="echo", rate=1.0)
    admit(e, 1, (1, 2, 3), max_tokens=3)
    e.step(0.0, 10)
    assert e.cancel(1) == ResponseRecord(1, (), FinishReason.CANCELLED)
    assert e.cancel(1) is None
    assert e.stats.cancelled_ids == [1] and e.active == 0


def test_same_prompt_same_generation() -> None:
    a, b = engine(), engine()
    admit(a, 1, (3, 1, 4), max_tokens=50)
    admit(b, 9, (3, 1, 4), max_tokens=50)
    assert tokens(run(a)) == tokens(run(b))


def test_one_record_per_sequence_per_step_whatever_the_budget() -> None:
    """The grouping of tokens into records depends on the steps only, never on how many
    records the ring could take: the CUDA kernel groups them the same way."""
    def records(budget: int) -> list[ResponseRecord]:
        e = engine(mode="echo", per_step=3)
        admit(e, 1, tuple(range(10, 20)), max_tokens=100)
        admit(e, 2, tuple(range(30, 37)), max_tokens=5)
        out: list[ResponseRecord] = []
        for _ in range(20):
            out += e.step(0.0, budget)
        return out

    full = records(100)
    assert [(r.tokens, r.finish) for r in full if r.request_id == 1] == [
        ((10, 11, 12), FinishReason.NONE), ((13, 14, 15), FinishReason.NONE),
        ((16, 17, 18), FinishReason.NONE), ((19,), FinishReason.STOP)]  # the source ended
    assert [(r.tokens, r.finish) for r in full if r.request_id == 2] == [
        ((30, 31, 32), FinishReason.NONE), ((33, 34), FinishReason.LENGTH)]
    for budget in (1, 2, 3):
        assert sorted(records(budget), key=lambda r: r.request_id) == sorted(
            full, key=lambda r: r.request_id)


def test_replay_start_is_crc32_of_prompt_seed_and_flag() -> None:
    """The rule the CUDA kernel implements (peer_kernel.cu: replay_start_cursor)."""
    import struct
    import zlib

    from dpu_frontend.peer.generator import replay_start

    prompt = [1, 2, 300000]
    data = struct.pack("<3I", *prompt) + struct.pack("<Q", 7) + b"\x01"
    assert replay_start(prompt, 7, 1000) == zlib.crc32(data) % 1000
    data = struct.pack("<3I", *prompt) + bytes(8) + b"\x00"
    assert replay_start(prompt, None, 1000) == zlib.crc32(data) % 1000


def test_log_probabilities_are_one_hot_a_token_per_record() -> None:
    e = TokenGenerator(mode="replay", corpus_ids=[[1, 2, 3, 4, 5]], eos_token_ids=[EOS],
                       tokens_per_s=0, tokens_per_step=4, logprob_tokens_per_step=1)
    for rid, k in ((1, 3), (2, 0)):
        params = SamplingParams(6, ignore_eos=True, logprobs=k)
        e.admit(GenerateRecord(rid, 0, 1, params), (42,), 0.0)
    e.admit(GenerateRecord(3, 0, 1, SamplingParams(6, ignore_eos=True)), (42,), 0.0)
    records = run(e)
    by_id = {rid: [r for r in records if r.request_id == rid] for rid in (1, 2, 3)}
    for rid in (1, 2):
        assert all(len(r.tokens) <= 1 for r in by_id[rid])
        entries = [e for r in by_id[rid] for e in r.logprobs or ()]
        assert len(entries) == 6 and all(x.logprob == 0.0 for x in entries)
    # One alternative has any probability: the token itself, listed when one is asked for.
    assert [x.top for r in by_id[1] for x in r.logprobs or ()] == [
        ((t, 0.0),) for t in tokens(by_id[1])]
    assert all(x.top == () for r in by_id[2] for x in r.logprobs or ())
    assert all(r.logprobs is None for r in by_id[3]) and max(len(r.tokens) for r in by_id[3]) == 4
    assert tokens(by_id[1]) == tokens(by_id[2]) == tokens(by_id[3])


def stepped(steps: StepBatch) -> TokenGenerator:
    return TokenGenerator(mode="echo", corpus_ids=[[1]], eos_token_ids=[EOS], tokens_per_s=50.0,
                          tokens_per_step=4, steps=steps)


def test_gpu_like_steps_give_each_running_sequence_one_token_a_step() -> None:
    """``--step-ms``: a burst of one-token records every period (the per-sequence rate is
    not used), the first token at the step after the request came."""
    def step(now: float) -> list[ResponseRecord]:  # in request order (the loop rotates)
        return sorted(e.step(now, 100), key=lambda r: r.request_id)

    e = stepped(StepBatch(0.02))
    admit(e, 1, (10, 11, 12, 13), max_tokens=3)
    e.admit(GenerateRecord(2, 0, 2, SamplingParams(5)), (20, 21), 0.005)
    assert step(0.0) == [] and step(0.019) == []  # step 0: the prefill
    assert step(0.02) == [ResponseRecord(1, (10,)), ResponseRecord(2, (20,))]
    assert step(0.039) == []  # nothing more within the step
    assert step(0.045) == [ResponseRecord(1, (11,)), ResponseRecord(2, (21,))]
    # A step the loop missed is not made up: one token, whatever the time since.
    assert step(0.2) == [ResponseRecord(1, (12,), FinishReason.LENGTH),
                         ResponseRecord(2, (), FinishReason.STOP)]


def test_the_batch_is_shared_by_every_channel_and_the_rest_wait() -> None:
    """``--batch 2`` over two channels: three sequences, two decode; when one ends, the
    one that waited longest takes its slot and gets its first token a step later."""
    steps = StepBatch(0.01, batch=2)
    a, b = stepped(steps), stepped(steps)
    admit(a, 1, (1, 2), max_tokens=2)
    admit(b, 1, (5, 6, 7, 8), max_tokens=4)
    admit(a, 2, (9, 9, 9), max_tokens=3)  # no slot: waits
    assert (steps.running, steps.waiting) == (2, 1)
    got: dict[int, list[tuple[object, tuple[int, ...]]]] = {}  # by step
    for step in range(1, 5):
        now = step * 0.01
        got[step] = [(r.request_id, r.tokens) for r in a.step(now, 100)] + [
            ("b", r.tokens) for r in b.step(now, 100)]
    assert got[1] == [(1, (1,)), ("b", (5,))]
    assert got[2] == [(1, (2,)), ("b", (6,))]  # request a1 ends here: a2 takes its slot
    assert got[3] == [(2, (9,)), ("b", (7,))]
    assert got[4] == [(2, (9,)), ("b", (8,))]
    assert (steps.running, steps.waiting) == (1, 0)
    a.cancel(2)
    assert steps.running == 0


def test_gpu_like_steps_are_peer_flags() -> None:
    with pytest.raises(ValueError, match="needs GPU-like steps"):
        PeerConfig(batch=8)
    assert PeerConfig(step_s=0.02, batch=256).batch == 256
    with pytest.raises(ValueError, match="step period"):
        StepBatch(0.0)
