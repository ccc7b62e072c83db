"""Tensor parallelism's model side on GPUs (issue 27): each rank a process on its own
GPU, NCCL between them, the weights cut by ``tensor_parallel.Shard``, every layer's
partial sums added in rank order (``layers.collective.GatheredGroup``); every
position's float32 logits of a prefill against the same model on one GPU, for each
served architecture, random weights and loaded ones (``tests.tools.cpu_tensor_parallel``,
which runs the same on the CPU). Needs a machine with 2 GPUs (4 for the 4-rank case)."""

from __future__ import annotations

import pytest

from tests.gpu.test_allreduce import need_gpus
from tests.tools import cpu_tensor_parallel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_give_one_gpus_logits(size: int) -> None:
    need_gpus(size)
    assert cpu_tensor_parallel.main(["--device", "cuda", "--sizes", str(size)]) == 0
