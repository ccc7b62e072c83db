"""The collectives of tensor parallelism (``model.tensor_parallel``): a layer's partial
sums added over the ranks, and the LM head's columns gathered.

Batch-invariant, as every layer here: a sum over ranks runs in rank order, 0 then 1
then 2..., in float32 and rounded once, so each element's bits depend on the ranks'
values alone, never on the number of rows or on how a collective library cuts a
message (NCCL's ring all-reduce starts each chunk at another rank: a row's bits would
then move with the batch), and every rank holds the same bits.

``GatheredGroup`` runs them over ``torch.distributed`` (any backend: NCCL between
GPUs, gloo on the CPU): an all-gather, which moves values and adds nothing, then the
sum in rank order on each rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class TensorGroup(Protocol):
    """The ranks a model is split over: this process's ``rank`` of ``size``."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in rank order: the same bits on every rank."""

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's ``x`` side by side in rank order, [rows, total]: rank r's are
        columns ``[r * share, (r + 1) * share)`` with ``share = ceil(total / size)``
        (the last rank's, the rest): the LM head's split by vocabulary."""


def sum_in_rank_order(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in float32, left to right, rounded to ``dtype`` once."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(dtype)


class GatheredGroup:
    """A ``TensorGroup`` over ``torch.distributed``'s process group ``group`` (the
    default one if None): all-gathers, then the arithmetic here."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return sum_in_rank_order(self._gather(x), x.dtype)

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        share = -(-total // self.size)  # tensor_parallel.vocab_share's, from below it
        if x.shape[1] != min(share, total - self.rank * share):
            raise ValueError(f"rank {self.rank} of {self.size}: {x.shape[1]} columns of "
                             f"{total}, not its share")
        padded = x if x.shape[1] == share else torch.nn.functional.pad(x, (0, share - x.shape[1]))
        return torch.cat(self._gather(padded), dim=1)[:, :total]
