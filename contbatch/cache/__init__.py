from .block_manager import BlockManager, blocks_for
from .layout import KVLayout, LayerKV
from .paged_cache import RESERVED_BLOCKS, PagedAttentionCache, solve_num_blocks

__all__ = ["BlockManager", "KVLayout", "LayerKV", "PagedAttentionCache", "RESERVED_BLOCKS", "blocks_for",
           "solve_num_blocks"]
