from .block_manager import BlockManager, blocks_for
from .paged_cache import RESERVED_BLOCKS, KVLayout, PagedAttentionCache, solve_num_blocks

__all__ = ["BlockManager", "KVLayout", "PagedAttentionCache", "RESERVED_BLOCKS", "blocks_for", "solve_num_blocks"]
