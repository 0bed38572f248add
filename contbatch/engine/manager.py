"""The long-lived engine: a background thread that steps the model while requests come and go.

Other threads talk to it only through thread-safe structures: an inbox queue for commands
(add, cancel, wake), a condition-guarded table of finished results, and one queue per
streaming request.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from ..attention.paged import attach, detach
from ..cache.block_manager import blocks_for
from ..cache.paged_cache import PagedAttentionCache
from ..config import ContinuousBatchingConfig, ResolvedConfig
from ..requests import GenerationOutput, RequestState, RequestStatus
from ..scheduling.scheduler import SCHEDULER_MAPPING, Scheduler
from .batch import build_batch
from .resolve import describe, resolve_config
from .runner import ModelRunner
from .stopping import StopDefaults, stop_defaults

logger = logging.getLogger("contbatch")

_IDLE_POLL_S = 0.05


class ContinuousBatchingManager:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config=None,
        config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.config = config or ContinuousBatchingConfig()
        self.defaults: StopDefaults = stop_defaults(model, generation_config)
        self.resolved_config: ResolvedConfig
        self.resolved_config, self._layout = resolve_config(self.config, model)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self.cache: PagedAttentionCache | None = None
        self.scheduler: Scheduler | None = None
        self._runner = ModelRunner(model)
        self._inbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._finished: OrderedDict[str, GenerationOutput] = OrderedDict()
        self._live: set[str] = set()  # submitted, not finished
        self._known: set[str] = set()  # submitted, result not yet retrieved
        self._streams: dict[str, queue.Queue] = {}
        self._host_kv: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # offloaded requests
        self._handlers: list[Callable[[GenerationOutput], None]] = []
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_mode: str | None = None  # None, "graceful", "hard"
        self._destroyed = False
        self._saved_attn: str | None = None
        self.steps = 0
        self.forward_seconds = 0.0
        self.step_seconds = 0.0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._destroyed:
            raise RuntimeError("this manager was destroyed; create a new one")
        if self.is_running():
            logger.warning("contbatch manager already running; start() ignored")
            return
        r = self.resolved_config
        if self.cache is None:
            self.cache = PagedAttentionCache(
                self._layout, r.num_blocks, r.block_size, r.device, r.prefix_sharing, r.prefix_cache_eviction
            )
        self.scheduler = SCHEDULER_MAPPING[r.scheduler_type](
            self.cache.block_manager, r.max_batch_tokens, r.max_requests_per_batch, r.safety_margin,
            r.cpu_offload_blocks,
        )
        self._host_kv.clear()
        self._attach_attention()
        logger.info(describe(r))
        self._stop_mode = None
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="contbatch-engine", daemon=True)
        self._thread.start()

    def stop(self, hard_stop: bool = False, timeout: float | None = None) -> None:
        """Graceful: finish everything submitted. Hard: fail what is not finished."""
        self._accepting = False
        if self._thread is None:
            return
        self._stop_mode = "hard" if hard_stop else (self._stop_mode or "graceful")
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("contbatch engine thread still running after %.1fs; forcing a hard stop", timeout or 0)
            self._stop_mode = "hard"
            self._thread.join()
        self._thread = None
        # Anything that slipped into the inbox as the thread exited still gets an answer.
        self._fail_all("manager stopped before the request was scheduled")
        self._detach_attention()

    def destroy(self) -> None:
        self.stop(hard_stop=True)
        self.cache = None
        self.scheduler = None
        self._destroyed = True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _attach_attention(self) -> None:
        self._saved_attn = attach(self.model)

    def _detach_attention(self) -> None:
        if self._saved_attn is not None:
            detach(self.model, self._saved_attn)
            self._saved_attn = None

    # -- submission (any thread) ---------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
    ) -> str:
        self._check_running()
        state = self._make_state(input_ids, request_id, max_new_tokens, streaming, eos_token_id)
        self._submit([state])
        return state.request_id

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Submit many at once: all validated before any is queued (all or nothing).

        With prefix sharing on, one request per distinct leading block goes first and the
        others follow grouped by prefix: the leaders compute the shared blocks, and the
        followers, admitted in later steps, find them cached. Returns ids in input order.
        """
        self._check_running()
        if request_ids is not None and len(request_ids) != len(inputs):
            raise ValueError(f"got {len(request_ids)} request ids for {len(inputs)} inputs")
        ids = request_ids or [None] * len(inputs)
        states = [self._make_state(x, rid, max_new_tokens, streaming, None) for x, rid in zip(inputs, ids)]
        dupes = len(states) - len({s.request_id for s in states})
        if dupes:
            raise ValueError(f"{dupes} duplicate request ids in one add_requests call")
        self._submit(self._prefix_order(states))
        return [s.request_id for s in states]

    def _prefix_order(self, states: list[RequestState]) -> list[RequestState]:
        if not self.resolved_config.prefix_sharing or len(states) < 2:
            return states
        bs = self.resolved_config.block_size
        leaders: list[RequestState] = []  # first of each prefix, and prompts too short to share
        seen: set[tuple[int, ...]] = set()
        followers: list[tuple[tuple[int, ...], int, RequestState]] = []
        for i, state in enumerate(states):
            key = tuple(state.prompt_ids[:bs])
            if len(state.prompt_ids) <= bs or key not in seen:
                seen.add(key)
                leaders.append(state)
            else:
                followers.append((key, i, state))
        followers.sort(key=lambda f: (f[0], f[1]))
        return leaders + [f[2] for f in followers]

    def _check_running(self) -> None:
        if not self._accepting or not self.is_running():
            raise RuntimeError("the manager is not running: call start() before adding requests")

    def _submit(self, states: list[RequestState]) -> None:
        with self._cond:
            for state in states:
                if state.request_id in self._known:
                    raise ValueError(
                        f"request id {state.request_id!r} is already in use (live, or its result not yet retrieved)"
                    )
            limit = self.resolved_config.max_queue_size
            if limit and len(self._live) + len(states) > limit:
                raise RuntimeError(
                    f"queue full: {len(self._live)} requests in flight, {len(states)} more would exceed "
                    f"max_queue_size={limit}"
                )
            for state in states:
                self._known.add(state.request_id)
                self._live.add(state.request_id)
                if state.streaming:
                    self._streams[state.request_id] = queue.Queue()
                state.arrival = next(self._arrivals)
                self._inbox.put(("add", state))

    def cancel_request(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def _make_state(self, input_ids, request_id, max_new_tokens, streaming, eos_token_id) -> RequestState:
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one input token")
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self._vocab_size}): {bad[:5]}")
        max_new = self.defaults.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        r = self.resolved_config
        total = len(prompt) + max_new
        if total > r.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) = {total} exceeds the model's "
                f"context of {r.max_context} tokens"
            )
        if blocks_for(total, r.block_size) > r.max_blocks_per_request:
            raise ValueError(
                f"request needs {blocks_for(total, r.block_size)} blocks of {r.block_size} tokens but "
                f"max_blocks_per_request={r.max_blocks_per_request} addresses "
                f"{r.max_blocks_per_request * r.block_size} tokens; raise max_blocks_per_request or pass workload hints"
            )
        if blocks_for(total, r.block_size) > r.num_blocks:
            raise ValueError(
                f"request needs {total} tokens of KV but the whole cache holds {r.num_blocks * r.block_size}; "
                "raise num_blocks"
            )
        if eos_token_id is None:
            eos = self.defaults.eos_token_ids
        else:
            eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        return RequestState(
            request_id=request_id if request_id is not None else f"req_{uuid.uuid4().hex[:12]}",
            prompt_ids=prompt,
            max_new_tokens=max_new,
            eos_token_ids=eos,
            max_context=r.max_context,
            streaming=streaming,
        )

    # -- results (any thread) ------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """With an id: wait for that request. Without: the next finished one. None on timeout."""
        with self._cond:
            if request_id is None:
                self._cond.wait_for(lambda: self._finished or not self._live, timeout)
                if not self._finished:
                    return None
                _, out = self._finished.popitem(last=False)
            else:
                if request_id not in self._known:
                    raise KeyError(f"unknown request id {request_id!r} (never submitted, or already retrieved)")
                if not self._cond.wait_for(lambda: request_id in self._finished, timeout):
                    return None
                out = self._finished.pop(request_id)
            self._known.discard(out.request_id)
            return out

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Finished results as they come, until nothing submitted is left unretrieved."""
        while True:
            out = self.get_result(timeout=_IDLE_POLL_S)
            if out is not None:
                yield out
            elif not self._live and not self._finished:
                return

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Incremental outputs of one request; the last one is final and is also retrieved."""
        stream = self._streams.get(request_id)
        if stream is None:
            out = self.get_result(request_id, timeout)
            if out is not None:
                yield out
            return
        while True:
            try:
                out = stream.get(timeout=timeout)
            except queue.Empty:
                return
            if out.is_finished:
                self._streams.pop(request_id, None)
                self.get_result(request_id, timeout=0)
                yield out
                return
            yield out

    def register_result_handler(self, callback: Callable[[GenerationOutput], None]) -> None:
        """Called from the engine thread with every streamed chunk and every final result."""
        self._handlers.append(callback)

    def _publish(self, state: RequestState) -> None:
        out = state.to_output()
        final = out.is_finished
        stream = self._streams.get(state.request_id)
        if stream is not None and (final or state.streaming):
            stream.put(out)
        if final:
            with self._cond:
                self._live.discard(state.request_id)
                self._finished[state.request_id] = out
                self._cond.notify_all()
        for handler in self._handlers:
            try:
                handler(out)
            except Exception:  # a user's callback must never stop the engine
                logger.exception("result handler failed")

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._drain_inbox(block=not self.scheduler.has_work())
                if self._stop_mode == "hard":
                    break
                if self._stop_mode == "graceful" and not self.scheduler.has_work() and self._inbox.empty():
                    break
                if self.scheduler.has_work():
                    self._step()
        except Exception as exc:  # a bug in the loop itself: fail everything, lose nothing
            logger.exception("contbatch engine loop crashed")
            self._fail_all(f"engine loop crashed: {exc!r}")
            return
        if self._stop_mode == "hard":
            self._fail_all("manager stopped (hard stop) before the request finished")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self.scheduler.add(payload)
            elif kind == "cancel":
                self._cancel(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str) -> None:
        self._host_kv.pop(request_id, None)
        state = self.scheduler.remove(request_id)
        if state is None:
            return  # already finished, or unknown: nothing to do
        state.finish(RequestStatus.CANCELLED, "cancelled")
        self._publish(state)

    def _fail_all(self, reason: str) -> None:
        pending = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                pending.append(payload)
        if self.scheduler is not None:
            pending += list(self.scheduler.waiting) + list(self.scheduler.running.values())
        self._host_kv.clear()
        for state in pending:
            if self.scheduler is not None:
                self.scheduler.remove(state.request_id)
            state.finish(RequestStatus.FAILED, "error", reason)
            self._publish(state)

    def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        # Offloaded blocks may already be promised to others: copy out before anything else.
        for off in plan.offloaded:
            keys, values = self.cache.copy_out(off.blocks, off.num_tokens)
            self._host_kv[off.state.request_id] = (keys, values, off.num_tokens)
        for state in plan.restored:
            keys, values, n = self._host_kv.pop(state.request_id)
            self.cache.copy_in(self.cache.block_manager.table(state.request_id), n, keys, values)
        if not plan.chunks:
            return
        try:
            inputs = build_batch(plan, self.cache)
            t1 = time.perf_counter()
            tokens = self._runner.run(inputs).tolist()
            self.forward_seconds += time.perf_counter() - t1
        except Exception as exc:
            logger.exception("step failed; failing its %d requests", len(plan.chunks))
            for chunk in plan.chunks:
                self._host_kv.pop(chunk.state.request_id, None)
                self.scheduler.remove(chunk.state.request_id)
                chunk.state.finish(RequestStatus.FAILED, "error", f"step failed: {exc!r}")
                self._publish(chunk.state)
            return
        block_manager = self.cache.block_manager
        for chunk in inputs.chunks:
            state = chunk.state
            state.num_computed_tokens += chunk.num_tokens
            block_manager.commit(state.request_id, state.all_token_ids, state.num_computed_tokens)
        for state, token in zip(inputs.sampled, tokens):
            state.append_token(token)
            if state.status.is_done:
                self.scheduler.finish(state)
            self._publish(state)
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for tests, logs and the server's metrics (read without locking: a
        snapshot may mix values from two consecutive steps)."""
        sched, cache = self.scheduler, self.cache
        bm = cache.block_manager if cache else None
        queries = bm.prefix_queries if bm else 0
        hits = bm.prefix_hits if bm else 0
        return {
            "steps": self.steps,
            "soft_resets": sched.soft_resets if sched else 0,
            "offloads": sched.offloads if sched else 0,
            "restores": sched.restores if sched else 0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "cached_blocks": bm.num_cached_blocks if bm else 0,
            "free_blocks": bm.num_free_blocks if bm else 0,
            "running": len(sched.running) if sched else 0,
            "waiting": len(sched.waiting) if sched else 0,
            "step_seconds": self.step_seconds,
            "forward_seconds": self.forward_seconds,
        }
