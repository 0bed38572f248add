"""Block allocation: a free list and one block table per request.

Knows nothing of tensors or scheduling; it hands out block ids and takes them back.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_missing(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks `request_id` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.table(request_id)))

    def capacity_tokens(self, request_id: str) -> int:
        """Tokens the request could hold if it took every free block."""
        return (len(self.table(request_id)) + len(self._free)) * self.block_size

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens`; all or nothing."""
        missing = self.blocks_missing(request_id, num_tokens)
        if missing > len(self._free):
            return False
        if missing:
            table = self.block_tables.setdefault(request_id, [])
            table.extend(self._free.popleft() for _ in range(missing))
        return True

    def free(self, request_id: str) -> int:
        """Return every block of the request to the pool; returns how many."""
        table = self.block_tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)
