"""The bridge between the engine thread and the asyncio server.

The manager calls our result handler from its thread with every output. The handler does the
least it can there: it updates the latency metrics and hands the output to the event loop with
`call_soon_threadsafe`, onto the queue of the HTTP request it belongs to. No thread of the
server ever blocks on the engine, however many requests stream at once.

Every engine request ends with a final output (finished, cancelled or failed; the manager
guarantees it, even on a hard stop or a crash of its loop). When a request's last sample has
ended, its entry is dropped and what the manager kept for `get_result` is collected, whether
or not a client is still listening: a disconnected client leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ..engine.manager import ContinuousBatchingManager
from starlette.requests import Request

from ..requests import GenerationOutput
from ..sampling.compile_worker import GrammarTooSlow
from ..sampling.params import SamplingParams
from .errors import APIError
from .metrics import ServerMetrics

logger = logging.getLogger("contbatch.server")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Submission:
    """The engine requests of one HTTP request (one per prompt), and where their outputs land."""

    def __init__(self, loop: asyncio.AbstractEventLoop, id: str, request_ids: list[str], n: int):
        self.loop = loop
        self.id = id  # what the client sees: the engine ids are this, or this-<prompt index>
        self.request_ids = request_ids
        self.n = n
        self.queue: asyncio.Queue[tuple[int, GenerationOutput]] = asyncio.Queue()
        self.cached_tokens = [0] * len(request_ids)  # per prompt, set by the engine thread
        self.finals_seen = 0

    @property
    def done(self) -> bool:
        return self.finals_seen == len(self.request_ids) * self.n

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """(prompt index, output) as they come, until every sample of every prompt has ended."""
        while not self.done:
            item = await self.queue.get()
            if item[1].is_finished:
                self.finals_seen += 1
            yield item


@dataclass
class _Entry:
    """Engine-thread bookkeeping for one engine request (one prompt, n samples)."""

    submission: Submission
    prompt_index: int
    n: int
    last_token_at: list[float | None] = field(default_factory=list)
    finals: int = 0
    generated: int = 0
    reason: str | None = None

    def __post_init__(self) -> None:
        self.last_token_at = [None] * self.n


class AsyncEngine:
    """Submit, stream and cancel engine requests from asyncio code."""

    def __init__(self, manager: ContinuousBatchingManager, metrics: ServerMetrics | None = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self._live: dict[str, _Entry] = {}
        manager.register_result_handler(self._on_output)

    # -- event loop ----------------------------------------------------------------------
    def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], streaming: bool,
               prefix: str = "cmpl", adapter: str | None = None) -> Submission:
        """Queue every prompt at once (all or nothing), on LoRA `adapter` or the base model.
        Bad input -> 400, an adapter no longer loaded -> 404, queue full -> 429, engine not
        running -> 503."""
        loop = asyncio.get_running_loop()
        base = f"{prefix}-{uuid.uuid4().hex}"
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        n = params[0].n
        sub = Submission(loop, base, ids, n)
        for i, rid in enumerate(ids):  # before submitting: the first output may come at once
            self._live[rid] = _Entry(sub, i, n)
        try:
            if len(prompts) == 1:
                self.manager.add_request(prompts[0], request_id=ids[0], streaming=streaming, sampling_params=params[0],
                                         queue_chunks=False, adapter=adapter)
            else:
                self.manager.add_requests(prompts, streaming=streaming, request_ids=ids, sampling_params=list(params),
                                          queue_chunks=False, adapters=[adapter] * len(prompts))
        except KeyError as exc:  # unloaded since the body was checked
            self._forget(ids)
            raise APIError(404, f"The model `{adapter}` does not exist.", "model", "model_not_found") from exc
        except ValueError as exc:
            self._forget(ids)
            raise APIError(400, str(exc)) from exc
        except RuntimeError as exc:
            self._forget(ids)
            if str(exc).startswith("queue full"):
                raise APIError(429, f"{exc}; retry later", code="queue_full") from exc
            raise APIError(503, f"the engine is not accepting requests: {exc}", code="engine_unavailable") from exc
        return sub

    async def compile_grammars(self, params: Sequence[SamplingParams], request: Request, param: str) -> bool:
        """Wait until every structured-output spec of a request is compiled (most are cached
        at once), without holding any thread. A spec that does not compile, or not within the
        time budget, is a 400; a client that goes meanwhile abandons the compile (False)."""
        specs = {p.structured_output.key: p.structured_output for p in params if p.structured_output is not None}
        for spec in specs.values():
            try:
                future = self.manager.compile_grammar(spec)
            except ValueError as exc:
                raise APIError(400, str(exc), param) from exc
            loop = asyncio.get_running_loop()
            compiled = loop.create_future()  # not asyncio.wrap_future: cancelling it would cancel the shared compile
            future.add_done_callback(lambda f: loop.call_soon_threadsafe(
                lambda: compiled.done() or compiled.set_result(f.exception())))
            gone = asyncio.create_task(wait_disconnect(request))
            try:
                await asyncio.wait({compiled, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not compiled.done():
                self.manager.abandon_grammar(spec)
                return False
            error = compiled.result()
            if isinstance(error, GrammarTooSlow):
                raise APIError(400, str(error), param, "structured_output_too_complex")
            if error is not None:
                raise APIError(400, f"structured output: the grammar does not compile: {error}", param)
        return True

    def cancel(self, sub: Submission) -> None:
        """End every unfinished request of `sub` now; their blocks are freed by the engine."""
        for rid in sub.request_ids:
            if rid in self._live:
                self.manager.cancel_request(rid)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def _forget(self, ids: list[str]) -> None:
        for rid in ids:
            self._live.pop(rid, None)

    def _finalize(self, request_id: str) -> None:
        """Drop the entry and collect what the manager keeps for `get_result` (non-blocking:
        the final output is already there when this runs)."""
        self._live.pop(request_id, None)
        try:
            self.manager.get_result(request_id, timeout=0)
        except KeyError:
            pass  # already collected

    # -- engine thread -------------------------------------------------------------------
    def _on_output(self, out: GenerationOutput) -> None:
        entry = self._live.get(out.request_id)
        if entry is None:
            return
        sub = entry.submission
        now = time.time()
        self._observe(entry, out, now)
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, (entry.prompt_index, out))
            if out.is_finished:
                entry.finals += 1
                if entry.finals == entry.n:
                    sub.loop.call_soon_threadsafe(self._finalize, out.request_id)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody listens
            self._live.pop(out.request_id, None)

    def _observe(self, entry: _Entry, out: GenerationOutput, now: float) -> None:
        m = self.metrics
        k = len(out.new_tokens)
        i = out.index
        if entry.last_token_at[i] is None and out.first_token_at is not None:
            if i == 0:
                cached = out.cached_tokens
                entry.submission.cached_tokens[entry.prompt_index] = cached
                if m is not None:
                    m.ttft.observe(max(0.0, out.first_token_at - out.queued_at))
                    m.prompt_tokens.inc(len(out.prompt_ids))
                    m.cached_tokens.inc(cached)
                    if out.scheduled_at is not None:
                        m.queue.observe(max(0.0, out.scheduled_at - out.queued_at))
                        m.prefill.observe(max(0.0, out.first_token_at - out.scheduled_at))
            entry.last_token_at[i] = out.first_token_at
            k -= 1  # the first token's latency is TTFT, not an inter-token gap
        elif k and entry.last_token_at[i] is not None and m is not None:
            gap = (now - entry.last_token_at[i]) / k
            for _ in range(k):
                m.itl.observe(gap)
        if len(out.new_tokens):
            entry.last_token_at[i] = now
            entry.generated += len(out.new_tokens)
            if m is not None:
                m.generation_tokens.inc(len(out.new_tokens))
        if out.is_finished:
            if entry.reason is None or out.finish_reason in ("error", "cancelled"):  # the worst sample's
                entry.reason = out.finish_reason
            if entry.finals + 1 == entry.n and m is not None:
                end = out.finished_at or now
                m.request_ended(entry.reason, end - out.queued_at, len(out.prompt_ids), entry.generated)
                if out.first_token_at is not None:
                    m.decode.observe(max(0.0, end - out.first_token_at))
