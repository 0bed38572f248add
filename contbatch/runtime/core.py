"""The engine core: one step at a time, on the engine thread.

A step is: plan (scheduler), move offloaded KV (host tier), build the batch, launch it on the
runner, apply the previous step's tokens, sample, and apply this step's tokens. With async
batching the last apply waits for the next step: step N+1 is planned and launched before
step N's tokens are read; they reach N+1's inputs on the device (carry-over), and the host
applies them while N+1 computes. Without it, every step is applied at once.

Every request ends through `retire` (finished, cancelled, failed): its KV blocks are freed,
it leaves the host tier, and its final output is published. The manager owns the thread,
the inbox and the results; the core owns the scheduler, the cache, the host tier and the
runner, and is the only code that changes request state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..cache.offload import HostKVTier
from ..cache.paged_cache import KVLayout
from ..config import ResolvedConfig
from ..requests import RequestState, RequestStatus
from ..sampling.grammar import GrammarRejected, wait_for_grammars
from ..scheduling.scheduler import SCHEDULER_MAPPING, StepPlan
from .step_batch import build_step_batch
from .machinery import build_machinery
from .proposer import Proposer
from .step_runner import InFlight

logger = logging.getLogger("contbatch")

_NEG_INF = float("-inf")
_NON_FINITE = ("the model produced non-finite logits (NaN or inf) for this request; check its sampling parameters, "
               "the model's dtype and its weights")


class EngineCore:
    def __init__(self, model: torch.nn.Module, resolved: ResolvedConfig, layout: KVLayout,
                 publish: Callable[[RequestState], None]) -> None:
        r = resolved
        self.publish = publish  # hands a request's new output (or its end) to the manager
        machinery = build_machinery(model, resolved, layout, primary=True)
        self.cache = machinery.cache
        self.host = HostKVTier(self.cache, r.cpu_offload_blocks)
        self.scheduler = SCHEDULER_MAPPING[r.scheduler_type](
            self.cache.block_manager, r.max_batch_tokens, r.max_requests_per_batch, r.safety_margin, self.host,
            r.hold_shared_prefixes,
        )
        self.runner = machinery.runner  # a tensor-parallel driver wraps it (distributed/steps.py)
        self.async_batching = r.use_async_batching
        self.speculator: Proposer | None = None  # speculative decoding's, set by the manager
        self.speculation_error: str | None = None  # why speculation was turned off mid-run
        self.inflight: InFlight | None = None  # async: the step whose tokens are not applied yet
        self.steps = 0
        self.decode_only_steps = 0  # steps taken by the decode kernel, and their rows
        self.decode_only_rows = 0
        self.forward_seconds = 0.0
        self.step_seconds = 0.0
        self.weight_version = 0  # bumped by every weight update

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    # -- one step ------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        prev, step = self.inflight, None
        if self.speculator is not None:
            self._propose()
        plan = self.scheduler.schedule()
        self._check_grammars(plan, idle=prev is None)
        with self.runner.streams.on("compute"):  # after any in-flight step's writes, in stream order
            self._move_kv(plan)
        if plan.chunks:
            try:
                rows = {s.request_id: i for i, s in enumerate(prev.batch.sampled)} if prev else None
                step = self.runner.launch(build_step_batch(plan, self.cache.block_manager, rows), prev)
            except Exception as exc:
                self._fail_step([c.state for c in plan.chunks], exc)
            else:
                for chunk, computed in zip(step.batch.chunks, step.computed):
                    chunk.state.num_computed_tokens = computed  # the one place it advances
                step.token_index = [s.reserve_token() for s in step.batch.sampled]
        self.inflight = None
        if prev is not None:
            self._apply(prev)
        if step is not None:
            try:
                self.runner.sample(step)
            except Exception as exc:
                self._fail_step([c.state for c in step.batch.chunks], exc)
                step = None
        if step is not None:
            if self.async_batching:
                self.inflight = step
            else:
                self._apply(step)
        self.steps += 1 if plan.chunks else 0
        self.step_seconds += time.perf_counter() - t0

    def _propose(self) -> None:
        """Speculative proposals for this step. A proposer that fails (a draft model's step)
        must not fail requests that would run fine without it: speculation turns off, loudly."""
        try:
            self.speculator.propose(self.scheduler.running.values())
        except Exception as exc:
            logger.exception("speculative proposals failed; speculative decoding is off from now on")
            for state in self.scheduler.running.values():
                state.draft_tokens = []
            self.speculator.close()
            self.speculator = None
            self.speculation_error = repr(exc)

    def _check_grammars(self, plan: StepPlan, idle: bool) -> None:
        """Structured output: a request whose grammar failed to compile ends before it takes a
        row; with nothing to run at all, wait for a grammar being compiled, not spin."""
        failed = [c.state for c in plan.chunks if c.state.grammar is not None and c.state.grammar.error]
        for state in failed:
            self.retire(state, RequestStatus.FAILED, state.grammar.error)
        if failed:
            plan.chunks = [c for c in plan.chunks if not c.state.status.is_done]
        if idle and not plan.chunks:
            wait_for_grammars(self.scheduler.waiting, timeout=0.01)

    def _move_kv(self, plan: StepPlan) -> None:
        # Offloaded blocks may be promised to others: out first; then fresh blocks resident (cache/resident.py).
        for off in plan.offloaded:
            self.host.copy_out(off.state.request_id, off.blocks, off.num_tokens)
        self.cache.make_resident()
        copies = self.cache.block_manager.take_copies()  # partial prefix hits (block_manager.py)
        if copies:
            self.host.copy_prefix(copies)
        for state in plan.restored:
            self.host.copy_in(state.request_id, self.cache.block_manager.table(state.request_id))

    def _apply(self, step: InFlight) -> None:
        """Read a step's tokens and apply them: requests that ended meanwhile (a stop token
        seen in the step before, a cancel) are skipped; their rows were computed for nothing."""
        try:
            t1 = time.perf_counter()
            result = self.runner.wait(step)
            tokens = result.tokens.tolist()
            self.forward_seconds += time.perf_counter() - t1
        except Exception as exc:
            self._fail_step([c.state for c in step.batch.chunks], exc)
            return
        if step.shape.decode_only:
            self.decode_only_steps += 1
            self.decode_only_rows += step.batch.num_requests
        for chunk, computed in zip(step.batch.chunks, step.computed):
            state = chunk.state
            if not state.status.is_done:  # never past what is launched: a reset may have shrunk it
                self._cache_full_blocks(state, min(computed, state.num_computed_tokens))
        live = [not s.status.is_done for s in step.batch.sampled]
        if result.run_lengths is not None:  # speculative verification: runs of tokens
            self._apply_runs(step, result, live)
            return
        if result.logprobs is not None:
            _record_logprobs(step.batch.sampled, result, live)
        ok = result.ok.tolist() if result.ok is not None else live
        for state, index, token, alive, good in zip(step.batch.sampled, step.token_index, tokens, live, ok):
            if not alive:
                continue
            if not good:  # a numerical fault must not pass as a token: it fails this request alone
                self.retire(state, RequestStatus.FAILED, _NON_FINITE)
                continue
            if self._take_token(state, token, index):
                self._settle(state)

    def _take_token(self, state: RequestState, token: int, index: int | None = None) -> bool:
        """One new token: fill its reserved place (`index`) or append it, advance the grammar,
        stamp the weight version, check stop strings. Every path that applies tokens comes
        through here. False when the request failed on it (then it is retired already)."""
        if index is not None:
            state.set_token(index, token)
        else:
            state.append_token(token)
        if state.grammar is not None:
            try:
                if state.grammar.advance(token) and state.finish_reason != "stop":
                    state.finish(RequestStatus.FINISHED, "stop")  # the grammar has reached its end
            except GrammarRejected as exc:
                self.retire(state, RequestStatus.FAILED, str(exc))
                return False
        state.weight_version = self.weight_version
        if state.token_versions is not None:
            state.token_versions.append(self.weight_version)
        self._check_stop_strings(state)
        return True

    def _apply_runs(self, step: InFlight, result, live: list[bool]) -> None:
        """A verification step: each request takes its accepted proposals and the target's
        next token, one at a time, so that EOS, `max_new_tokens` and stop strings end it at
        the right token; the KV of rejected proposals is rolled back (never counted as
        computed, never committed to the prefix cache, their extra blocks freed)."""
        runs, lengths = result.run_tokens.tolist(), result.run_lengths.tolist()
        run_lps = result.run_logprobs.tolist() if result.run_logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        ok = result.ok.tolist()
        for i, (state, index) in enumerate(zip(step.batch.sampled, step.token_index)):
            if not live[i]:
                continue
            if not ok[i]:
                self.retire(state, RequestStatus.FAILED, _NON_FINITE)
                continue
            draft, run = step.batch.drafts[i], runs[i][: lengths[i]]
            applied, retired = 0, False
            for j, token in enumerate(run):
                if state.status.is_done:
                    break
                if state.logprobs is not None:
                    state.logprobs.append(run_lps[i][j])
                if state.top_logprobs is not None:  # only requests that never propose ask for these
                    state.top_logprobs.append(_top_entry(state, top_ids[i], top_lps[i]))
                if not self._take_token(state, token, index if j == 0 else None):
                    retired = True  # its grammar refused the token
                    break
                applied += 1
            if retired:
                continue
            if draft:
                if self.speculator is not None:
                    self.speculator.record(state, len(draft), len(run) - 1)
                if not state.status.is_done:
                    state.num_computed_tokens += applied - 1  # the accepted proposals' KV stays
                    self._cache_full_blocks(state, state.num_computed_tokens)
                    self.cache.block_manager.trim(state.request_id, state.num_computed_tokens + 1)
            self._settle(state)

    def _cache_full_blocks(self, state: RequestState, upto: int) -> None:
        """Publish the request's blocks completed within `upto` tokens to the prefix cache;
        most steps complete no block, and then there is nothing to hash."""
        bs = self.cache.block_size
        if state.stale_kv:
            return
        if upto // bs != state.committed_tokens // bs:
            self.cache.block_manager.commit(state.request_id, state.all_token_ids, upto, state.cache_salt)
        prompt = len(state.prompt_ids)
        if state.committed_tokens < prompt <= upto:  # the prompt is in: its partly filled block too
            self.cache.block_manager.commit_partial(state.request_id, state.all_token_ids, prompt, state.cache_salt)
        state.committed_tokens = upto

    def _settle(self, state: RequestState) -> None:
        """After a step's tokens: retire the request if they ended it, else stream it."""
        if state.status.is_done:
            self.retire(state)
        else:
            self.publish(state)

    def _check_stop_strings(self, state: RequestState) -> None:
        """Streamed text and stop strings after a new token; a stop string ends the request."""
        detok = state.detokenizer
        if detok is not None and not state.status.is_done and (state.streaming or detok.stop):
            try:
                state.delta_text += detok.update(state.known_tokens)
            except Exception as exc:  # the tokenizer failed on this request's text: it alone ends
                logger.exception("detokenizing %s failed", state.request_id)
                state.finish(RequestStatus.FAILED, "error", f"detokenizing the output failed: {exc!r}")
                return
            if detok.stopped:
                state.finish(RequestStatus.FINISHED, "stop")

    # -- weights -------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply the step in flight (async batching): afterwards no work is outstanding."""
        step, self.inflight = self.inflight, None
        if step is not None:
            self._apply(step)

    def weights_changed(self, inflight: str) -> dict:
        """The model's weights were replaced: bump the version, drop every cached prefix, and
        treat requests that already hold KV or tokens per `inflight` ("recompute": their KV
        is recomputed with the new weights; "keep": it stays, later tokens use the new
        weights; "abort": they end cancelled). The step in flight is applied first."""
        self.flush()
        old = self.weight_version
        self.weight_version += 1
        sched = self.scheduler
        started = [s for s in [*sched.running.values(), *sched.waiting] if s.num_computed_tokens or s.generated_tokens]
        for state in started:
            if state.token_versions is None:
                state.token_versions = [old] * len(state.known_tokens)
        if inflight == "abort":
            for state in started:
                self.retire(state, RequestStatus.CANCELLED,
                            f"cancelled: the weights were updated to version {self.weight_version} mid-request")
        elif inflight == "recompute":
            for state in started:
                sched.recompute(state)
        else:
            for state in started:
                state.stale_kv = True
        freed = self.cache.block_manager.reset_prefix_cache()
        return {"weight_version": self.weight_version, "requests": len(started), "freed_cached_blocks": freed}

    def reset_prefix_cache(self) -> int:
        self.flush()
        return self.cache.block_manager.reset_prefix_cache()

    # -- the one way out -------------------------------------------------------------------
    def retire(self, state: RequestState, status: RequestStatus | None = None, reason: str | None = None) -> None:
        """End a request wherever it is (queue, running set, host tier) and publish its final
        output. `status` None: it has finished by itself (its state says so already)."""
        if status is not None and not state.status.is_done:
            kind = {RequestStatus.FAILED: "error", RequestStatus.CANCELLED: "cancelled"}[status]
            state.finish(status, kind, reason)
        if state.status is not RequestStatus.FAILED and not state.stale_kv:
            # What it computed stays reusable token by token (the next turn of a chat).
            self.cache.block_manager.commit_partial(state.request_id, state.all_token_ids, state.committed_tokens,
                                                    state.cache_salt)
        self.scheduler.remove(state.request_id)
        if self.cache.recurrent is not None:
            self.cache.recurrent.release(state.request_id)
        if self.speculator is not None:
            self.speculator.forget(state.request_id)
        self.publish(state)

    def cancel(self, request_id: str) -> None:
        state = self.scheduler.find(request_id)
        if state is not None:  # else already finished, or unknown: nothing to do
            self.retire(state, RequestStatus.CANCELLED)

    def _fail_step(self, states: list[RequestState], exc: Exception) -> None:
        logger.exception("step failed; failing its %d requests", len(states))
        for state in states:
            if not state.status.is_done:
                self.retire(state, RequestStatus.FAILED, f"step failed: {exc!r}")

    def fail_all(self, reason: str, extra: list[RequestState] = ()) -> None:
        """Fail every request the core holds, and `extra` (not yet handed to it)."""
        self.inflight = None  # its requests are among those failed here
        for state in [*extra, *self.scheduler.waiting, *self.scheduler.running.values()]:
            self.retire(state, RequestStatus.FAILED, reason)
        self.host.clear()
        if self.cache.recurrent is not None:
            self.cache.recurrent.clear()

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        sched, bm, graphs = self.scheduler, self.cache.block_manager, self.runner.graphs
        queries, hits = bm.prefix_queries, bm.prefix_hits
        return {
            "steps": self.steps,
            "soft_resets": sched.soft_resets,
            "held_for_prefix": sched.held_for_prefix,
            "offloads": sched.offloads,
            "restores": sched.restores,
            "offloaded_blocks": self.host.used_blocks,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "cached_blocks": bm.num_cached_blocks,
            "free_blocks": bm.num_free_blocks,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "step_seconds": self.step_seconds,
            "forward_seconds": self.forward_seconds,
            "decode_only_steps": self.decode_only_steps,
            "decode_only_rows": self.decode_only_rows,
            "gpu_busy_seconds": self.runner.busy_seconds,
            "gpu_decode_seconds": self.runner.decode_seconds,
            "graph_captures": graphs.captures if graphs else 0,
            "graph_replays": graphs.replays if graphs else 0,
            "compiles": self.runner.compiles,
            "weight_version": self.weight_version,
            "graph_breaks": self.runner.graph_breaks,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **({"speculation_error": self.speculation_error} if self.speculation_error else {}),
        }


def _record_logprobs(states: list[RequestState], result, live: list[bool]) -> None:
    chosen = result.logprobs.tolist()
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    for i, state in enumerate(states):
        if not live[i]:
            continue
        if state.logprobs is not None:
            state.logprobs.append(chosen[i])
        if state.top_logprobs is not None:
            state.top_logprobs.append(_top_entry(state, top_ids[i], top_lps[i]))


def _top_entry(state: RequestState, ids: list[int], logprobs: list[float]) -> dict[int, float]:
    """The request's k most likely tokens; a token masked out (top-k/p, min-p, a grammar) has
    logprob -inf: it was never a candidate."""
    k = state.params.top_logprobs
    return {t: lp for t, lp in zip(ids[:k], logprobs[:k]) if lp != _NEG_INF}
