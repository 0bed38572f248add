"""The one object that carries a step's batch layout into the model's forward.

Built once per step by `engine/batch.py`, passed to `model(...)` as the `cb_meta` keyword,
which `transformers` forwards untouched to every attention call. All index tensors are
computed here once and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.paged_cache import PagedAttentionCache

if TYPE_CHECKING:
    from .kernels import AttentionKernels


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which keys a query may see: causal, and within the window where the layer has one
    (`q - k < window`, as `transformers` masks it). Broadcasts over its inputs."""
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


@dataclass
class PrefillRow:
    """A request computing several query tokens this step (a prompt chunk)."""

    q_start: int  # first row of this request in the flattened query
    q_len: int
    kv_len: int  # keys it attends to: everything cached before plus this chunk
    # Gather index (see PagedAttentionCache.gather_index) of all kv_len keys; None when the
    # chunk is the whole sequence so far (a first chunk): its keys are the step's fresh K/V.
    kv_index: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decode rows of similar length, attended in one batched matmul.

    Rows are sorted by key length and split into a few groups, each padded only to its own
    longest row: far less gathered padding than one group padded to the batch maximum.
    """

    row_start: int  # first decode row of the group (rows are the first tokens of the batch)
    num_rows: int
    kv_len: int  # padded key length of the group
    kv_lens: torch.Tensor  # [num_rows]: real key count of each row
    kv_index: torch.Tensor  # gather index, [num_rows, H_kv, kv_len] flattened
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Additive mask `[rows, 1, 1, kv_len]`, per sliding window, built once per step."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.kv_len, device=self.kv_lens.device)[None, :]
            visible = visible_keys(self.kv_lens[:, None] - 1, key_pos, sliding_window)
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            mask.masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :]
            self._masks[sliding_window] = mask
        return mask


@dataclass
class BatchMetadata:
    cache: PagedAttentionCache
    write_slots: torch.Tensor  # [T]: where each new token's K/V goes
    decode_groups: list[DecodeGroup]  # single-token rows; they come first in the batch
    prefill_rows: list[PrefillRow]

    @property
    def num_decode_rows(self) -> int:
        return sum(g.num_rows for g in self.decode_groups)


@dataclass
class FlatMetadata:
    """A step as device tensors only, for the GPU kernels (and so for CUDA graphs): the
    kernels walk block tables and length arrays themselves; nothing is read on the host."""

    cache: PagedAttentionCache
    kernels: AttentionKernels
    decode_only: bool
    write_slots: torch.Tensor  # [T]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32
    tile_request: torch.Tensor | None  # varlen query tiles (Triton)
    tile_start: torch.Tensor | None
    max_q_len: int  # host-side bounds, for kernels whose launch needs them (flash-attn)
    max_kv_len: int
