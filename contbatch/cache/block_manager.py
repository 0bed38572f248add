"""Block allocation: a free list, one block table per request, and prefix sharing.

Knows nothing of tensors or scheduling; it hands out block ids and takes them back.

Prefix sharing: a block whose `block_size` tokens are all computed gets a content hash chained
on its parent's (so equal hashes mean equal prefixes, checked against the stored tokens).
Other requests with the same prefix reuse it by reference count. When its last user leaves it
stays, still hashed, in the free pool as cache, and is evicted only when no content-free block
is left.

Reuse finer than a block: a request's partly filled last block is published too (once its
prompt is computed, and again with every computed token when it ends), keyed by its parent and
the tokens it holds. A later prompt whose next tokens agree with the first `m` tokens of such a
block, or of a full cached block, gets a block of its own and a pending copy of those `m`
positions (`take_copies`: the engine copies them before the step's forward); the source is
pinned until then. So a system prompt or an earlier chat turn shorter than a block is reused
token by token, and a block that others read is never written by a newcomer. Eviction is least recently released first (LRU, like vLLM): a prefix that many
requests keep coming back to is released often and so stays, while one-off tails go first.
`benchmarks/prefix_eviction.py` measures why against the reference engine's opposite order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "mru")
PARTIAL_CANDIDATES = 32  # most recently published blocks under one parent tried for a partial hit


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return (num_tokens + block_size - 1) // block_size


@dataclass(frozen=True)
class PendingCopy:
    """The first `num_tokens` positions of block `src` belong in `dst` before the next forward."""

    src: int
    dst: int
    num_tokens: int
    request_id: str


@dataclass(frozen=True)
class BlockKey:
    parent: int | None  # hash of the previous block of the sequence
    tokens: tuple[int, ...]

    @property
    def hash(self) -> int:
        return hash((self.parent, self.tokens))


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, allow_block_sharing: bool = False, eviction: str = "lru"
    ) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allow_block_sharing = allow_block_sharing
        self.eviction = eviction
        # Free, holding nothing reusable: blocks given back first (their memory is in use
        # already), then the never-used ones in ascending order.
        self._free: deque[int] = deque(range(num_blocks))
        self.frontier = 0  # every block below it has been handed out at least once (cache/resident.py)
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, hashed: in release order
        self._refs = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._hashed: dict[str, int] = {}  # leading blocks of each table already hashed
        # Blocks that serve as the next block after a parent hash (full ones that `_by_hash`
        # serves and partly filled published ones): where partial hits are looked for.
        self._children: dict[int | None, dict[int, None]] = {}
        self._pending: list[PendingCopy] = []  # partial hits not yet copied, sources pinned
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there
        self.evictions = 0

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: content-free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_missing(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks `request_id` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.table(request_id)))

    def capacity_tokens(self, request_id: str) -> int:
        """Tokens the request could hold if it took every free block."""
        return (len(self.table(request_id)) + self.num_free_blocks) * self.block_size

    # -- allocation ----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
            self.frontier = max(self.frontier, block + 1)
        else:
            block, _ = self._cached.popitem(last=self.eviction == "mru")
            self._unpublish(block)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens`; all or nothing."""
        table = self.block_tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # most decode steps: the next token fits in the last block
        missing = self.blocks_missing(request_id, num_tokens)
        if missing > self.num_free_blocks:
            return False
        if missing:
            table = self.block_tables.setdefault(request_id, [])
            table.extend(self._take() for _ in range(missing))
        return True

    def free(self, request_id: str) -> int:
        """Drop the request's references; returns how many blocks it held.

        Tail blocks are released first, so a sequence's head (the part most likely shared)
        is the most recently released and the last evicted.
        """
        table = self.block_tables.pop(request_id, [])
        self._hashed.pop(request_id, None)
        mine = [p for p in self._pending if p.request_id == request_id]
        if mine:  # matched, then given back before its copy ran
            self._pending = [p for p in self._pending if p.request_id != request_id]
            self._release([p.src for p in mine])
        self._release(table)
        return len(table)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back the request's blocks past those `num_tokens` tokens need (speculative
        proposals that were rejected); returns how many. Tail blocks hold no complete block
        of computed tokens, so none of them was ever hashed."""
        table = self.block_tables.get(request_id)
        keep = blocks_for(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self._release(tail)
        return len(tail)

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, last first. A block nobody uses any more stays
        cached if it serves its prefix, else it goes back to the free list."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                key = self._keys[block]
                if key is not None and block in self._children.get(key.parent, ()):
                    self._cached[block] = None
                else:  # never hashed, or a twin of a block that already serves this prefix
                    self._keys[block] = None
                    self._free.appendleft(block)

    # -- prefix sharing ------------------------------------------------------------------
    def _keys_for(self, token_ids: list[int], num_blocks: int, start: int = 0, parent: int | None = None):
        bs = self.block_size
        for i in range(start, num_blocks):
            key = BlockKey(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            parent = key.hash
            yield key

    def match_prefix(self, request_id: str, token_ids: list[int], salt: int | None = None) -> int:
        """Attach cached blocks holding a prefix of `token_ids` to a request with no blocks,
        then, where the prefix goes on inside a block, a fresh block with a pending copy of
        the positions it shares (see the module docstring).

        Returns the tokens whose KV is (or will be, before the forward) in place. The last token
        is always left to compute: the step needs its logits. `salt` (a request's LoRA adapter
        and its weight version) is the first block's parent: sequences of different salts never match.
        """
        if not self.allow_block_sharing or self.block_tables.get(request_id):
            return 0
        reusable = len(token_ids) - 1
        eligible = reusable // self.block_size
        self.prefix_queries += max(0, reusable)
        table: list[int] = []
        parent = salt
        for key in self._keys_for(token_ids, eligible, parent=salt):
            block = self._by_hash.get(key.hash)
            if block is None or self._keys[block] != key:
                break
            self._pin(block)
            table.append(block)
            parent = key.hash
        matched = len(table) * self.block_size
        partial = self._partial_hit(parent, token_ids[matched:reusable]) if self.num_free_blocks else None
        if partial is not None:
            src, m = partial
            self._pin(src)
            if self.num_free_blocks:
                dst = self._take()
                self._pending.append(PendingCopy(src, dst, m, request_id))
            else:  # the source was the last free block: nobody uses it, so it is taken over whole
                self._unpublish(src)
                dst = src
            table.append(dst)
            matched += m
        if table:
            self.block_tables[request_id] = table
            self._hashed[request_id] = len(table) - (partial is not None)
        self.prefix_hits += matched
        return matched

    def _pin(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def _partial_hit(self, parent: int | None, rest: list[int]) -> tuple[int, int] | None:
        """The published block after `parent` that shares the most leading tokens with `rest`
        (at most a block's worth), and how many: None when none shares any."""
        want = tuple(rest[: self.block_size])
        children = self._children.get(parent)
        if not want or not children:
            return None
        best, best_m = None, 0
        for block in list(reversed(children))[:PARTIAL_CANDIDATES]:
            m = _common_prefix(self._keys[block].tokens, want)
            if m > best_m:
                best, best_m = block, m
        return (best, best_m) if best is not None else None

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The pending partial-hit copies as (src, dst, num_tokens), for the engine to run
        before the next forward; their sources are unpinned (the copies run before any later
        step can write to a block handed out again)."""
        pending, self._pending = self._pending, []
        self._release([p.src for p in pending])
        return [(p.src, p.dst, p.num_tokens) for p in pending]

    def block_hashes(self, token_ids: list[int], salt: int | None = None) -> list[int]:
        """Chained hashes of the blocks `match_prefix` could reuse for this sequence."""
        return [key.hash for key in self._keys_for(token_ids, (len(token_ids) - 1) // self.block_size, parent=salt)]

    def cached_blocks(self, token_ids: list[int], hashes: list[int]) -> int:
        """How many leading blocks of `token_ids` are in the cache now: a look, with no
        reference taken and nothing counted as a query."""
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self._by_hash.get(h)
            if block is None or self._keys[block].tokens != tuple(token_ids[i * bs : (i + 1) * bs]):
                return i
        return len(hashes)

    def commit(self, request_id: str, token_ids: list[int], num_computed: int, salt: int | None = None) -> None:
        """Hash the request's blocks that `num_computed` tokens have just completed."""
        if not self.allow_block_sharing:
            return
        table = self.block_tables.get(request_id, [])
        done = self._hashed.get(request_id, 0)
        full = min(num_computed // self.block_size, len(table))
        if full <= done or (done and self._keys[table[done - 1]] is None):  # chain cut by a reset
            return
        parent = self._keys[table[done - 1]].hash if done else salt
        for i, key in enumerate(self._keys_for(token_ids, full, done, parent), start=done):
            block = table[i]
            self._unpublish(block)  # its partial key, if it had one
            self._keys[block] = key
            if self._by_hash.setdefault(key.hash, block) == block:  # first writer wins; a twin stays private
                self._children.setdefault(key.parent, {})[block] = None
        self._hashed[request_id] = full

    def commit_partial(self, request_id: str, token_ids: list[int], num_computed: int,
                       salt: int | None = None) -> None:
        """Publish the request's partly filled last block (its first `num_computed` tokens
        computed) for partial hits, when the blocks before it are published (`commit`)."""
        if not self.allow_block_sharing:
            return
        table = self.block_tables.get(request_id, [])
        bs = self.block_size
        full, held = divmod(num_computed, bs)
        if not held or full >= len(table) or self._hashed.get(request_id, 0) != full:
            return
        if full and self._keys[table[full - 1]] is None:  # chain cut by a reset
            return
        block = table[full]
        self._unpublish(block)
        key = BlockKey(self._keys[table[full - 1]].hash if full else salt, tuple(token_ids[full * bs : num_computed]))
        self._keys[block] = key
        self._children.setdefault(key.parent, {})[block] = None

    def _unpublish(self, block: int) -> None:
        """Take a block's key out of the indexes (evicted, or its key is being replaced)."""
        key = self._keys[block]
        if key is None:
            return
        if self._by_hash.get(key.hash) == block:
            del self._by_hash[key.hash]
        children = self._children.get(key.parent)
        if children is not None and block in children:
            del children[block]
            if not children:
                del self._children[key.parent]
        self._keys[block] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the weights changed: their KV is stale). Cached blocks
        nobody uses go back to the free pool; blocks in use keep their content for their
        owners but serve no one else, and the chains of their owners stop there. Returns the
        number of blocks freed."""
        freed = len(self._cached)
        self._free.extendleft(self._cached)
        self._cached.clear()
        self._by_hash.clear()
        self._children.clear()
        self._keys = [None] * self.num_blocks
        return freed


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples: a binary search over slice
    comparisons (each one a C loop), not a Python loop over tokens."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
