"""Tensor parallelism's split of a model over the GPUs of one host: which rows and
columns of each weight a rank holds, and the shapes each rank runs.

Megatron's split of a decoder layer, as vLLM and SGLang run it:
- attention by heads: a rank holds the q rows of ``num_heads / size`` query heads and
  the k and v rows of the KV heads those heads read (``num_kv_heads / size`` of them,
  or, with more ranks than KV heads, the one KV head its query heads share, held by
  ``size / num_kv_heads`` ranks), and the matching columns of ``o_proj``;
- the MLP by its intermediate dimension: an even share of the gate and up rows and of
  the down columns, every expert's alike in a mixture (the router whole on each rank);
- the embedding, the norms, the q and k norms (a head's, the same for every head) and
  the router whole on every rank;
- the LM head by vocabulary: rank r the rows of ids ``[r * share, (r + 1) * share)``
  (the last rank the rest), their logits gathered in rank order for sampling.

A layer then runs on each rank as the same decoder over its ``local_config``, and its
two outputs back to the hidden size (``o_proj``'s and ``down``'s) are partial sums
that one all-reduce a layer adds in rank order. The weight tables declare each HF
tensor's split (``Part.split``, one of ``models.base.SPLITS``); ``Shard.take`` cuts a
rank's packed parameter out of the tensors as the checkpoint holds them, for any array
type that slices (NumPy in CI, torch on the GPU). No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dpu_frontend.model.models.base import SPLITS, Param, Part

if TYPE_CHECKING:
    from dpu_frontend.model.config import ModelConfig

#: The GPUs of one host.
MAX_SIZE = 8


@dataclass(frozen=True, slots=True)
class Block:
    """A block of one HF tensor: rows ``[row0, row1)``, and columns ``[col0, col1)``
    where ``cols`` is set (else every column)."""

    rows: tuple[int, int]
    cols: tuple[int, int] | None = None


class Sliceable(Protocol):
    def __getitem__(self, key: Any, /) -> Any: ...


A = TypeVar("A", bound=Sliceable)


def vocab_share(vocab: int, size: int) -> int:
    """The LM head's rows a rank holds (the last rank, the rest)."""
    return -(-vocab // size)


def check(config: ModelConfig, size: int) -> None:
    """Refuse a split this engine cannot make (ValueError naming the field)."""
    if not 1 <= size <= MAX_SIZE:
        raise ValueError(f"tensor parallel size {size}: 1 to {MAX_SIZE} GPUs of one host")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of the tensor "
                         f"parallel size {size}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} and the tensor parallel size "
                         f"{size}: one must divide the other")
    if config.intermediate_size % size:
        raise ValueError(f"intermediate_size {config.intermediate_size} is not a multiple "
                         f"of the tensor parallel size {size}")
    if config.moe is not None and config.moe.intermediate % size:
        raise ValueError(f"moe_intermediate_size {config.moe.intermediate} is not a "
                         f"multiple of the tensor parallel size {size}")
    share = vocab_share(config.vocab_size, size)
    if config.vocab_size - (size - 1) * share <= 0:
        raise ValueError(f"vocab_size {config.vocab_size} leaves the last of {size} ranks "
                         "no share of the LM head")


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``size`` over ``config`` (the whole model's), checked."""

    config: ModelConfig
    size: int
    rank: int

    def __post_init__(self) -> None:
        check(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}")

    @property
    def q_heads(self) -> range:
        """The query heads this rank computes."""
        n = self.config.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """The KV heads its query heads read: its own share, or with more ranks than KV
        heads, the one its query heads share (each held by ``size / num_kv_heads``
        ranks)."""
        c = self.config
        if c.num_kv_heads >= self.size:
            n = c.num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.q_heads.start // c.group_size
        return range(head, head + 1)

    @property
    def vocab(self) -> tuple[int, int]:
        """The token ids whose logits this rank computes: ``[first, end)``."""
        share = vocab_share(self.config.vocab_size, self.size)
        return self.rank * share, min((self.rank + 1) * share, self.config.vocab_size)

    @property
    def local_config(self) -> ModelConfig:
        """The shapes this rank's decoder runs: its heads and its share of the MLP; the
        vocabulary whole (the embedding is; the head's rows are ``vocab``)."""
        c = self.config
        moe = (dataclasses.replace(c.moe, intermediate=c.moe.intermediate // self.size)
               if c.moe is not None else None)
        return dataclasses.replace(c, num_heads=len(self.q_heads),
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=c.intermediate_size // self.size, moe=moe)

    def blocks(self, part: Part) -> list[Block]:
        """The blocks of ``part``'s tensor this rank holds, in the order they are packed."""
        c = self.config
        rows, cols = part.shape(c)[0], (part.shape(c)[1] if len(part.shape(c)) > 1 else 0)
        d = c.head_dim
        q = self.q_heads
        kv = self.kv_heads
        split = part.split
        if split == "whole":
            return [Block((0, rows))]
        if split == "q_heads":
            return [Block((q.start * d, q.stop * d))]
        if split == "kv_heads":
            return [Block((kv.start * d, kv.stop * d))]
        if split == "qkv":
            k0, v0 = c.q_size, c.q_size + c.kv_size
            return [Block((q.start * d, q.stop * d)),
                    Block((k0 + kv.start * d, k0 + kv.stop * d)),
                    Block((v0 + kv.start * d, v0 + kv.stop * d))]
        if split == "rows":
            return [self._even(0, rows)]
        if split == "gate_up":
            half = rows // 2
            return [self._even(0, half), self._even(half, half)]
        if split == "q_heads_in":
            return [Block((0, rows), (q.start * d, q.stop * d))]
        if split == "columns":
            share = cols // self.size
            return [Block((0, rows), (self.rank * share, (self.rank + 1) * share))]
        if split == "vocab":
            return [Block(self.vocab)]
        raise ValueError(f"tensor {part.hf}: split {split!r} is not one of {SPLITS}")

    def _even(self, start: int, rows: int) -> Block:
        share = rows // self.size
        return Block((start + self.rank * share, start + (self.rank + 1) * share))

    def take(self, param: Param, tensors: Sequence[A], cat: Callable[[list[A]], A]) -> A:
        """This rank's ``param``, packed as the decoder takes it: ``tensors`` are the
        parameter's HF tensors in ``param.parts_for(config)`` order (as the checkpoint
        holds them), each cut to this rank's blocks, then ``cat`` along the rows."""
        parts = param.parts_for(self.config)
        if len(tensors) != len(parts):
            raise ValueError(f"parameter {param.name}: {len(tensors)} tensors for "
                             f"{len(parts)} parts")
        pieces: list[A] = []
        for part, tensor in zip(parts, tensors, strict=True):
            for block in self.blocks(part):
                r0, r1 = block.rows
                pieces.append(tensor[r0:r1] if block.cols is None
                              else tensor[r0:r1, block.cols[0]:block.cols[1]])
        return pieces[0] if len(pieces) == 1 else cat(pieces)

    def tied_head(self, embedding: A) -> A:
        """This rank's rows of an LM head tied to the embedding (the head's parameter,
        untied, is ``take``n as any other)."""
        first, end = self.vocab
        rows: A = embedding[first:end]
        return rows
