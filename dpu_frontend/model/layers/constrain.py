# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Structured output on the GPU: each step, a constrained row's logits are masked by
its automaton's state, and once the token is drawn the state moves by it. Nothing
waits for the host per token.

The automata live in one pool of 32-bit words (``model.automata`` places them), each
as its six wire arrays (``ring.automaton``: ``list_start`` [S + 1], ``list_tokens``
[L], ``list_next`` [L], ``default_next`` [S], ``mask_at`` [S], ``masks`` [D x W]).
Per runner slot, ``meta`` holds (base, S, L, vocabulary, end token, on) and
``state`` the sequence's state. Three kernels:

1. ``_keep_listed``: a row's listed tokens (its state's sorted list) marked in a
   [rows, vocab] byte buffer;
2. ``_mask``: the logits of every token neither listed nor set in a dense state's
   bitmask become -inf (into a copy: the log probabilities stay the model's), and the
   marks are cleared as they are read, so the buffer is all zero between steps;
3. ``_advance``: the drawn token's next state, by a binary search of the list, else
   the dense state's default.

A row's result depends on its own logits, slot and state alone: batch-invariant. A
drawn token that its state does not allow (only NaN logits can draw one) leaves the
row in state -1, where only the end token is allowed: the sequence ends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dpu_frontend.model.automata import PoolEntry
from dpu_frontend.model.layers.pdl import dependent_start, launch
from dpu_frontend.model.layers.sampler import to_device
from dpu_frontend.ring.automaton import automaton_words

#: ``meta``'s columns.
BASE, STATES, LIST_LEN, VOCAB, EOS, ON = range(6)
META_COLUMNS = 6
#: Tokens a program of the masking kernel covers, and listed tokens per pass.
MASK_BLOCK = 2048
LIST_BLOCK = 256


@triton.jit
def _automaton_of(meta, slot):
    """Slot ``slot``'s meta row: base, states, list length, vocabulary, end token, on."""
    row = meta + slot * 6
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4), tl.load(row + 5))


@triton.jit
def _keep_listed(pool, meta, state, slots, keep, keep_stride, BLOCK: tl.constexpr,
                 PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    base, states, _, _, _, on = _automaton_of(meta, slot)
    s = tl.load(state + slot)
    if (on != 0) & (s >= 0):
        lo = tl.load(pool + base + s).to(tl.int64)
        hi = tl.load(pool + base + s + 1).to(tl.int64)
        tokens = base + states + 1
        for i in range(lo, hi, BLOCK):
            at = i + tl.arange(0, BLOCK)
            listed = at < hi
            token = tl.load(pool + tokens + at, mask=listed, other=0)
            tl.store(keep + row * keep_stride + token, 1, mask=listed)


@triton.jit
def _mask(logits, out, n_vocab, logits_stride, out_stride, pool, meta, state, slots, keep,
          keep_stride, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < n_vocab
    x = tl.load(logits + row * logits_stride + t, mask=inside, other=0.0)
    slot = tl.load(slots + row)
    base, states, list_len, vocab, eos, on = _automaton_of(meta, slot)
    if on != 0:
        s = tl.load(state + slot)
        kept = tl.load(keep + row * keep_stride + t, mask=inside, other=0)
        allowed = kept != 0
        if s >= 0:
            mask_at = tl.load(pool + base + (states + 1) + 2 * list_len + states + s)
            masks = base + (states + 1) + 2 * list_len + 2 * states
            dense = inside & (mask_at >= 0) & (t < vocab)
            word = tl.load(pool + masks + mask_at + t // 32, mask=dense, other=0)
            allowed = allowed | (((word >> (t % 32)) & 1) != 0)
        else:
            allowed = allowed | (t == eos)
        tl.store(keep + row * keep_stride + t, tl.zeros_like(kept), mask=inside)
        tl.store(out + row * out_stride + t, tl.where(allowed, x, float("-inf")), mask=inside)
    else:
        tl.store(out + row * out_stride + t, x, mask=inside)


@triton.jit
def _advance(tokens, pool, meta, state, slots, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    base, states, list_len, vocab, _, on = _automaton_of(meta, slot)
    s = tl.load(state + slot)
    if (on != 0) & (s >= 0):
        token = tl.load(tokens + row).to(tl.int32)
        listed = base + states + 1
        lo = tl.load(pool + base + s).to(tl.int64)
        end = tl.load(pool + base + s + 1).to(tl.int64)
        hi = end
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(pool + listed + mid) < token:
                lo = mid + 1
            else:
                hi = mid
        found = lo < end
        if found:
            found = tl.load(pool + listed + lo) == token
        nxt = s * 0 - 1
        if found:
            nxt = tl.load(pool + listed + list_len + lo).to(tl.int64)
        else:
            mask_at = tl.load(pool + base + (states + 1) + 2 * list_len + states + s)
            if (mask_at >= 0) & (token >= 0) & (token < vocab):
                masks = base + (states + 1) + 2 * list_len + 2 * states
                word = tl.load(pool + masks + mask_at + token // 32)
                if ((word >> (token % 32)) & 1) != 0:
                    nxt = tl.load(pool + base + (states + 1) + 2 * list_len + s).to(tl.int64)
        tl.store(state + slot, nxt)


class DeviceAutomata:
    """The pool on the device, and each runner slot's automaton and state (module
    docstring). ``rows``: the most sampling rows a step has (its byte buffer's)."""

    def __init__(self, words: int, slots: int, rows: int, vocab_size: int,
                 device: torch.device) -> None:
        self.words = words
        self.device = device
        self.pool = torch.zeros(max(words, 1), dtype=torch.int32, device=device)
        self.meta = torch.zeros((slots, META_COLUMNS), dtype=torch.int64, device=device)
        self.state = torch.zeros(slots, dtype=torch.int64, device=device)
        self._keep = torch.zeros((rows, vocab_size), dtype=torch.int8, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pool, self.meta, self.state,
                                                          self._keep))

    def attach(self, slot: int, entry: PoolEntry | None) -> None:
        """``slot``'s new sequence walks ``entry``'s automaton from its start (None: it is
        not constrained). The first user copies the automaton into its place; every
        copy is queued on the stream, behind the steps already launched."""
        if entry is None:
            self.meta[slot, ON] = 0
            return
        a = entry.checked.automaton
        if not entry.resident:
            words = torch.frombuffer(bytearray(automaton_words(a)), dtype=torch.int32)
            self.pool[entry.base:entry.base + words.numel()].copy_(to_device(words, self.device))
            entry.resident = True
        row = torch.tensor([entry.base, a.states, len(a.list_tokens), a.vocab_size, a.eos, 1],
                           dtype=torch.int64)
        self.meta[slot].copy_(to_device(row, self.device))
        self.state[slot] = 0

    def mask(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``logits`` [rows, vocab] (row i: the sequence in ``slots[i]``), each constrained
        row's disallowed tokens at -inf, in a copy."""
        rows, vocab = logits.shape
        out = torch.empty_like(logits)
        if rows:
            keep = self._keep
            _keep_listed[(rows,)](self.pool, self.meta, self.state, slots, keep, keep.stride(0),
                                  BLOCK=LIST_BLOCK, **launch(self.pool.device, (rows,)), num_warps=4)
            _mask[(rows, triton.cdiv(vocab, MASK_BLOCK))](
                logits, out, vocab, logits.stride(0), out.stride(0), self.pool, self.meta,
                self.state, slots, keep, keep.stride(0), BLOCK=MASK_BLOCK,
                **launch(logits.device, (rows, triton.cdiv(vocab, MASK_BLOCK))), num_warps=8)
        return out

    def advance(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """Each constrained row's state moved by its drawn token."""
        if tokens.numel():
            _advance[(tokens.numel(),)](tokens, self.pool, self.meta, self.state, slots,
                                        **launch(tokens.device, (tokens.numel(),)), num_warps=1)
