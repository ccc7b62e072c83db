"""The paged KV cache's bookkeeping: which fixed-size blocks a sequence holds.

Pure Python, no device: the runner owns the cache tensors, this owns who may
write where. A block is ``block_size`` token positions of K and V in every
layer; a sequence's block table lists its blocks in position order.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free blocks, handed out and taken back whole."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache of {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used = bytearray(num_blocks)

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._used[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._used[b]:
                raise ValueError(f"block {b} released twice")
            self._used[b] = 0
        # Freed blocks go to the back: a block is reused as late as possible, so
        # that a stale read of a just-freed block would meet its old contents.
        self._free.extend(blocks)


class BlockTable:
    """One sequence's blocks, grown as its KV grows."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def reserve(self, tokens: int) -> bool:
        """Hold blocks for ``tokens`` positions in all; False (nothing taken) if
        the pool has too few."""
        need = self.pool.blocks_for(tokens) - len(self.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        self.blocks.extend(got)
        return True

    def release(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []

    def slot(self, position: int) -> int:
        """The cache slot (block * block_size + offset) of a token position."""
        size = self.pool.block_size
        return self.blocks[position // size] * size + position % size
