"""The paged KV cache: per-layer K/V tensors addressed by block tables.

Layout per layer: `[kv_heads, (num_blocks + 2) * block_size, width]`, with that layer's own
heads and width (`layout.py`'s `LayerKV`; a layer of zero heads holds an empty tensor). Heads first,
so a step's new keys (`[1, H, T, D]` out of the model) are written with one `index_copy_`
and no transpose, and a block of one head is one contiguous tile for the kernels. The
flash-attn backend needs token-major `[slots, num_kv_heads, head_dim]` instead
(`token_major=True`); `kv(layer)` gives either as the logical `[H_kv, slots, D]` view.
The two extra blocks are never handed out: the first holds the read-trash slot that padded
reads point at, the second the write-trash slot for padded writes.
"""

from __future__ import annotations

import logging
import math

import psutil
import torch

from .. import hugepages
from ..config import DEFAULT_CPU_MAX_MEMORY_PERCENT, DEFAULT_MAX_MEMORY_PERCENT, MIN_BLOCK_SIZE
from ..cpu import ops as cpu_ops
from .block_manager import BlockManager, blocks_for
from .recurrent_state import RecurrentStateCache
from .layout import KVLayout
from .resident import ResidentKV, availability

logger = logging.getLogger("contbatch")

RESERVED_BLOCKS = 2


def solve_num_blocks(
    layout: KVLayout,
    block_size: int,
    device: torch.device,
    wanted_tokens: int,
    max_memory_percent: float | None,
) -> tuple[int, str]:
    """Pick `num_blocks` when the user did not; returns it with the rule that applied. The
    cache may take `max_memory_percent` of the memory of the device it lives on (None: 0.9 of
    a GPU's free memory; on the CPU, what the workload can use, within 0.2 of the available
    RAM, which the process shares with the model's weights and activations)."""
    per_block = layout.bytes_per_block(block_size)
    if per_block == 0:  # no layer keeps KV (an attention-free model): blocks only count positions
        wanted = blocks_for(wanted_tokens, block_size)
        return wanted, f"no KV layers: {wanted} blocks number the workload's positions and hold nothing"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = max_memory_percent or DEFAULT_MAX_MEMORY_PERCENT
        n = int(free * share) // per_block - RESERVED_BLOCKS
        return max(1, n), f"gpu: {share:.0%} of {free / 2**30:.1f} GiB free device memory"
    wanted = blocks_for(wanted_tokens, block_size)
    available = psutil.virtual_memory().available
    share = max_memory_percent or DEFAULT_CPU_MAX_MEMORY_PERCENT
    cap = max(1, int(available * share) // per_block - RESERVED_BLOCKS)
    if wanted <= cap:
        return wanted, f"cpu: workload needs {wanted_tokens} tokens (under the RAM cap of {cap} blocks)"
    return cap, (
        f"cpu: capped at {share:.0%} of {available / 2**30:.1f} GiB available RAM "
        f"(workload wanted {wanted} blocks)"
    )


class PagedAttentionCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        allow_block_sharing: bool = False,
        eviction: str = "lru",
        token_major: bool = False,
    ) -> None:
        if block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"Block size must be at least {MIN_BLOCK_SIZE}, but got {block_size}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.token_major = token_major
        rows = (num_blocks + RESERVED_BLOCKS) * block_size
        shapes = [(rows, s.kv_heads, s.width) if token_major else (s.kv_heads, rows, s.width) for s in layout.layers]
        # Zeros, not empty: padded reads land in the trash block and must stay finite.
        self.key_cache = [_zeros(shape, layout.dtype, self.device) for shape in shapes]
        self.value_cache = [_zeros(shape, layout.dtype, self.device) for shape in shapes]
        self.read_trash_slot = num_blocks * block_size
        self.sentinel_slot = self.read_trash_slot + 1
        self.write_trash_slot = (num_blocks + 1) * block_size
        self.block_manager = BlockManager(num_blocks, block_size, allow_block_sharing, eviction)
        # On the CPU our C++ writer (cpu/csrc/kv_write_cpu.cpp) stores a step's rows without first
        # reading the cache lines they overwrite: aten's index_copy_ was ~10% of a decode step.
        self.native_write = self.device.type == "cpu" and cpu_ops.kv_write_available()
        # Per-request states of a hybrid model's recurrent layers (None: the model has none).
        self.recurrent: RecurrentStateCache | None = None
        # On the CPU, fresh blocks' pages made resident before a step writes them (resident.py).
        self.resident = (ResidentKV(self.key_cache + self.value_cache, num_blocks, block_size, token_major)
                         if self.device.type == "cpu" and layout.bytes_per_block(block_size) and availability()[0]
                         else None)

    @property
    def num_rows(self) -> int:
        return (self.num_blocks + RESERVED_BLOCKS) * self.block_size

    def make_resident(self, block_table: torch.Tensor | None = None) -> None:
        """Before a step: every block handed out so far resident (the block manager's frontier;
        a tensor-parallel worker, whose blocks rank 0 hands out, passes the step's block table),
        so that the step's writes take no page faults."""
        if self.resident is None:
            return
        if block_table is None:
            self.resident.upto(self.block_manager.frontier)
        else:
            real = block_table[block_table < self.num_blocks]  # not the reserved blocks padding points at
            self.resident.upto(int(real.max()) + 1 if real.numel() else 0)

    def populate_ahead(self) -> bool:
        """While the engine is idle: one more block past the frontier resident (a few
        milliseconds at most, so a request arriving meanwhile waits no longer than that); False
        when there is nothing (more) to do, and the engine thread then waits for commands."""
        return self.resident is not None and self.resident.ahead(self.block_manager.frontier)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as logical `[H_kv, slots, D]` views (strided when
        token-major): what the attention kernels index through block tables."""
        k, v = self.key_cache[layer_idx], self.value_cache[layer_idx]
        return (k.transpose(0, 1), v.transpose(0, 1)) if self.token_major else (k, v)

    def gather_index(self, slots: torch.Tensor, kv_heads: int | None = None) -> torch.Tensor:
        """Row indices into the flattened `[H_kv * rows, D]` view of a layer of `kv_heads` heads
        (default: the layout's most) that read `slots` ([..., n]) as `[..., H_kv, n, D]`,
        contiguous: one `index_select` per layer, no transpose copy."""
        count = self.layout.num_kv_heads if kv_heads is None else kv_heads
        heads = torch.arange(count, device=slots.device) * self.num_rows
        return (heads[:, None] + slots.unsqueeze(-2)).reshape(-1)

    def gather(self, layer_idx: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `index` (from `gather_index` with this layer's heads), flat:
        `[len(index), D]`."""
        d = self.layout.layer(layer_idx).width
        return (
            self.key_cache[layer_idx].view(-1, d).index_select(0, index),
            self.value_cache[layer_idx].view(-1, d).index_select(0, index),
        )

    def slots_of(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Cache slots of the first `num_tokens` positions of a sequence stored in `blocks`."""
        pos = torch.arange(num_tokens, device=self.device)
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def copy_out(self, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K/V for every layer, as two flat host tensors: each layer's
        `[H_kv * n, D]` rows of its own shape, laid end to end (`copy_in` splits them back).

        One gather per layer on the device, then one batched device-to-host copy (into pinned
        memory, asynchronously, when the cache is on a GPU).
        """
        slots = self.slots_of(blocks, num_tokens)
        out = []
        for tensors in (self.key_cache, self.value_cache):
            parts = []
            for layer, t in enumerate(tensors):
                if not self.layout.layer(layer).kv_heads:  # a layer without KV: nothing to copy
                    continue
                index, width = self._rows_of(slots, layer)
                parts.append(t.view(-1, width).index_select(0, index).reshape(-1))
            stacked = torch.cat(parts)
            if self.device.type == "cuda":
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                stacked = host
            out.append(stacked)
        return out[0], out[1]

    def copy_in(self, blocks: list[int], num_tokens: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put back what `copy_out` took, into (possibly different) blocks."""
        slots = self.slots_of(blocks, num_tokens)
        keys = keys.to(self.device, non_blocking=True)
        values = values.to(self.device, non_blocking=True)
        start = 0
        for layer in range(self.layout.num_layers):
            if not self.layout.layer(layer).kv_heads:
                continue
            index, width = self._rows_of(slots, layer)
            size = index.numel() * width
            for cache, flat in ((self.key_cache, keys), (self.value_cache, values)):
                cache[layer].view(-1, width).index_copy_(0, index, flat[start : start + size].view(-1, width))
            start += size
        if start != keys.numel() or start != values.numel():
            raise ValueError(f"copy_in was given {keys.numel()} / {values.numel()} values for a layout of {start}")

    def copy_positions(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (src, dst, n): the first `n` positions of block `src`, every layer and KV
        head, into block `dst` (a partial prefix hit; the blocks are distinct)."""
        bs = self.block_size
        for src, dst, n in copies:
            a, b = src * bs, dst * bs
            for cache in (*self.key_cache, *self.value_cache):
                if self.token_major:
                    cache[b : b + n].copy_(cache[a : a + n])
                else:
                    cache[:, b : b + n].copy_(cache[:, a : a + n])

    def _rows_of(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, int]:
        """Rows of a 2-D view of one layer's tensor that hold `slots`, and that view's width."""
        shape = self.layout.layer(layer)
        if self.token_major:
            return slots, shape.kv_heads * shape.width
        return self.gather_index(slots, shape.kv_heads), shape.width

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a step's new K/V (`[H_kv, T, D]`) at their slots (int64)."""
        if self.native_write:
            k_cache, v_cache = self.kv(layer_idx)
            key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
            cpu_ops.kv_write(k_cache, v_cache, slots, key, value)
        elif self.token_major:
            self.key_cache[layer_idx].index_copy_(0, slots, key.transpose(0, 1))
            self.value_cache[layer_idx].index_copy_(0, slots, value.transpose(0, 1))
        else:
            self.key_cache[layer_idx].index_copy_(1, slots, key)
            self.value_cache[layer_idx].index_copy_(1, slots, value)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU: a private anonymous mapping (`hugepages.py`), which the
    OS hands out as zero pages on first touch, on ordinary pages.

    `torch.zeros` wrote every byte at start-up: a lone request's manager, whose cache is sized
    to a share of RAM, spent seconds zeroing gigabytes it never used. Here memory is touched
    only as blocks are written, which happens inside steps: a block allocated for the first
    time faults its pages in while the step writes its rows. Advised for 2 MiB pages, the first
    row of a block written there faulted in 2 MiB for every layer and KV head at once, and a
    step that crossed into fresh memory stalled for that (in a virtual machine, for the host
    to back each 2 MiB as well); on ordinary pages the same memory arrives 4 KiB at a time as
    the rows fill it, and the decode steps' TLB misses on 4 KiB pages cost less than the
    stalls did (docs/cpu.md has both measurements)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < hugepages.HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer, start = hugepages.zeroed_buffer(nbytes, huge=False)  # zero-filled by the OS
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start).view(shape)  # the tensor holds the mapping
