"""BlockManager: unit tests and a hypothesis state machine against a simple model.

Invariants checked after every operation of the state machine:
  * no block id is handed out twice (tables pairwise disjoint, and disjoint from the free list);
  * free list + all tables == exactly {0, ..., num_blocks - 1};
  * num_free_blocks + sum(len(table)) == num_blocks;
  * every table holds exactly what the model says (tables only grow, and keep their prefix);
  * `ensure` is all-or-nothing; `free` returns everything the request held.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from contbatch.cache.block_manager import BlockManager, blocks_for

# ---------------------------------------------------------------------------------------------
# blocks_for
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [
        (0, 256, 0),
        (1, 256, 1),
        (255, 256, 1),
        (256, 256, 1),
        (257, 256, 2),
        (512, 256, 2),
        (513, 256, 3),
        (0, 1, 0),
        (1, 1, 1),
        (7, 1, 7),
        (15, 16, 1),
        (16, 16, 1),
        (17, 16, 2),
    ],
)
def test_blocks_for_boundaries(num_tokens, block_size, expected):
    assert blocks_for(num_tokens, block_size) == expected


@given(num_tokens=st.integers(0, 10_000), block_size=st.integers(1, 512))
def test_blocks_for_is_ceil_div(num_tokens, block_size):
    n = blocks_for(num_tokens, block_size)
    assert n == -(-num_tokens // block_size)
    # The smallest number of blocks that holds the tokens.
    assert n * block_size >= num_tokens
    assert n == 0 or (n - 1) * block_size < num_tokens


# ---------------------------------------------------------------------------------------------
# unit tests
# ---------------------------------------------------------------------------------------------


def _pool(bm: BlockManager) -> list[int]:
    """Every free block: content-free ones and (with prefix sharing) evictable cached ones."""
    return list(bm._free) + list(getattr(bm, "_cached", ()))


def _check_consistent(bm: BlockManager, sharing: bool = False) -> None:
    used = Counter(b for t in bm.block_tables.values() for b in t)
    free = _pool(bm)
    for rid, table in bm.block_tables.items():
        assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
    if not sharing:
        assert all(c == 1 for c in used.values()), f"a block is in two tables: {used}"
    refs = getattr(bm, "_refs", None)
    if refs is not None:
        assert [refs[b] for b in range(bm.num_blocks)] == [used.get(b, 0) for b in range(bm.num_blocks)]
    assert len(free) == len(set(free)), "a block is twice in the free pool"
    assert not used.keys() & set(free), "a block is both free and in use"
    assert sorted(list(used) + free) == list(range(bm.num_blocks))
    assert bm.num_free_blocks == len(free)
    assert bm.num_free_blocks + len(used) == bm.num_blocks


def test_fresh_manager_is_all_free():
    bm = BlockManager(10, 4)
    assert bm.num_free_blocks == 10
    assert bm.block_tables == {}
    assert bm.table("nobody") == []
    assert bm.capacity_tokens("nobody") == 40
    assert bm.blocks_missing("nobody", 9) == 3
    _check_consistent(bm)


def test_ensure_grows_exactly_to_ceil():
    bm = BlockManager(10, 4)
    assert bm.ensure("a", 1)
    assert len(bm.table("a")) == 1
    assert bm.ensure("a", 4)  # same block still holds it
    assert len(bm.table("a")) == 1
    assert bm.ensure("a", 5)
    assert len(bm.table("a")) == 2
    assert bm.ensure("a", 2)  # shrinking is a no-op: tables never shrink
    assert len(bm.table("a")) == 2
    assert bm.num_free_blocks == 8
    _check_consistent(bm)


def test_ensure_zero_tokens_allocates_nothing():
    bm = BlockManager(3, 4)
    assert bm.ensure("a", 0)
    assert bm.table("a") == []
    assert bm.num_free_blocks == 3
    _check_consistent(bm)


def test_ensure_is_all_or_nothing():
    bm = BlockManager(5, 4)
    assert bm.ensure("a", 8)  # 2 blocks
    before_tables = {k: list(v) for k, v in bm.block_tables.items()}
    before_free = list(bm._free)
    # b needs 4 blocks, only 3 are free: nothing must move.
    assert not bm.ensure("b", 13)
    assert bm.block_tables == before_tables
    assert list(bm._free) == before_free
    assert bm.table("b") == []
    # a needs 2 more... 6 blocks in all, 5 exist: refused, a keeps its 2 blocks.
    assert not bm.ensure("a", 21)
    assert bm.table("a") == before_tables["a"]
    # exactly fits: succeeds and takes every free block.
    assert bm.ensure("b", 12)
    assert bm.num_free_blocks == 0
    assert not bm.ensure("c", 1)
    assert bm.ensure("c", 0)  # nothing missing, nothing needed
    _check_consistent(bm)


def test_free_returns_everything_and_is_idempotent():
    bm = BlockManager(6, 2)
    assert bm.ensure("a", 5)  # 3 blocks
    assert bm.ensure("b", 2)  # 1 block
    a_blocks = list(bm.table("a"))
    assert bm.free("a") == 3
    assert "a" not in bm.block_tables
    assert bm.num_free_blocks == 5
    assert set(a_blocks) <= set(_pool(bm))
    assert bm.free("a") == 0  # double free: no-op, no duplicate in the free list
    assert bm.free("never") == 0
    _check_consistent(bm)
    assert bm.free("b") == 1
    assert bm.num_free_blocks == 6
    _check_consistent(bm)


def test_capacity_and_blocks_missing():
    bm = BlockManager(8, 4)
    assert bm.ensure("a", 6)  # 2 blocks
    assert bm.capacity_tokens("a") == (2 + 6) * 4
    assert bm.capacity_tokens("z") == 6 * 4
    assert bm.blocks_missing("a", 8) == 0
    assert bm.blocks_missing("a", 9) == 1
    assert bm.blocks_missing("a", 0) == 0
    # ensure(capacity) always succeeds and leaves the pool empty.
    assert bm.ensure("a", bm.capacity_tokens("a"))
    assert bm.num_free_blocks == 0
    _check_consistent(bm)


def test_freed_blocks_are_reused_not_duplicated():
    bm = BlockManager(4, 1)
    for rid in "abcd":
        assert bm.ensure(rid, 1)
    assert not bm.ensure("e", 1)
    bm.free("b")
    assert bm.ensure("e", 1)
    assert bm.table("e") != bm.table("a")
    _check_consistent(bm)


# ---------------------------------------------------------------------------------------------
# rule-based state machine
# ---------------------------------------------------------------------------------------------

REQUEST_IDS = ["r0", "r1", "r2", "r3", "r4", "r5"]


class BlockManagerMachine(RuleBasedStateMachine):
    """Plain allocation (prefix sharing off, the brief's BlockManager): ensure / free against a
    model holding the exact tables we expect."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, list[int]] = {}  # the tables we expect, block ids included

    @initialize(num_blocks=st.integers(0, 40), block_size=st.sampled_from([1, 2, 3, 4, 8, 16, 256]))
    def create(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)

    @rule(rid=st.sampled_from(REQUEST_IDS), num_tokens=st.integers(0, 300))
    def ensure(self, rid, num_tokens):
        bm = self.bm
        old = list(self.model.get(rid, []))
        need = max(0, blocks_for(num_tokens, bm.block_size) - len(old))
        assert bm.blocks_missing(rid, num_tokens) == need
        free_before = bm.num_free_blocks
        tables_before = {k: list(v) for k, v in bm.block_tables.items()}
        ok = bm.ensure(rid, num_tokens)
        assert ok == (need <= free_before)
        if not ok:
            # all or nothing: not a single block moved
            assert {k: list(v) for k, v in bm.block_tables.items()} == tables_before
            assert bm.num_free_blocks == free_before
            return
        new = bm.table(rid)
        assert new[: len(old)] == old, "ensure must keep the existing blocks in place"
        assert len(new) == len(old) + need
        assert len(new) * bm.block_size >= num_tokens
        assert bm.num_free_blocks == free_before - need
        for other, table in tables_before.items():
            if other != rid:
                assert bm.table(other) == table
        if new:
            self.model[rid] = list(new)

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        bm = self.bm
        held = self.model.pop(rid, [])
        free_before = bm.num_free_blocks
        assert bm.free(rid) == len(held)
        assert bm.table(rid) == []
        assert rid not in bm.block_tables
        assert bm.num_free_blocks == free_before + len(held)
        assert set(held) <= set(_pool(bm))

    @rule()
    def free_all(self):
        for rid in list(self.model):
            self.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert sorted(_pool(self.bm)) == list(range(self.bm.num_blocks))

    @invariant()
    def consistent(self):
        _check_consistent(self.bm)
        # Tables the manager keeps are exactly the model's (empty tables may linger or not).
        actual = {k: list(v) for k, v in self.bm.block_tables.items() if v}
        assert actual == self.model
        for rid in REQUEST_IDS:
            held = len(self.model.get(rid, []))
            assert self.bm.capacity_tokens(rid) == (held + self.bm.num_free_blocks) * self.bm.block_size


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# A few fixed sequences (two of them with a common head), cut at random and given a short random
# tail: prefixes, and whole sequences, collide often.
_BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [7] * 16]
SEQUENCES = st.builds(
    lambda base, n, tail: _BASES[base][:n] + tail,
    st.integers(0, len(_BASES) - 1),
    st.integers(1, 16),
    st.lists(st.sampled_from([1, 2]), max_size=4),
)


class PrefixSharingMachine(RuleBasedStateMachine):
    """Prefix sharing on: requests attach (match_prefix), compute tokens (ensure + writes +
    commit, as the engine does) and leave (free). A simulated KV (slot -> token) checks that a
    matched block really holds the request's tokens, that nobody writes into a block another
    request still reads, and that reference counts, the cache and the free list stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[str, list[int]] = {}  # attached requests: their token sequence
        self.computed: dict[str, int] = {}
        self.kv: dict[int, int] = {}  # slot -> token

    @initialize(
        num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]), eviction=st.sampled_from(["lru", "mru"])
    )
    def create(self, num_blocks, block_size, eviction):
        self.bm = BlockManager(num_blocks, block_size, allow_block_sharing=True, eviction=eviction)

    def _slot(self, rid, p):
        bs = self.bm.block_size
        return self.bm.table(rid)[p // bs] * bs + p % bs

    @rule(rid=st.sampled_from(REQUEST_IDS), seq=SEQUENCES, give_back=st.booleans())
    def attach(self, rid, seq, give_back):
        """Match a prefix (whole blocks, then a partial hit copied into a block of its own), and
        run the pending copies as the engine does before its forward; or give the match back
        at once (the scheduler found no room), which must drop its pending copy."""
        if rid in self.seqs:  # churn: the old request leaves, a new one takes its id
            self.free(rid)
        bm = self.bm
        free_before, hits_before = bm.num_free_blocks, bm.prefix_hits
        got = bm.match_prefix(rid, seq)
        bs = bm.block_size
        assert 0 <= got < len(seq), "a match leaves the last token"
        assert len(bm.table(rid)) == blocks_for(got, bs)
        assert bm.prefix_hits - hits_before == got
        assert bm.num_free_blocks <= free_before  # cached blocks it revived left the free pool
        if give_back:
            bm.free(rid)
            assert bm.take_copies() == [], "a match given back leaves no copy behind"
            return
        copies = bm.take_copies()
        assert len(copies) <= 1
        for src, dst, n in copies:
            assert dst == bm.table(rid)[-1] and bm._refs[dst] == 1 and 0 < n <= bs and got % bs == n % bs
            event("partial prefix hit")
            for i in range(n):
                assert src * bs + i in self.kv, "a partial hit copies a position nobody computed"
                self.kv[dst * bs + i] = self.kv[src * bs + i]
        for p in range(got):
            assert self.kv.get(self._slot(rid, p)) == seq[p], f"matched block holds other tokens at {p}"
        if got:
            event("prefix hit")
            if any(bm._refs[b] > 1 for b in bm.table(rid)):
                event("block shared by two live requests")
        self.seqs[rid] = list(seq)
        self.computed[rid] = got

    @rule(rid=st.sampled_from(REQUEST_IDS), k=st.integers(1, 20))
    def compute(self, rid, k):
        if rid not in self.seqs:
            return
        bm, seq, done = self.bm, self.seqs[rid], self.computed[rid]
        target = min(len(seq), done + k)
        evictions = bm.evictions
        if not bm.ensure(rid, target):
            assert bm.blocks_missing(rid, target) > bm.num_free_blocks
            return
        if bm.evictions > evictions:
            event("cached block evicted")
        for p in range(done, target):
            block = bm.table(rid)[p // bm.block_size]
            assert bm._refs[block] == 1, f"{rid} writes position {p} into block {block} that others hold"
            self.kv[self._slot(rid, p)] = seq[p]
        self.computed[rid] = target
        evictions = bm.evictions
        bm.commit(rid, seq, target)
        if target == len(seq):  # the prompt is in: publish its partly filled block, as the engine does
            bm.commit_partial(rid, seq, target)
        assert bm.evictions == evictions

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        if rid in self.seqs:  # a request that ends publishes what it computed
            self.bm.commit_partial(rid, self.seqs[rid], self.computed[rid])
        held = len(self.bm.table(rid))
        assert self.bm.free(rid) == held
        self.seqs.pop(rid, None)
        self.computed.pop(rid, None)
        assert not self.bm.table(rid)

    @invariant()
    def consistent(self):
        bm = self.bm
        _check_consistent(bm, sharing=True)
        for rid, seq in self.seqs.items():
            n = self.computed[rid]
            assert len(bm.table(rid)) == blocks_for(n, bm.block_size)
            for p in range(n):
                assert self.kv.get(self._slot(rid, p)) == seq[p], f"{rid} lost its KV at position {p}"
        for rid in bm.block_tables:
            assert rid in self.seqs or not bm.block_tables[rid]
        # A cached (free, hashed) block is findable: a full one by its hash, a partly filled one
        # under its parent; a content-free one is not. Nothing is left pinned between steps.
        assert not bm._pending
        for b in bm._cached:
            key = bm._keys[b]
            assert key is not None and b in bm._children.get(key.parent, ())
            assert len(key.tokens) < bm.block_size or bm._by_hash.get(key.hash) == b
        for b in bm._free:
            assert bm._keys[b] is None


TestPrefixSharingMachine = PrefixSharingMachine.TestCase
TestPrefixSharingMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 30),
    block_size=st.sampled_from([1, 4, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 200)), max_size=60),
)
def test_random_ops_never_double_allocate(num_blocks, block_size, ops):
    """A flat op list (cheaper than the state machine, so more examples): ensure or free."""
    bm = BlockManager(num_blocks, block_size)
    handed_out: dict[int, str] = {}
    for is_ensure, r, n in ops:
        rid = f"r{r}"
        if is_ensure:
            before = set(bm.table(rid))
            if bm.ensure(rid, n):
                for b in set(bm.table(rid)) - before:
                    assert b not in handed_out, f"block {b} handed to {rid} while {handed_out[b]} holds it"
                    handed_out[b] = rid
        else:
            for b in bm.table(rid):
                del handed_out[b]
            bm.free(rid)
        _check_consistent(bm)
        assert len(handed_out) == bm.num_blocks - bm.num_free_blocks
    for r in range(6):
        bm.free(f"r{r}")
    assert bm.num_free_blocks == num_blocks
    _check_consistent(bm)
