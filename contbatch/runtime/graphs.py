"""Captured forwards, kept in an LRU and replayed when a padded step shape comes back.

All graphs draw on one memory pool: they never run at the same time (steps are serial on
the compute stream), so the pool only needs the largest graph's working memory, not the
sum. Capture itself is a strategy (`capture_cuda_graph` on a GPU); the cache logic (keys,
hits, eviction) is plain Python and tested on the CPU with an eager stand-in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

logger = logging.getLogger("contbatch")

# capture(run, pool) -> (replay, output): `run()` enqueues the forward on static buffers and
# returns its output tensor; `replay()` re-runs what was captured, refreshing that output.
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def capture_cuda_graph(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `run` into a CUDA graph on the current (compute) stream. The caller has already
    run it once eagerly on the same buffers (lazy init, Triton compilation, cuBLAS
    workspaces). `capture_begin` directly rather than `torch.cuda.graph`, which also runs a
    full `gc.collect()` and empties the allocator cache on every capture; "thread_local" so
    CUDA calls on other threads (a user's own model calls) do not break the capture."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.current_stream().synchronize()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        output = run()
    finally:
        graph.capture_end()
    return graph.replay, output


def eager_capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in with the same contract for devices without graphs: replay runs again and
    writes into the first run's output, so the caller sees one fixed output tensor."""
    output = run()

    def replay() -> None:
        output.copy_(run())

    return replay, output


class GraphCache:
    def __init__(self, capacity: int, capture: Capture, pool: Any = None) -> None:
        if capacity < 1:
            raise ValueError(f"max_cached_graphs must be >= 1, got {capacity}")
        self.capacity = capacity
        self.capture = capture
        self.pool = pool
        self._graphs: OrderedDict[Hashable, tuple[Callable[[], None], torch.Tensor]] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        return list(self._graphs)

    def replay(self, key: Hashable) -> torch.Tensor | None:
        """Replay the graph for `key` if there is one; returns its output, else None."""
        entry = self._graphs.get(key)
        if entry is None:
            return None
        self._graphs.move_to_end(key)
        entry[0]()
        self.replays += 1
        return entry[1]

    def add(self, key: Hashable, run: Callable[[], torch.Tensor]) -> None:
        """Capture `run` for `key`, evicting the least recently used graph when full."""
        while len(self._graphs) >= self.capacity:
            old, _ = self._graphs.popitem(last=False)
            self.evictions += 1
            logger.debug("contbatch: evicted CUDA graph %s", old)
        self._graphs[key] = self.capture(run, self.pool)
        self.captures += 1
