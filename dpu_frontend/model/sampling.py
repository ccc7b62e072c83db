"""How a token is drawn from logits: the specification, and a NumPy reference.

The engine samples on the GPU (``dpu_frontend.model.layers.sampler``); this module is
the same algorithm written plainly, which the GPU sampler is tested against
and which CI checks on its own. One row (one sequence, one step):

1. **Penalties** on the model's logits, as vLLM and OpenAI define them:
   repetition (divide positive logits, multiply negative ones, for every token
   in the prompt or the output), then frequency (minus ``count`` times the
   output count) and presence (minus once for any token in the output).
2. **Greedy** when ``temperature`` is 0 (or below ``GREEDY_BELOW``): the first
   index of the maximum. Top-k, top-p and min-p do not apply.
3. Otherwise divide by ``temperature``; keep the ``top_k`` largest (every
   token tied with the k-th too); over those, the probabilities sorted
   descending (ties by index) and kept while the mass before a token is below
   ``top_p`` (the first always stays); then drop tokens whose probability is
   below ``min_p`` times the largest.
4. **Draw** by an exponential race: the kept token with the largest
   ``p / E`` wins, ``E = -log(U)``, ``U`` uniform in (0, 1). ``U`` is a hash of
   (seed, output index, token id), never a stream consumed in order, so that a
   sequence's draws do not depend on which other sequences share the batch, on
   the batch's order, or on a preemption that recomputes it.

Log probabilities are the model's own: log-softmax of the logits before
penalties and temperature (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dpu_frontend.ring.records import SamplingParams

#: Temperatures below this are greedy: dividing by them overflows float32.
#: scheduler.h's DPUF_GREEDY_BELOW (CI compares the float32 bits).
GREEDY_BELOW = 1e-5
#: Most top alternatives a response carries per token (OpenAI's limit is 20;
#: the ring record carries 5).
MAX_TOP_LOGPROBS = 5

#: The largest uniform a draw uses: the largest float32 below 1.
U_MAX = np.float32(1.0 - 2.0**-24)

_MASK32 = 0xFFFF_FFFF
_GOLDEN = 0x9E37_79B1
_TOKEN_MUL = 0x85EB_CA77
_STEP_ADD = 0x7F4A_7C15

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def fmix32(x: I64) -> I64:
    """MurmurHash3's finalizer on the low 32 bits of int64 values.

    Written with int64 arithmetic and masks only, so that the GPU sampler applies
    this very function to torch tensors and both produce the same bits: products
    wrap modulo 2**64 and only their low 32 bits are kept.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EB_CA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2_AE35) & _MASK32
    return x ^ (x >> 16)


def row_key(seed: int, step: int) -> int:
    """The hash key of one sequence's ``step``-th draw."""
    k = fmix32(np.array([(step * _GOLDEN + _STEP_ADD) & _MASK32], dtype=np.int64))
    k = fmix32(k ^ ((seed >> 32) & _MASK32))
    return int(fmix32(k ^ (seed & _MASK32))[0])


def uniforms(key: int, vocab: int) -> F32:
    """One uniform in (0, 1) per token id: 24 hashed bits and a half, at most
    ``U_MAX``: the top value, (2^24 - 0.5) / 2^24, rounds to 1 in float32, whose
    exponential (-log u) would be zero, and a dropped token's 0 / 0 a NaN that wins
    the race."""
    ids = np.arange(vocab, dtype=np.int64)
    bits = fmix32(key ^ ((ids * _TOKEN_MUL) & _MASK32))
    u = ((bits >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    out: F32 = np.minimum(u, U_MAX).astype(np.float32)
    return out


@dataclass(frozen=True, slots=True)
class History:
    """What the penalties look at: the prompt's and the output's token ids."""

    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()


def apply_penalties(logits: F32, params: SamplingParams, history: History) -> F32:
    out = logits.astype(np.float32, copy=True)
    vocab = out.shape[0]
    if params.repetition_penalty != 1.0:
        seen = np.zeros(vocab, dtype=bool)
        seen[list(history.prompt)] = True
        seen[list(history.output)] = True
        r = np.float32(params.repetition_penalty)
        out = np.where(seen, np.where(out > 0, out / r, out * r), out).astype(np.float32)
    if params.frequency_penalty or params.presence_penalty:
        counts = np.bincount(np.array(history.output, dtype=np.int64),
                             minlength=vocab).astype(np.float32)
        out = (out - np.float32(params.frequency_penalty) * counts
               - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32))
    return out.astype(np.float32)


def kept_probabilities(logits: F32, params: SamplingParams) -> F32:
    """Step 3: the probabilities after temperature, top-k, top-p and min-p,
    zero where a token was dropped (not renormalized: the race does not need it)."""
    scaled = (logits / np.float32(params.temperature)).astype(np.float32)
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.sort(scaled)[vocab - params.top_k]
        scaled = np.where(scaled >= kth, scaled, np.float32(-np.inf)).astype(np.float32)
    e: F32 = np.exp(scaled - scaled.max()).astype(np.float32)
    p: F32 = (e / e.sum(dtype=np.float32)).astype(np.float32)
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order], dtype=np.float32) - p[order]
        drop = order[before >= np.float32(params.top_p)]
        drop = drop[drop != order[0]]
        p[drop] = 0
    if params.min_p > 0.0:
        p = np.where(p >= np.float32(params.min_p) * p.max(), p, np.float32(0)).astype(np.float32)
    return p


B = npt.NDArray[np.bool_]


# The rules that decide which stages a batch needs: the host sampler skips the stages no
# row needs, the GPU scheduler picks the sampler graph of the variant that covers its
# batch. scheduler.h writes them once for C (DPUF_ROW_*, DPUF_SAMPLER_VARIANT), and
# tests/unit/test_c_header.py evaluates both sides on every case. Elementwise: each
# takes a step's rows as arrays (float32 parameters, as the request record carries them).

def row_greedy(temperature: F32) -> B:
    """Rows drawn greedily: the first index of the maximum."""
    return np.asarray(temperature < np.float32(GREEDY_BELOW))


def row_penalized(presence: F32, frequency: F32, repetition: F32) -> B:
    """Rows whose penalties change their logits."""
    return np.asarray((presence != 0) | (frequency != 0) | (repetition != 1))


def row_cut(top_k: I64, top_p: F32, min_p: F32) -> B:
    """Rows whose top-k, top-p or min-p may drop a token (``top_k`` 0: off)."""
    return np.asarray((top_k != 0) | (top_p < 1) | (min_p > 0))


#: The GPU scheduler's sampler graphs, cheapest first (scheduler.h's DPUF_SAMPLER_*).
#: greedy: argmax; plain: temperature and the draw; full: penalties and every cut too;
#: logprobs: full and the log probabilities.
VARIANTS = ("greedy", "plain", "full", "logprobs", "constrained")


def variant_of(all_greedy: bool, any_penalty: bool, any_cut: bool, any_logprobs: bool,
               any_constrained: bool = False) -> int:
    """The cheapest variant whose stages cover a batch with these facts (an index of
    ``VARIANTS``). Each stage leaves a row with neutral parameters bit for bit as it
    was, so any covering variant draws every row's token as the host path does.
    ``constrained`` is ``logprobs`` with structured output's mask and state step (an
    unconstrained row passes through them unchanged)."""
    if any_constrained:
        return VARIANTS.index("constrained")
    if any_logprobs:
        return VARIANTS.index("logprobs")
    if any_penalty or any_cut:
        return VARIANTS.index("full")
    return VARIANTS.index("greedy" if all_greedy else "plain")


def sample(logits: F32, params: SamplingParams, seed: int, step: int,
           history: History = History(), allowed: B | None = None) -> int:
    """The token the engine draws for one sequence at output index ``step``;
    ``allowed``: the tokens its structured output's automaton allows now (the others'
    logits are -inf before anything else), None: every token."""
    if allowed is not None:
        logits = np.where(allowed, logits, np.float32("-inf")).astype(np.float32)
    penalized = apply_penalties(logits, params, history)
    if params.temperature < GREEDY_BELOW:
        return int(np.argmax(penalized))
    p = kept_probabilities(penalized, params)
    e = -np.log(uniforms(row_key(seed, step), p.shape[0]))
    return int(np.argmax(p / e))


def log_softmax(logits: F32) -> F32:
    shifted = logits.astype(np.float32) - logits.max()
    out: F32 = (shifted - np.log(np.exp(shifted).sum(dtype=np.float32))).astype(np.float32)
    return out


def top_logprobs(logits: F32, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens and their log probabilities, most likely first."""
    lp = log_softmax(logits)
    order = np.argsort(-lp, kind="stable")[:k]
    return [(int(t), float(lp[t])) for t in order]
