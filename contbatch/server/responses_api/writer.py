"""Running an accepted Responses request: one response object, or its stream of events.

The same lifecycle as chat completions (`responses.ResponseWriter`, whose `collect` and
`failure` this reuses): submitted before anything is sent, cancelled in the engine when the
client goes away (non-streaming: a watcher; streaming: the generator's `finally`). A stream is
`response.created`, `response.in_progress`, the output's item, part, text and argument events
(`objects.OutputBuilder`), and `response.completed` (or `response.incomplete` at the token
limit, `response.failed` if generation failed), each a server-sent event named by its type
with a `sequence_number`. A finished response with `store` is kept (`store.py`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...requests import GenerationOutput, RequestStatus
from ..async_engine import Submission
from ..formatting import NonFiniteNumber, chat_logprobs, dumps
from ..metrics import ServerMetrics
from ..responses import Job, ResponseWriter
from ..tools.stream import Text, parse_output
from .objects import OutputBuilder, response_object, usage
from .prepare import PreparedResponse
from .store import ResponseStore


class ResponsesWriter:
    def __init__(self, base: ResponseWriter, store: ResponseStore, metrics: ServerMetrics | None, model: str) -> None:
        self.base = base
        self.store = store
        self.metrics = metrics
        self.model = model

    async def respond(self, work: PreparedResponse, sub: Submission, request: Request) -> Response:
        response_id = "resp_" + sub.id.partition("-")[2]
        job = Job(chat=True, sub=sub, model=self.model, prompts=[work.prompt], n=1, logprobs=work.logprobs)
        if work.req.stream:
            return StreamingResponse(self._stream(response_id, work, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await self.base.collect(job, request)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = finals[(0, 0)]
        if out.status == RequestStatus.FAILED:
            raise self.base.failure(out)
        builder = OutputBuilder()
        lp = self._logprobs(out.generated_tokens, out.logprobs, out.top_logprobs) if work.logprobs else None
        if work.tools is not None:
            content, calls, failures = parse_output(work.tools.fmt, work.tools.names, out.text or "", response_id,
                                                    work.tools.end_tokens)
            self._count(len(calls), failures)
        else:
            content, calls = out.text or "", []
        if content:
            builder.text(content, lp)
        for index, call in enumerate(calls):
            builder.call_start(index, call)
            builder.call_args(index, call.arguments)
            builder.call_end(index, call)
        response = self._finish(response_id, work, job, builder, out)
        try:
            body = dumps(response)
        except NonFiniteNumber as exc:
            raise self.base.non_finite(job, exc) from None
        self._keep(work, response, builder, len(body))
        return Response(body, media_type="application/json")

    def _finish(self, response_id: str, work: PreparedResponse, job: Job, builder: OutputBuilder,
                out: GenerationOutput) -> dict:
        """The finished response object (its open message closed)."""
        status = "incomplete" if out.finish_reason == "length" else "completed"
        builder.close_message(status)
        used = usage(len(work.prompt.token_ids), len(out.generated_tokens), job.sub.cached_tokens[0])
        return response_object(response_id, work, self.model, job.created, status, builder.items, used)

    def _keep(self, work: PreparedResponse, response: dict, builder: OutputBuilder, sent: int) -> None:
        """Store a response that was sent (so it is valid JSON: `sent` characters of it), with
        its conversation."""
        if work.req.store:
            self.store.put(response, [*work.history, builder.history_row()], work.history_bytes + sent)

    async def _stream(self, response_id: str, work: PreparedResponse, job: Job):
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n"

        parser = work.tools.stream(response_id) if work.tools is not None else None
        builder = OutputBuilder()
        pending: list[dict] = []  # logprobs of tokens whose text is still held back
        try:
            start = response_object(response_id, work, self.model, job.created, "in_progress", [])
            yield event({"type": "response.created", "response": start})
            yield event({"type": "response.in_progress", "response": start})
            async for _, out in job.sub.outputs():
                if out.status == RequestStatus.FAILED:
                    error = self.base.failure(out)
                    failed = response_object(response_id, work, self.model, job.created, "failed", builder.items,
                                             error={"code": error.code, "message": error.message})
                    yield event({"type": "response.failed", "response": failed})
                    break
                k = len(out.new_tokens)
                if work.logprobs and k:
                    pending.extend(self._logprobs(out.new_tokens, (out.logprobs or [])[-k:],
                                                  out.top_logprobs[-k:] if out.top_logprobs else None))
                if parser is not None:
                    events = parser.feed(out.delta_text, out.is_finished)
                else:
                    events = [Text(out.delta_text)] if out.delta_text else []
                for ev in events:
                    lp = None
                    if isinstance(ev, Text):
                        lp, pending = pending, []
                    for payload in builder.apply(ev, lp):
                        yield event(payload)
                if out.is_finished:
                    if parser is not None:
                        self._count(len(parser.calls), parser.failures)
                    status = "incomplete" if out.finish_reason == "length" else "completed"
                    for payload in builder.close_message(status, pending):
                        yield event(payload)
                    response = self._finish(response_id, work, job, builder, out)
                    last = event({"type": f"response.{status}", "response": response})
                    self._keep(work, response, builder, len(last))
                    yield last
        except NonFiniteNumber as exc:
            error = self.base.non_finite(job, exc)
            yield event({"type": "error", "code": error.code, "message": error.message, "param": None})
        finally:  # finished, failed, or the client went away (Starlette cancels us)
            if not job.sub.done:
                self.base.engine.cancel(job.sub)

    def _logprobs(self, tokens: list[int], logprobs, top) -> list[dict]:
        return chat_logprobs(self.base.text_of, tokens, logprobs or [], top)["content"]

    def _count(self, calls: int, failures: int) -> None:
        if self.metrics is not None:
            self.metrics.tool_calls_returned(calls, failures)
