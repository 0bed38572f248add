"""The CPU offload tier: where a KV-pressure victim's cache waits until it runs again.

One place for all of it: the capacity accounting the scheduler asks (`fits`, `reserve`,
`release`), the host copies the engine makes before the forward (`copy_out`, `copy_in`),
and `drop` for a request that ends while offloaded. The one device-side move the engine makes
before a forward, partial prefix hits (`copy_prefix`), goes through here too, so that under
tensor parallelism every rank repeats it in the same order. The accounting is in blocks and knows no
tensors, so the scheduler can use it; only the copies touch the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .paged_cache import PagedAttentionCache


class HostKVTier:
    def __init__(self, cache: PagedAttentionCache | None, capacity_blocks: int) -> None:
        self.cache = cache
        self.capacity_blocks = capacity_blocks
        self.reserved: dict[str, int] = {}  # request id -> host blocks promised to it
        self.used_blocks = 0
        self._copies: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # keys, values, tokens
        # Tensor parallelism: rank 0 hears of every copy (op name, args) and has the workers,
        # whose caches hold the other KV heads, repeat it before the next forward.
        self.listener: Callable[[str, tuple], None] | None = None

    # -- accounting (scheduler) ----------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        return request_id in self.reserved

    def fits(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def reserve(self, request_id: str, num_blocks: int) -> None:
        self.reserved[request_id] = num_blocks
        self.used_blocks += num_blocks

    def release(self, request_id: str) -> None:
        """The request is being restored: its host space is free for the next victim."""
        self.used_blocks -= self.reserved.pop(request_id, 0)

    # -- copies (engine, before the forward) ----------------------------------------------
    def copy_out(self, request_id: str, blocks: list[int], num_tokens: int) -> None:
        self._tell("copy_out", request_id, blocks, num_tokens)
        keys, values = self.cache.copy_out(blocks, num_tokens)
        self._copies[request_id] = (keys, values, num_tokens)

    def copy_in(self, request_id: str, blocks: list[int]) -> None:
        self._tell("copy_in", request_id, blocks)
        keys, values, num_tokens = self._copies.pop(request_id)
        self.cache.copy_in(blocks, num_tokens, keys, values)

    def copy_prefix(self, copies: list[tuple[int, int, int]]) -> None:
        """Partial prefix hits: the first `n` positions of block `src` into block `dst`."""
        self._tell("copy_prefix", [tuple(c) for c in copies])
        self.cache.copy_positions(copies)

    def drop(self, request_id: str) -> None:
        """Forget a request that ended (finished, cancelled, failed) wherever it was."""
        self.release(request_id)
        self._copies.pop(request_id, None)
        self._tell("drop", request_id)

    def clear(self) -> None:
        self._tell("clear")
        self.reserved.clear()
        self._copies.clear()
        self.used_blocks = 0

    def _tell(self, op: str, *args) -> None:
        if self.listener is not None:
            self.listener(op, args)
