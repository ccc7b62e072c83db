"""Sampling on the GPU: ``dpu_frontend.model.sampling``'s algorithm over a batch.

Every operation is per row (elementwise, or a reduction along the vocabulary
of one row), so a row's token does not depend on the rest of the batch. The
random draw is a hash of (seed, output index, token id), the same bits as the
NumPy reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from dpu_frontend.model.layers.race import race
from dpu_frontend.model.metadata import SamplingRows

# The reference's hash, applied to int64 tensors: the same operators, the same bits.
from dpu_frontend.model.sampling import (
    _GOLDEN,
    _MASK32,
    _STEP_ADD,
    GREEDY_BELOW,
    fmix32,
)
from dpu_frontend.ring.layout import MAX_TOP_LOGPROBS

if TYPE_CHECKING:  # it imports this module's to_device
    from dpu_frontend.model.layers.constrain import DeviceAutomata


@dataclass
class BatchParams:
    """One row per sampling sequence, on the device."""

    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, <= 0: off
    min_p: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    repetition: torch.Tensor  # float32
    seed: torch.Tensor  # int64 (a u64's bits)
    step: torch.Tensor  # int64: the output index being drawn
    #: The host's rows, whose facts (``any_top_k``, ``all_greedy``...) let a batch skip
    #: whole stages.
    host: SamplingRows


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to the device without waiting for the GPU: a copy from pageable
    memory blocks the host until the stream's earlier work (the step's graph) is done,
    so the host could not build the next step meanwhile. Pinned, the copy is queued
    (the pinned allocator keeps the buffer until the copy has run)."""
    if not host.numel():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def batch_params(rows: SamplingRows, device: torch.device) -> BatchParams:
    """The device arrays of a step's rows: one queued copy for the float rows, one for
    the integer rows."""
    f = to_device(torch.from_numpy(rows.floats), device)
    i = to_device(torch.from_numpy(rows.ints), device)
    return BatchParams(
        temperature=f[0], top_p=f[1], min_p=f[2], presence=f[3], frequency=f[4], repetition=f[5],
        top_k=i[0], seed=i[1], step=i[2], host=rows)


@dataclass
class Drawn:
    tokens: torch.Tensor  # [B] int64
    logprob: torch.Tensor | None  # [B] float32: the drawn token's
    top_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] float32
    #: Events around the step's GPU work (the runner's), for its GPU time.
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    #: The four results' copies in pinned host memory (``send_home``).
    home: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                torch.Tensor | None] | None = None

    def send_home(self, start: torch.cuda.Event) -> None:
        """Queue the results' copies to the host right behind this step's work, so that
        ``lists`` waits for this step alone: a blocking ``tolist`` would queue its copy
        behind whatever was launched since (an overlapped engine's next step)."""
        self.home = (_pinned(self.tokens), *(None if t is None else _pinned(t)
                                              for t in (self.logprob, self.top_ids,
                                                        self.top_logprobs)))
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.span = (start, end)

    def lists(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                             list[list[float]] | None]:
        """Tokens, their log probabilities, the alternatives' ids and theirs, once this
        step's copies have landed (the wait releases the GIL: the peer's loop runs on)."""
        if self.home is None or self.span is None:
            raise RuntimeError("the results were not sent home")
        self.span[1].synchronize()
        tokens, logprob, top_ids, top_logprobs = self.home
        return (tokens.tolist(), None if logprob is None else logprob.tolist(),
                None if top_ids is None else top_ids.tolist(),
                None if top_logprobs is None else top_logprobs.tolist())

    def gpu_seconds(self) -> float:
        """The step's GPU time, from its first operation to its last; call after
        ``lists``."""
        if self.span is None:
            return 0.0
        start, end = self.span
        return float(start.elapsed_time(end)) / 1e3


def _pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class SlotTokens:
    """What the sampler reads and writes per runner slot, on the device: each slot's
    tokens (the prompt, then every drawn token: the next step's inputs), and for the
    penalties its output counts and its prompt's tokens. One row more than the slots:
    the GPU scheduler's padding rows draw into it."""

    tokens: torch.Tensor  # [slots + 1, max_model_len] int64
    counts: torch.Tensor  # [slots + 1, vocab] int32
    in_prompt: torch.Tensor  # [slots + 1, vocab] bool


class Sampler:
    """``vocab_limit``: the ids that may be drawn (the tokenizer's; a model's vocabulary is
    padded past them); 0: every row of the logits."""

    def __init__(self, vocab_limit: int) -> None:
        self.vocab_limit = vocab_limit

    def step(self, logits: torch.Tensor, params: BatchParams, slots: torch.Tensor,
             positions: torch.Tensor, state: SlotTokens, top_logprobs: int,
             automata: DeviceAutomata | None = None) -> Drawn:
        """One step's draws: row ``i`` of ``logits`` is the sequence in slot ``slots[i]``,
        whose token goes to ``positions[i]`` of its row of ``state.tokens``. The eager
        runner and the GPU scheduler's captured sampler graphs both run this, so a token
        is drawn by the same operations either way. ``top_logprobs`` >= 0: the log
        probabilities too, with that many alternatives (the model's: before the
        constraint's mask, the penalties and the temperature). ``automata``: where the
        constrained rows' automata are (``layers.constrain``), walked here."""
        if 0 < self.vocab_limit < logits.shape[1]:
            # Padding rows of the embedding are no token: never drawn, no probability.
            logits[:, self.vocab_limit:] = float("-inf")
        walk = automata if automata is not None and params.host.any_constrained else None
        allowed = walk.mask(logits, slots) if walk is not None else logits
        penalized = self.penalize(allowed, params, slots, state.counts, state.in_prompt)
        tokens = self.draw(penalized, params)
        if walk is not None:
            walk.advance(tokens, slots)
        state.tokens[slots, positions] = tokens
        state.counts[slots, tokens] += 1
        if top_logprobs < 0:
            return Drawn(tokens, None, None, None)
        return Sampler.logprobs(logits, tokens, top_logprobs)

    def penalize(self, logits: torch.Tensor, p: BatchParams, slots: torch.Tensor,
                 counts: torch.Tensor, in_prompt: torch.Tensor) -> torch.Tensor:
        """``counts`` [slots, V]: output occurrences; ``in_prompt`` [slots, V] bool;
        row i is the sequence in slot ``slots[i]``. Gathered only when a row needs them."""
        if not p.host.any_penalty:
            return logits
        counts = counts[slots]
        seen = in_prompt[slots] | (counts > 0)
        r = p.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        c = counts.to(torch.float32)
        return logits - p.frequency[:, None] * c - p.presence[:, None] * (c > 0).to(torch.float32)

    def draw(self, logits: torch.Tensor, p: BatchParams) -> torch.Tensor:
        greedy = torch.argmax(logits, dim=-1)
        if p.host.all_greedy:
            return greedy
        temperature = torch.where(p.temperature < GREEDY_BELOW, 1.0, p.temperature)
        scaled = logits / temperature[:, None]
        if p.host.any_top_k:
            top = torch.topk(scaled, min(p.host.top_k_max, scaled.shape[-1]), dim=-1).values
            k = p.top_k.clamp(min=1, max=top.shape[-1])
            kth = top.gather(1, (k - 1)[:, None])
            on = ((p.top_k > 0) & (p.top_k < scaled.shape[-1]))[:, None]
            scaled = torch.where(on & (scaled < kth), float("-inf"), scaled)
        probs = torch.softmax(scaled, dim=-1)
        if p.host.any_top_p:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            # A row with top_p 1 keeps every token, as the reference does; without the
            # guard, a cumulative sum that rounds up to 1 early would drop its tail, and
            # the row's draw would depend on whether its batch has a top-p row.
            drop = (before >= p.top_p[:, None]) & (p.top_p < 1.0)[:, None]
            drop[:, 0] = False
            probs = probs.scatter(1, order, torch.where(drop, 0.0, sorted_p))
        if p.host.any_min_p:
            floor = p.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs >= floor, probs, 0.0)
        key = fmix32((p.step * _GOLDEN + _STEP_ADD) & _MASK32)
        key = fmix32(key ^ ((p.seed >> 32) & _MASK32))
        key = fmix32(key ^ (p.seed & _MASK32))
        # fmix32 is typed for NumPy; given tensors it returns a tensor. The race hashes
        # each token's uniform from the row's key in one pass (layers.race).
        drawn = race(probs, cast(torch.Tensor, key))
        return torch.where(p.temperature < GREEDY_BELOW, greedy, drawn)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Drawn:
        """The model's log probabilities (before penalties and temperature)."""
        lp = torch.log_softmax(logits.float(), dim=-1).clamp_(max=0.0)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        if k == 0:
            return Drawn(tokens, chosen, None, None)
        # Always the protocol's widest, then cut: equal log probabilities come in the
        # same order whatever k the batch asked (the GPU scheduler's graphs take 5).
        top = torch.topk(lp, MAX_TOP_LOGPROBS, dim=-1)
        return Drawn(tokens, chosen, top.indices[:, :k], top.values[:, :k])
