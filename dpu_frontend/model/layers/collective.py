"""The collectives of tensor parallelism (``model.tensor_parallel``): a layer's partial
sums added over the ranks, and the LM head's columns gathered.

Batch-invariant, as every layer here: a sum over ranks runs in rank order, 0 then 1
then 2..., in float32 and rounded once, so each element's bits depend on the ranks'
values alone, never on the number of rows or on how a collective library cuts a
message (NCCL's ring all-reduce starts each chunk at another rank: a row's bits would
then move with the batch), and every rank holds the same bits.

``GatheredGroup`` runs them over ``torch.distributed`` (any backend: NCCL between
GPUs, gloo on the CPU): an all-gather, which moves values and adds nothing, then the
sum in rank order on each rank. ``PeerMemoryGroup`` sums with the ranks' own kernel
over NVLink peer memory instead (``gpu/allreduce.cu``): the same bits, a copy and one
kernel on the caller's stream, which a CUDA graph captures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.allreduce import PATIENCE_S, PeerMemoryLibrary, describe_fault


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


class PeerMemoryGroup(GatheredGroup):
    """A ``TensorGroup`` whose ``all_reduce`` runs ``allreduce.cu`` over the ranks' GPU
    memory, mapped into each other's once here (CUDA IPC handles, exchanged over
    ``group``): messages of up to ``ONE_SHOT_BYTES`` one-shot, larger ones two-shot, up
    to ``max_bytes``. The same bits as ``GatheredGroup``'s (rank order, float32, one
    rounding), so what it does not take (another dtype, a larger message) goes there
    and nothing changes but the route. Every rank makes the same calls in the same
    order, as with any collective, on one stream at a time (one staging buffer). Every
    rank must take the same settings (checked here: a different grid or bound would
    leave blocks waiting for words no rank writes), and a rank that cannot map the
    others' memory fails the group's start on every rank, never leaving them waiting.
    A rank that stalls (its kernel stopped) leaves the others' calls waiting no longer
    than ``patience_s``: they end with wrong sums and ``fault()`` says why; the step
    that ran them is to be failed, and the group not used again."""

    #: One-shot below this: each rank reads every rank's whole input, one phase less.
    ONE_SHOT_BYTES: ClassVar[int] = 256 << 10
    DTYPES: ClassVar[dict[torch.dtype, str]] = {torch.float32: "float32",
                                                 torch.bfloat16: "bfloat16"}

    def __init__(self, library: Path, max_bytes: int, blocks: int = 16,
                 group: dist.ProcessGroup | None = None, patience_s: float = PATIENCE_S) -> None:
        super().__init__(group)
        self.max_bytes = max_bytes
        self.device = torch.cuda.current_device()
        self.lib = PeerMemoryLibrary.load(library)
        self.handle = self.lib.create(self.device, self.rank, self.size, max_bytes, blocks,
                                      patience_s)
        settings = (blocks, max_bytes, self.ONE_SHOT_BYTES)
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, (settings, self.lib.handles(self.handle)), group=group)
        if any(theirs != settings for theirs, _ in everyone):
            self.lib.destroy(self.handle)
            raise StartupError("the ranks' all-reduce settings differ (blocks, max_bytes, "
                               f"one-shot bound): {[theirs for theirs, _ in everyone]}")
        failure = ""
        try:
            self.lib.open(self.handle, [handles for _, handles in everyone])
        except StartupError as exc:
            failure = f"rank {self.rank}: {exc}"
        failures: list[Any] = [None] * self.size
        dist.all_gather_object(failures, failure, group=group)
        if any(failures):
            self.lib.destroy(self.handle)
            raise StartupError("the all-reduce over peer memory cannot start: "
                               + "; ".join(f for f in failures if f))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        name = self.DTYPES.get(x.dtype)
        if name is None or x.nbytes > self.max_bytes or x.device != torch.device("cuda", self.device):
            return super().all_reduce(x)
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.run(self.handle, x.data_ptr(), out.data_ptr(), x.numel(), name,
                     x.nbytes > self.ONE_SHOT_BYTES, torch.cuda.current_stream(x.device).cuda_stream)
        return out

    def fault(self) -> str | None:
        """Why this rank's calls stopped waiting for a peer (a stalled rank), or None:
        read without a sync, so a step's end can check it."""
        return describe_fault(self.rank, self.lib.fault(self.handle))

    def close(self) -> None:
        """The buffers freed and the peers' unmapped, once every rank's calls are done
        (a barrier of the group)."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.lib.destroy(self.handle)
