"""Which requests run in the next step, and how many tokens each.

A scheduler owns the waiting queue and the running set, and answers one question per step
under three budgets: query tokens (`max_batch_tokens`), requests (`max_requests_per_batch`)
and cache blocks. It knows requests and the block manager, never tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..cache.block_manager import BlockManager
from ..cache.offload import HostKVTier
from ..requests import RequestState, RequestStatus

# A new request waits a step for a prompt being computed that shares at least this many of the
# tokens it would compute next (less than a block): fewer are not worth a step's wait.
PARTIAL_HOLD_TOKENS = 32


@dataclass
class ScheduledChunk:
    state: RequestState
    num_tokens: int  # computed this step, starting at state.num_computed_tokens (drafts included)
    draft: list[int] = field(default_factory=list)  # proposed tokens verified after the last known one

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known sequence, so the step samples a token."""
        return self.state.num_computed_tokens + self.num_tokens - len(self.draft) == self.state.num_tokens


@dataclass
class Offload:
    """A victim's KV leaving for host memory: the blocks to copy out before this step runs."""

    state: RequestState
    blocks: list[int]
    num_tokens: int


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)  # soft reset this step
    offloaded: list[Offload] = field(default_factory=list)  # copy out before the forward
    restored: list[RequestState] = field(default_factory=list)  # copy back in before the forward
    held_by_margin: int = 0  # waiting requests held back by the safety margin

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Shared bookkeeping; subclasses choose the order of running work."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        safety_margin: float = 0.0,
        host: HostKVTier | None = None,
        hold_shared_prefixes: bool = True,
    ) -> None:
        if not 0.0 <= safety_margin <= 1.0:
            raise ValueError(f"Got safety_margin = {safety_margin} but expected a value in [0, 1]")
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = safety_margin
        self.waiting: deque[RequestState] = deque()
        self.running: dict[str, RequestState] = {}
        # Where victims' KV waits (capacity 0: no tier, victims are soft reset).
        self.host = host if host is not None else HostKVTier(None, 0)
        self.soft_resets = 0
        self.offloads = 0
        self.restores = 0
        # In-burst prefix dedup: a new request whose next uncached prompt block (or a good part
        # of it) is being computed right now by another request waits for it instead of
        # computing it again.
        self.hold_shared_prefixes = hold_shared_prefixes and block_manager.allow_block_sharing
        self._hashes: dict[str, list[int]] = {}  # request id -> its prompt's block hashes
        self.held_for_prefix = 0  # steps whose admissions stopped at a request waiting for its prefix

    # -- bookkeeping -------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> RequestState | None:
        state = self.running.get(request_id)
        if state is None:
            state = next((s for s in self.waiting if s.request_id == request_id), None)
        return state

    def remove(self, request_id: str) -> RequestState | None:
        """Take a request out wherever it is (finished, cancelled, failed) and free its
        blocks, here and in the host tier."""
        self.host.drop(request_id)
        state = self.running.pop(request_id, None)
        if state is None:
            for i, waiting in enumerate(self.waiting):
                if waiting.request_id == request_id:
                    state = waiting
                    del self.waiting[i]
                    break
        self.block_manager.free(request_id)
        self._hashes.pop(request_id, None)
        return state

    def recompute(self, state: RequestState) -> None:
        """Forget a request's KV wherever it is (running, or offloaded to the host tier): its
        tokens stay and are recomputed when it is scheduled again, ahead of later arrivals."""
        self.host.drop(state.request_id)
        self.block_manager.free(state.request_id)
        if not state.num_computed_tokens:
            return
        state.soft_reset()
        self.soft_resets += 1
        if self.running.pop(state.request_id, None) is not None:
            at = next((i for i, w in enumerate(self.waiting) if w.arrival > state.arrival), len(self.waiting))
            self.waiting.insert(at, state)

    def _preempt(self, state: RequestState, plan: StepPlan) -> None:
        """Make room: offload the victim's KV to host memory if it fits there, else soft
        reset it (blocks freed, tokens kept, recomputed later). Either way it queues again
        ahead of new arrivals."""
        del self.running[state.request_id]
        blocks = list(self.block_manager.table(state.request_id))
        if state.num_computed_tokens and self.host.fits(len(blocks)):
            plan.offloaded.append(Offload(state, blocks, state.num_computed_tokens))
            self.host.reserve(state.request_id, len(blocks))
            state.status = RequestStatus.PREEMPTED
            self.offloads += 1
        else:
            state.soft_reset()
            self.soft_resets += 1
            plan.preempted.append(state)
        self.block_manager.free(state.request_id)
        # Back in arrival order, ahead of anything that came after it.
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > state.arrival), len(self.waiting))
        self.waiting.insert(at, state)

    # -- one step ------------------------------------------------------------------------
    def _running_order(self, by_arrival: list[RequestState]) -> list[RequestState]:
        raise NotImplementedError

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        tokens_left = self.max_batch_tokens
        scheduled: set[str] = set()
        by_arrival = sorted(self.running.values(), key=lambda s: s.arrival)

        for state in self._running_order(by_arrival):
            if tokens_left == 0 or len(plan.chunks) >= self.max_requests_per_batch:
                break
            # Preempted earlier in this step, or ending on its token still in flight (async).
            if state.request_id not in self.running or state.exhausted:
                continue
            draft = self._draft(state, tokens_left)
            if draft:
                plan.chunks.append(ScheduledChunk(state, 1 + len(draft), draft))
                scheduled.add(state.request_id)
                tokens_left -= 1 + len(draft)
                continue
            want = min(state.remaining_tokens, tokens_left)
            got = self._grow_running(state, want, scheduled, plan)
            if got:
                plan.chunks.append(ScheduledChunk(state, got))
                scheduled.add(state.request_id)
                tokens_left -= got

        bm = self.block_manager
        reserve = self.safety_margin * bm.num_blocks
        admitted: list[RequestState] = []
        in_progress = self._blocks_in_progress() if self.hold_shared_prefixes and self.waiting else None
        for state in self.waiting:
            if tokens_left <= 0 or len(plan.chunks) >= self.max_requests_per_batch:
                break
            # Only these step aside: siblings of an n > 1 request (to share its prompt),
            # requests preempted with their last token still in flight (they end when it lands),
            # and requests whose structured-output grammar is still compiling.
            if _waits_for_sibling(state) or state.exhausted or (state.grammar is not None and not state.grammar.ready):
                continue
            if plan.chunks and bm.num_free_blocks < reserve:
                plan.held_by_margin = len(self.waiting) - len(admitted)
                break
            restoring = self.host.holds(state.request_id)
            fresh = not restoring and state.num_computed_tokens == 0
            if fresh and in_progress is not None and self._prefix_in_progress(state, in_progress):
                self.held_for_prefix += 1  # waits for its prefix; FIFO: nobody overtakes it
                break
            if fresh:
                state.num_computed_tokens = bm.match_prefix(state.request_id, state.all_token_ids, state.cache_salt)
            room = bm.capacity_tokens(state.request_id) - state.num_computed_tokens
            got = min(state.remaining_tokens, tokens_left, room)
            if got <= 0:
                if not restoring:  # give back any prefix it matched; it stays at the head
                    bm.free(state.request_id)
                    state.num_computed_tokens = 0
                break  # FIFO: nobody overtakes the head of the queue
            bm.ensure(state.request_id, state.num_computed_tokens + got)
            if restoring:
                self.host.release(state.request_id)
                self.restores += 1
                plan.restored.append(state)
            admitted.append(state)
            if in_progress is not None:
                in_progress.update(self._pending_hashes(state, state.num_computed_tokens + got))
            if state.scheduled_at is None:
                state.scheduled_at = time.time()
                state.cached_tokens = state.num_computed_tokens  # prefix-cache hits, if any
            state.status = RequestStatus.PREFILLING
            self.running[state.request_id] = state
            plan.chunks.append(ScheduledChunk(state, got))
            scheduled.add(state.request_id)
            tokens_left -= got
        if admitted:
            taken = {id(s) for s in admitted}
            self.waiting = deque(s for s in self.waiting if id(s) not in taken)
        return plan

    def _draft(self, state: RequestState, tokens_left: int) -> list[int]:
        """The request's proposals (speculative decoding) that fit this step: they count
        against the token budget, and take blocks only where they are free with a block to
        spare for every running request (never by preempting anyone); otherwise the request
        decodes one token as usual."""
        draft, state.draft_tokens = state.draft_tokens, []
        if not draft or state.remaining_tokens != 1:
            return []
        draft = draft[: tokens_left - 1]
        if not draft:
            return []
        bm, target = self.block_manager, state.num_computed_tokens + 1 + len(draft)
        # Leave a block per running request: proposals must not push anyone into preemption.
        need = bm.blocks_missing(state.request_id, target)
        if need and bm.num_free_blocks - need < len(self.running):
            return []
        return draft if bm.ensure(state.request_id, target) else []

    # -- in-burst prefix dedup ----------------------------------------------------------
    def _prompt_hashes(self, state: RequestState) -> list[int]:
        hashes = self._hashes.get(state.request_id)
        if hashes is None:
            hashes = self._hashes[state.request_id] = self.block_manager.block_hashes(state.prompt_ids, state.cache_salt)
        return hashes

    def _pending_hashes(self, state: RequestState, upto: int) -> list[int]:
        """Hashes of the request's prompt blocks that will be in the cache once its work up
        to `upto` tokens is done, but are not committed yet."""
        bs = self.block_manager.block_size
        return self._prompt_hashes(state)[state.committed_tokens // bs : upto // bs]

    def _blocks_in_progress(self) -> set[int]:
        """Prompt blocks that running requests compute now or have computed but not yet
        committed (async batching commits a step later)."""
        pending: set[int] = set()
        for state in self.running.values():
            if state.committed_tokens < len(state.prompt_ids) - 1:
                pending.update(self._pending_hashes(state, len(state.prompt_ids)))
        return pending

    def _prefix_in_progress(self, state: RequestState, in_progress: set[int]) -> bool:
        """True when the first prompt block this request would have to compute is one another
        request is computing, or when a prompt being computed shares at least
        PARTIAL_HOLD_TOKENS of that block's tokens (reused as a partial hit once it is in):
        one step of waiting is cheaper than computing them twice."""
        hashes = self._prompt_hashes(state)
        cached = self.block_manager.cached_blocks(state.prompt_ids, hashes)
        if cached < len(hashes) and hashes[cached] in in_progress:
            return True
        bs = self.block_manager.block_size
        start = cached * bs
        mine = state.prompt_ids[start : start + bs]
        if len(mine) <= PARTIAL_HOLD_TOKENS:  # too little left to gain from waiting
            return False
        for other in self.running.values():
            if other.cache_salt == state.cache_salt and other.committed_tokens < len(other.prompt_ids) \
                    and len(other.prompt_ids) > start + PARTIAL_HOLD_TOKENS \
                    and other.prompt_ids[:start] == state.prompt_ids[:start] \
                    and other.prompt_ids[start : start + PARTIAL_HOLD_TOKENS] == mine[:PARTIAL_HOLD_TOKENS]:
                return True
        return False

    def _grow_running(self, state: RequestState, want: int, scheduled: set[str], plan: StepPlan) -> int:
        """Get blocks for `want` tokens of a running request, preempting newer work if needed.

        Returns the tokens it may compute this step (a prefill may get a shorter chunk; 0
        means the request itself was soft reset to make room for older ones).
        """
        bm = self.block_manager
        target = state.num_computed_tokens + want
        while not bm.ensure(state.request_id, target):
            victim = next(
                (
                    s
                    for s in sorted(self.running.values(), key=lambda s: s.arrival, reverse=True)
                    if s.arrival > state.arrival and s.request_id not in scheduled
                ),
                None,
            )
            if victim is None:
                break
            self._preempt(victim, plan)
        else:
            return want
        room = bm.capacity_tokens(state.request_id) - state.num_computed_tokens
        if room > 0 and state.status == RequestStatus.PREFILLING:
            bm.ensure(state.request_id, state.num_computed_tokens + room)
            return room
        if len(self.running) > 1:
            self._preempt(state, plan)
        return 0


def _waits_for_sibling(state: RequestState) -> bool:
    """A sample of an n > 1 request waits until its first sibling has computed the prompt,
    so that it finds the prompt's blocks in the prefix cache instead of recomputing them."""
    leader = state.leader
    return (
        leader is not None
        and not leader.status.is_done
        and leader.committed_tokens < len(leader.prompt_ids)
    )


class FIFOScheduler(Scheduler):
    """Decodes first, then in-flight prefills, then new requests by arrival."""

    def _running_order(self, by_arrival: list[RequestState]) -> list[RequestState]:
        decodes = [s for s in by_arrival if s.status == RequestStatus.DECODING]
        prefills = [s for s in by_arrival if s.status != RequestStatus.DECODING]
        return decodes + prefills


class PrefillFirstScheduler(Scheduler):
    """Finishes in-flight chunked prefills before resuming decodes."""

    def _running_order(self, by_arrival: list[RequestState]) -> list[RequestState]:
        prefills = [s for s in by_arrival if s.status != RequestStatus.DECODING]
        decodes = [s for s in by_arrival if s.status == RequestStatus.DECODING]
        return prefills + decodes


SCHEDULER_MAPPING: dict[str, type[Scheduler]] = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler}
