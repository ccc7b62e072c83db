"""A step's metadata on the host, from the scheduler's batch (NumPy, no torch: CI tests it).

The runner copies it to the GPU for an eager step, or into a captured graph's
static buffers (``dpu_frontend.model.graphs``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from dpu_frontend.model.sampling import VARIANTS, row_greedy, row_penalized, variant_of
from dpu_frontend.model.scheduler import Batch
from dpu_frontend.ring.records import SamplingParams


@dataclass(slots=True)
class StepInputs:
    """One step's metadata on the host: what the forward and the logits need. Its
    fields named as ``layers.attention.Attention``'s are those tensors' host arrays (the runner
    and the graphs build an ``Attention`` from them by name)."""

    slots: np.ndarray  # [T] int64: each token's row in the token buffer
    positions: np.ndarray  # [T] int64
    cache_slots: np.ndarray  # [T] int64: block * page + offset
    tables: np.ndarray  # [S, widest] int32
    tile_seq: np.ndarray  # [tiles] int32
    tile_row: np.ndarray  # [tiles] int32
    q_start: np.ndarray  # [S] int32
    q_len: np.ndarray  # [S] int32
    ctx_start: np.ndarray  # [S] int32
    sample_rows: np.ndarray  # [samples] int64: the rows whose logits are drawn from

    @property
    def decode(self) -> bool:
        """Every sequence adds one token and samples (a decode graph's shape)."""
        n = len(self.q_len)
        return len(self.slots) == n == len(self.sample_rows) and bool((self.q_len == 1).all())



def step_inputs(batch: Batch, page: int, per_tile: int) -> StepInputs:
    """The step's metadata: each token's row, position and cache slot, each
    sequence's block table and query span, the attention tiles (``per_tile`` query
    tokens each) and the rows whose logits are drawn from. Vectorized: no Python
    loop over tokens (a decode step of 256 sequences took 0.3 ms in one)."""
    works = batch.works
    n = len(works)
    blocks = [w.seq.table.blocks for w in works]
    lengths = np.fromiter(map(len, blocks), np.int64, n)
    tables = np.zeros((n, int(lengths.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(blocks), np.int32, int(lengths.sum()))
    starts = np.fromiter((w.start for w in works), np.int64, n)
    counts = np.fromiter((w.count for w in works), np.int64, n)
    seq_slots = np.fromiter((w.seq.slot for w in works), np.int64, n)
    sampling = np.fromiter((w.sample for w in works), np.bool_, n)
    index = np.arange(n, dtype=np.int32)
    if (counts == 1).all():
        positions, row_seq, tile_seq = starts, np.arange(n), index
        tile_row = np.zeros(n, dtype=np.int32)
    else:
        ends = np.cumsum(counts)
        row_seq = np.repeat(np.arange(n), counts)
        positions = starts[row_seq] + np.arange(int(ends[-1])) - (ends - counts)[row_seq]
        tiles = -(-counts // per_tile)
        tile_seq = np.repeat(index, tiles)
        tile_row = ((np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles))
                    * per_tile).astype(np.int32)
    q_start = (np.cumsum(counts) - counts).astype(np.int32)
    cache_slots = (tables[row_seq, positions // page].astype(np.int64) * page
                   + positions % page)
    return StepInputs(
        slots=seq_slots[row_seq], positions=positions, cache_slots=cache_slots,
        tables=tables, tile_seq=tile_seq, tile_row=tile_row, q_start=q_start,
        q_len=counts.astype(np.int32), ctx_start=starts.astype(np.int32),
        sample_rows=(q_start + counts - 1)[sampling].astype(np.int64))


#: Batch-size buckets of the decode graphs, and the token buckets of the mixed graphs
#: (the engine's default token budget is 2,048).
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
TOKEN_BUCKETS = (256, 512, 1024, 2048)


def graph_shapes(max_seqs: int, max_blocks: int,
                 token_buckets: tuple[int, ...] = TOKEN_BUCKETS) -> list[GraphShape]:
    """The captured steps, in the order a step takes the first that holds it: decode
    graphs (one per batch-size bucket), then mixed graphs (one per token bucket, one
    sequence more than the engine runs: the padding tiles' own), each smallest first."""
    sizes = [b for b in BUCKETS if b < max_seqs] + [max_seqs]
    return ([GraphShape(n, n, n, None, max_blocks) for n in sizes]
            + [GraphShape(t, max_seqs + 1, t, max_seqs, max_blocks)
               for t in sorted(token_buckets)])


def graph_for(shapes: list[GraphShape], step: StepInputs) -> int | None:
    """The index of the first shape in ``shapes`` (``graph_shapes``' order) of the
    step's family that holds it; None: no captured graph does."""
    return next((i for i, g in enumerate(shapes)
                 if (g.samples is None) == step.decode and g.fits(step)), None)


#: A captured graph's static input fields, in buffer order: (name, dtype, size by
#: the graph's dimensions). sched_core.h writes the same layout on the GPU.
_FIELDS = (("slots", np.int64, "tokens"), ("positions", np.int64, "tokens"),
           ("cache_slots", np.int64, "tokens"), ("sample_rows", np.int64, "samples"),
           ("tables", np.int32, "table"), ("tile_seq", np.int32, "tiles"),
           ("tile_row", np.int32, "tiles"), ("q_start", np.int32, "seqs"),
           ("q_len", np.int32, "seqs"), ("ctx_start", np.int32, "seqs"))


@dataclass(frozen=True, slots=True)
class GraphShape:
    """A captured step's fixed sizes: ``tokens`` rows, ``seqs`` sequences, ``tiles``
    attention tiles, ``samples`` logits rows (``None``: every row, as a decode step
    has), and the width of a block table. Its static inputs are one byte buffer,
    every field 8-byte aligned."""

    tokens: int
    seqs: int
    tiles: int
    samples: int | None
    max_blocks: int

    def spans(self) -> list[tuple[str, type, tuple[int, ...], int, int]]:
        """(name, dtype, shape, offset, bytes) of each field."""
        dims = {"tokens": (self.tokens,), "samples": (self.samples or 0,),
                "table": (self.seqs, self.max_blocks), "tiles": (self.tiles,),
                "seqs": (self.seqs,)}
        out: list[tuple[str, type, tuple[int, ...], int, int]] = []
        offset = 0
        for name, dtype, dim in _FIELDS:
            shape = dims[dim]
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out.append((name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // 8) * 8
        return out

    @property
    def nbytes(self) -> int:
        _, _, _, offset, nbytes = self.spans()[-1]
        return offset + -(-nbytes // 8) * 8

    def views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Each field as an array over ``buffer`` (uint8, ``nbytes`` long)."""
        return {name: buffer[offset:offset + nbytes].view(dtype).reshape(shape)
                for name, dtype, shape, offset, nbytes in self.spans()}

    def fits(self, step: StepInputs) -> bool:
        return (len(step.slots) <= self.tokens and len(step.q_len) < self.seqs + (
            self.samples is None) and len(step.tile_seq) <= self.tiles
            and (self.samples is None or len(step.sample_rows) <= self.samples))

    def fill(self, h: dict[str, np.ndarray], step: StepInputs, scratch_slot: int) -> None:
        """The step's inputs into the fields ``h``; the rest is padding: padding rows
        write their K and V to ``scratch_slot``, padding tiles belong to the last
        sequence (padding, no query token)."""
        t, s, tiles = len(step.slots), len(step.q_len), len(step.tile_seq)
        h["slots"][:t], h["slots"][t:] = step.slots, 0
        h["positions"][:t], h["positions"][t:] = step.positions, 0
        h["cache_slots"][:t], h["cache_slots"][t:] = step.cache_slots, scratch_slot
        h["tables"][:] = 0
        h["tables"][:s, :step.tables.shape[1]] = step.tables
        for name in ("q_start", "q_len", "ctx_start"):
            h[name][:s], h[name][s:] = getattr(step, name), 0
        h["tile_seq"][:tiles], h["tile_seq"][tiles:] = step.tile_seq, self.seqs - 1
        h["tile_row"][:tiles], h["tile_row"][tiles:] = step.tile_row, 0
        if self.samples is not None:
            n = len(step.sample_rows)
            h["sample_rows"][:n], h["sample_rows"][n:] = step.sample_rows, 0


@dataclass(slots=True)
class SamplingRows:
    """A step's sampling parameters, one column per sampling row, and the facts that
    let the sampler skip whole stages."""

    floats: np.ndarray  # [6, n] float32: temperature, top_p, min_p, presence, frequency, repetition
    ints: np.ndarray  # [3, n] int64: top_k (0: off), the seed's u64 bits, the output index
    top_k_max: int
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    all_greedy: bool
    #: A row walks a structured output's automaton (``layers.constrain``).
    any_constrained: bool = False

    @classmethod
    def of(cls, floats: np.ndarray, ints: np.ndarray, *,
           any_constrained: bool = False) -> SamplingRows:
        temperature, top_p, min_p, presence, frequency, repetition = floats
        top_k = ints[0]
        return cls(floats, ints, top_k_max=int(top_k.max(initial=0)), any_top_k=bool(top_k.any()),
                   any_top_p=bool((top_p < 1.0).any()), any_min_p=bool((min_p > 0).any()),
                   any_penalty=bool(row_penalized(presence, frequency, repetition).any()),
                   all_greedy=bool(row_greedy(temperature).all()),
                   any_constrained=any_constrained)

    @classmethod
    def stages_of(cls, variant: str, vocab_size: int) -> SamplingRows:
        """No rows: the facts that make the host sampler run ``variant``'s stages (the
        GPU scheduler's sampler graphs are captured through them)."""
        if variant not in VARIANTS:
            raise ValueError(f"no sampler variant {variant!r}")
        full = variant in ("full", "logprobs", "constrained")
        return cls(np.zeros((6, 0), np.float32), np.zeros((3, 0), np.int64),
                   top_k_max=vocab_size if full else 0, any_top_k=full, any_top_p=full,
                   any_min_p=full, any_penalty=full, all_greedy=variant == "greedy",
                   any_constrained=variant == "constrained")

    def variant(self, logprobs: bool) -> str:
        """The GPU scheduler's variant for these rows (``sampling.variant_of``)."""
        return VARIANTS[variant_of(self.all_greedy, self.any_penalty,
                                   self.any_top_k or self.any_top_p or self.any_min_p, logprobs,
                                   self.any_constrained)]

    @classmethod
    def from_params(cls, rows: list[tuple[SamplingParams, int, int]], vocab_size: int) -> SamplingRows:
        """From (params, seed, output index) rows (tests)."""
        floats = np.array([_floats(p) for p, _, _ in rows], np.float32).reshape(-1, 6).T
        ints = np.array([(_top_k(p, vocab_size), _seed_bits(seed), step) for p, seed, step in rows],
                        np.int64).reshape(-1, 3).T
        return cls.of(np.ascontiguousarray(floats), np.ascontiguousarray(ints))


class SlotParams:
    """Each runner slot's sampling parameters, set when a sequence is admitted to it: a
    step gathers its rows' with one NumPy index instead of a loop over them."""

    def __init__(self, slots: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # A slot nobody set draws as the protocol's defaults would (no penalty, no cut).
        self.floats = np.tile(np.array(_floats(SamplingParams(max_tokens=1)), np.float32)[:, None],
                              (1, slots))
        self.top_k = np.zeros(slots, np.int64)
        self.seed = np.zeros(slots, np.int64)
        self.constrained = np.zeros(slots, np.bool_)

    def set(self, slot: int, params: SamplingParams, seed: int, *,
            constrained: bool = False) -> None:
        self.floats[:, slot] = _floats(params)
        self.top_k[slot] = _top_k(params, self.vocab_size)
        self.seed[slot] = _seed_bits(seed)
        self.constrained[slot] = constrained

    def rows(self, slots: np.ndarray, steps: np.ndarray) -> SamplingRows:
        """The rows of sequences in ``slots`` drawing their output index ``steps``."""
        return SamplingRows.of(self.floats[:, slots],
                               np.stack([self.top_k[slots], self.seed[slots], steps]),
                               any_constrained=bool(self.constrained[slots].any()))


def _floats(p: SamplingParams) -> tuple[float, ...]:
    return (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty)


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return p.top_k if 0 < p.top_k < vocab_size else 0


def _seed_bits(seed: int) -> int:
    """A u64 seed's bits as an int64."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed
