# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The sampler's race in one pass: each token's probability over an exponential drawn
from a hash of (the row's key, the token id), and the first token of the largest
ratio (``sampling.sample``'s ``argmax(p / -log(u))``).

Written in torch, the race ran a dozen passes over [rows, vocabulary] int64 and
float32 tensors (the hash's shifts, products and masks, the uniform, its log, the
quotient, the argmax): 2.8 ms a step at 256 rows of 151,936 tokens on an H200, a
fifth of a Qwen3-8B step. Here the hash lives in registers and the probabilities
are read once.

The bits are the torch passes': the hash in 32-bit unsigned arithmetic keeps the
low 32 bits that the reference's int64 products and masks keep, the uniform is
exact (24 bits, a half, a power of two), the logarithm is libdevice's ``logf`` (the
one CUDA's ``log`` calls) and the quotient correctly rounded. The argmax has no
rounding: a row's vocabulary is cut in fixed spans, each program keeps the first
index of its span's maximum, and the merge keeps the first span's. Per row, so
batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dpu_frontend.model.layers.pdl import dependent_start, launch
from dpu_frontend.model.sampling import _TOKEN_MUL, U_MAX

#: Tokens a program races (a row's vocabulary in spans of this many), and per pass.
SPAN, BLOCK = 8192, 1024
#: The merge's spans per pass.
MERGE_BLOCK = 64


@triton.jit
def _fmix32(x):
    """MurmurHash3's finalizer on uint32 (``sampling.fmix32``'s low 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(probs, keys, best_value, best_index, vocab, stride, spans,
                 TOKEN_MUL: tl.constexpr, UMAX: tl.constexpr, SPAN: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    span = tl.program_id(1)
    key = tl.load(keys + row).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), -float("inf"), tl.float32)
    at = tl.full((BLOCK,), 2147483647, tl.int32)
    for start in range(span * SPAN, tl.minimum(span * SPAN + SPAN, vocab), BLOCK):
        ids = start + lanes
        inside = ids < vocab
        p = tl.load(probs + row * stride + ids, mask=inside, other=0.0)
        bits = _fmix32(key ^ (ids.to(tl.uint32) * TOKEN_MUL))
        u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08, UMAX)
        score = tl.math.div_rn(p, -libdevice.log(u))
        # torch.argmax takes a NaN as the largest: so does the race (the first NaN).
        score = tl.where(score != score, float("inf"), score)
        score = tl.where(inside, score, -float("inf"))
        # Each lane sees its ids in increasing order: a strict > keeps the first.
        better = score > top
        top = tl.where(better, score, top)
        at = tl.where(better, ids, at)
    m = tl.max(top, axis=0)
    # Every score is a number >= 0 or a NaN made inf: m is some lane's, so first is an id.
    first = tl.min(tl.where(top == m, at, 2147483647), axis=0)
    tl.store(best_value + row * spans + span, m)
    tl.store(best_index + row * spans + span, first)


@triton.jit
def _merge_kernel(best_value, best_index, out, spans, BLOCK: tl.constexpr, PDL: tl.constexpr,
                  EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    v = tl.load(best_value + row * spans + lanes, mask=lanes < spans, other=-float("inf"))
    i = tl.load(best_index + row * spans + lanes, mask=lanes < spans, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out + row, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's token: ``argmax(probs / -log(u))``, u the row's uniforms for its key
    (``sampling.uniforms``). ``probs`` [rows, vocab] float32, ``keys`` [rows] int64 (the
    low 32 bits used); int64 tokens."""
    rows, vocab = probs.shape
    spans = triton.cdiv(vocab, SPAN)
    if spans > MERGE_BLOCK:
        raise ValueError(f"a vocabulary of {vocab} ids: at most {MERGE_BLOCK * SPAN} for the race")
    out = torch.empty((rows,), dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    best_value = torch.empty((rows, spans), dtype=torch.float32, device=probs.device)
    best_index = torch.empty((rows, spans), dtype=torch.int32, device=probs.device)
    _race_kernel[(rows, spans)](probs, keys, best_value, best_index, vocab, probs.stride(0),
                                spans, TOKEN_MUL=_TOKEN_MUL, UMAX=float(U_MAX), SPAN=SPAN,
                                BLOCK=BLOCK, **launch(probs.device, (rows, spans)), num_warps=4)
    _merge_kernel[(rows,)](best_value, best_index, out, spans, BLOCK=MERGE_BLOCK,
                           **launch(probs.device, (rows,)), num_warps=1)
    return out
