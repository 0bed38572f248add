"""How one engine step runs, on either layout; mixed into `ContinuousBatchingManager`.

The torch path (`_step`) plans, builds, runs and applies a step in one go. The flat path
(`_step_flat`, the GPU layout) splits a step into launch, sample and finish, so that with
async batching the next step is planned and launched before this one's tokens are read.
Everything here runs on the engine thread.
"""

from __future__ import annotations

import logging
import time

from ..requests import RequestState, RequestStatus
from .batch import build_batch
from .flat_batch import build_flat_batch
from .flat_runner import InFlight

logger = logging.getLogger("contbatch")

_NEG_INF = float("-inf")


class StepsMixin:
    def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._move_kv(plan)
        if not plan.chunks:
            return
        try:
            inputs = build_batch(plan, self.cache)
            t1 = time.perf_counter()
            result = self._runner.run(inputs)
            tokens = result.tokens.tolist()
            self.forward_seconds += time.perf_counter() - t1
        except Exception as exc:
            self._fail_chunks([c.state for c in plan.chunks], exc)
            return
        for chunk in inputs.chunks:
            state = chunk.state
            state.num_computed_tokens += chunk.num_tokens
            self._commit(state, state.num_computed_tokens)
        self._record_logprobs(inputs.sampled, result)
        indices = [s.reserve_token() for s in inputs.sampled]
        self._apply_tokens(inputs.sampled, indices, tokens, result.ok)
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0

    def _commit(self, state: RequestState, upto: int) -> None:
        """Publish the request's blocks completed within `upto` tokens to the prefix cache;
        most steps complete no block, and then there is nothing to hash."""
        bs = self.cache.block_size
        if upto // bs != state.committed_tokens // bs:
            self.cache.block_manager.commit(state.request_id, state.all_token_ids, upto)
        state.committed_tokens = upto

    def _move_kv(self, plan) -> None:
        # Offloaded blocks may already be promised to others: copy out before anything else.
        for off in plan.offloaded:
            keys, values = self.cache.copy_out(off.blocks, off.num_tokens)
            self._host_kv[off.state.request_id] = (keys, values, off.num_tokens)
        for state in plan.restored:
            keys, values, n = self._host_kv.pop(state.request_id)
            self.cache.copy_in(self.cache.block_manager.table(state.request_id), n, keys, values)

    def _apply_tokens(self, states: list[RequestState], indices: list[int], tokens: list[int], ok) -> None:
        """Fill each request's reserved place with its token; a row whose logits were not
        finite fails its request alone (a numerical fault must not pass as a token)."""
        ok = ok.tolist() if ok is not None else [True] * len(states)
        for state, index, token, good in zip(states, indices, tokens, ok):
            if state.status.is_done:  # ended while its step was in flight (async): nothing to apply
                continue
            if not good:
                self._fail(state, "the model produced non-finite logits (NaN or inf) for this request; "
                                  "check its sampling parameters, the model's dtype and its weights")
                continue
            state.set_token(index, token)
            self._after_token(state)

    def _after_token(self, state: RequestState) -> None:
        """Stop strings, then retire or stream the request."""
        detok = state.detokenizer
        if detok is not None and not state.status.is_done and (state.streaming or detok.stop):
            try:
                state.delta_text += detok.update(state.known_tokens)
            except Exception as exc:  # the tokenizer failed on this request's text: it alone ends
                logger.exception("detokenizing %s failed", state.request_id)
                self._fail(state, f"detokenizing the output failed: {exc!r}")
                return
            if detok.stopped:
                state.finish(RequestStatus.FINISHED, "stop")
        if state.status.is_done:
            self._host_kv.pop(state.request_id, None)
            self.scheduler.finish(state)
        self._publish(state)

    def _step_flat(self) -> None:
        """One step of the GPU layout. With async batching, step N+1 is planned and launched
        before step N's tokens are read: they reach N+1's inputs on the device (carry-over),
        and the host applies them while N+1 computes."""
        t0 = time.perf_counter()
        prev, step = self._inflight, None
        plan = self.scheduler.schedule()
        with self._flat.streams.on("compute"):  # after any in-flight step's writes, in stream order
            self._move_kv(plan)
        if plan.chunks:
            try:
                rows = {s.request_id: i for i, s in enumerate(prev.batch.sampled)} if prev else None
                tables = [self.cache.block_manager.table(c.state.request_id) for c in plan.chunks]
                step = self._flat.launch(build_flat_batch(plan, tables, self.cache.block_size, rows), prev)
            except Exception as exc:
                self._fail_chunks([c.state for c in plan.chunks], exc)
            else:
                for chunk, computed in zip(step.batch.chunks, step.computed):
                    chunk.state.num_computed_tokens = computed
                step.token_index = [s.reserve_token() for s in step.batch.sampled]
        self._inflight = None
        if prev is not None:
            self._finish_flat(prev)
        if step is not None:
            try:
                self._flat.sample(step)
            except Exception as exc:
                self._fail_chunks([c.state for c in step.batch.chunks], exc)
                step = None
        if step is not None:
            if self.resolved_config.use_async_batching:
                self._inflight = step
            else:
                self._finish_flat(step)
        self.steps += 1 if plan.chunks else 0
        self.step_seconds += time.perf_counter() - t0

    def _finish_flat(self, step: InFlight) -> None:
        """Read a step's tokens and apply them: requests that ended meanwhile (a stop token
        seen in the step before, a cancel) are skipped; their rows were computed for nothing."""
        try:
            t1 = time.perf_counter()
            result = self._flat.wait(step)
            tokens = result.tokens.tolist()
            self.forward_seconds += time.perf_counter() - t1
        except Exception as exc:
            self._fail_chunks([c.state for c in step.batch.chunks], exc)
            return
        if step.shape.decode_only:
            self.decode_only_steps += 1
            self.decode_only_rows += step.batch.num_requests
        for chunk, computed in zip(step.batch.chunks, step.computed):
            state = chunk.state
            if not state.status.is_done:  # never past what is launched: a reset may have shrunk it
                self._commit(state, min(computed, state.num_computed_tokens))
        if result.logprobs is not None:
            self._record_logprobs(step.batch.sampled, result, [not s.status.is_done for s in step.batch.sampled])
        self._apply_tokens(step.batch.sampled, step.token_index, tokens, result.ok)

    def _fail_chunks(self, states: list[RequestState], exc: Exception) -> None:
        logger.exception("step failed; failing its %d requests", len(states))
        for state in states:
            if not state.status.is_done:
                self._fail(state, f"step failed: {exc!r}")

    def _fail(self, state: RequestState, reason: str) -> None:
        """End a request as FAILED wherever it is: queue, running set or host tier."""
        self._host_kv.pop(state.request_id, None)
        if self.scheduler is not None:
            self.scheduler.remove(state.request_id)
        state.finish(RequestStatus.FAILED, "error", reason)
        self._publish(state)

    @staticmethod
    def _record_logprobs(states: list[RequestState], result, live: list[bool] | None = None) -> None:
        if result.logprobs is None:
            return
        chosen = result.logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for i, state in enumerate(states):
            if live is not None and not live[i]:
                continue
            if state.logprobs is not None:
                state.logprobs.append(chosen[i])
            if state.top_logprobs is not None:
                k = state.params.top_logprobs
                # A token masked out (top-k/p, min-p) has logprob -inf: it was never a candidate.
                state.top_logprobs.append({t: lp for t, lp in zip(top_ids[i][:k], top_lps[i][:k]) if lp != _NEG_INF})
