"""Running an accepted completion or chat request: one JSON body, or a stream of SSE chunks.

A request is submitted to the engine before any response starts, so every refusal (bad
parameters, context, queue full) still gets its proper status code. After that:
- non-streaming: outputs are gathered while a watcher waits for the client to disconnect; a
  disconnect cancels the engine requests at once, freeing their KV blocks;
- streaming: each engine output becomes at most one chunk per choice; if the client goes
  away, Starlette cancels the generator and its `finally` cancels the engine requests.

A chat request with tools has its output read for calls (`tools/stream.py`): `content` and
`tool_calls` in a body, `finish_reason` "tool_calls" when it ended with calls; streamed, text
and each call's start and argument fragments as deltas (one chunk each), as they are read.

Bodies and chunks are encoded strictly (`formatting.dumps`): a NaN becomes an OpenAI-shaped
500, or in a stream an error event before `[DONE]`, never invalid JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..requests import GenerationOutput, RequestStatus
from .async_engine import AsyncEngine, Submission, wait_disconnect
from .errors import APIError
from .formatting import (
    NonFiniteNumber,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    dumps,
    finish_reason,
    sse,
    usage,
)
from .prompts import Prompt
from .tools import ToolContext
from .tools.stream import CallArgs, CallStart, Text, ToolCall, parse_output

logger = logging.getLogger("contbatch.server")


@dataclass(kw_only=True)
class Job:
    """An accepted request, already in the engine."""

    chat: bool  # chat completions, else (legacy) completions
    sub: Submission
    model: str
    prompts: list[Prompt]
    n: int
    logprobs: bool  # completions: logprobs is not None; chat: logprobs is true (the k comes with the outputs)
    echo: bool = False
    include_usage: bool = False
    tools: ToolContext | None = None  # chat: the output is read for these tools' calls
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return self.sub.id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def echo_text(self, prompt_index: int) -> str:
        return self.prompts[prompt_index].text if self.echo else ""


class ResponseWriter:
    """Turns engine outputs into OpenAI responses (one JSON body, or SSE chunks) for one app."""

    def __init__(self, engine: AsyncEngine, tokenizer, draining: Callable[[], bool]) -> None:
        self.engine = engine
        self.text_of = TokenText(tokenizer)
        self._draining = draining

    async def respond(self, job: Job, request: Request, stream: bool) -> Response:
        if stream:
            return StreamingResponse(
                self._stream(job), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        finals = await self.collect(job, request)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        failed = next((o for o in finals.values() if o.status == RequestStatus.FAILED), None)
        if failed is not None:
            raise self.failure(failed)
        try:
            content = dumps(self._body(job, finals))
        except NonFiniteNumber as exc:
            raise _non_finite(job, exc) from None
        return Response(content, media_type="application/json")

    # -- non-streaming -------------------------------------------------------------------
    async def collect(self, job: Job, request: Request) -> dict[tuple[int, int], GenerationOutput] | None:
        """Every final output, keyed (prompt index, sample index); None if the client went away
        first (its requests are cancelled)."""
        finals: dict[tuple[int, int], GenerationOutput] = {}

        async def gather() -> None:
            async for p, out in job.sub.outputs():
                if out.is_finished:
                    finals[(p, out.index)] = out

        gathering = asyncio.create_task(gather())
        watching = asyncio.create_task(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({gathering, watching}, return_when=asyncio.FIRST_COMPLETED)
            if gathering not in done:
                return None
            gathering.result()
            return finals
        finally:
            for task in (gathering, watching):
                task.cancel()
            if not job.sub.done:  # disconnected, or this handler was cancelled
                self.engine.cancel(job.sub)

    def _body(self, job: Job, finals: dict[tuple[int, int], GenerationOutput]) -> dict:
        choices = []
        for (p, i), out in sorted(finals.items()):
            index = p * job.n + i
            reason = finish_reason(out.finish_reason)
            if job.chat:
                lp = chat_logprobs(self.text_of, out.generated_tokens, out.logprobs or [], out.top_logprobs) \
                    if job.logprobs else None
                message = {"role": "assistant", "content": out.text or ""}
                if job.tools is not None:
                    content, calls, failures = parse_output(job.tools.fmt, job.tools.names, out.text or "", job.id,
                                                            job.tools.end_tokens)
                    self._count_calls(len(calls), failures)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call_dict(c) for c in calls]
                        reason = "tool_calls" if reason == "stop" else reason
                choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                echo = job.echo_text(p)
                lp = completion_logprobs(self.text_of, out.generated_tokens, out.logprobs or [], out.top_logprobs,
                                         len(echo)) if job.logprobs else None
                choices.append({"index": index, "text": echo + (out.text or ""), "logprobs": lp,
                                "finish_reason": reason})
        generated = sum(len(o.generated_tokens) for o in finals.values())
        return {
            "id": job.id, "object": job.object, "created": job.created, "model": job.model,
            "choices": choices, "usage": self._usage(job, generated),
        }

    def _usage(self, job: Job, generated: int) -> dict:
        return usage(sum(len(p.token_ids) for p in job.prompts), generated, sum(job.sub.cached_tokens))

    def _count_calls(self, calls: int, failures: int) -> None:
        metrics = self.engine.metrics
        if metrics is not None:
            metrics.tool_calls_returned(calls, failures)

    def non_finite(self, job: Job, exc: NonFiniteNumber) -> APIError:
        return _non_finite(job, exc)

    def failure(self, out: GenerationOutput) -> APIError:
        if self._draining():
            return APIError(503, f"the server is shutting down: {out.error}", code="server_shutting_down")
        return APIError(500, f"generation failed: {out.error}", code="generation_failed")

    # -- streaming -----------------------------------------------------------------------
    async def _stream(self, job: Job) -> AsyncIterator[str]:
        chunk_object = "chat.completion.chunk" if job.chat else "text_completion"
        extra = {"usage": None} if job.include_usage else {}
        generated = 0
        started: set[int] = set()  # choices that sent their echo
        offsets: dict[int, int] = {}  # completions: text offset of each choice's next token
        parsers = {}  # chat with tools: each choice's tool-call parser

        def chunk(choice: dict) -> str:
            return sse({"id": job.id, "object": chunk_object, "created": job.created, "model": job.model,
                        "choices": [choice], **extra})

        try:
            if job.chat:  # the role first, for every choice, as OpenAI does
                for index in range(len(job.prompts) * job.n):
                    yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            async for p, out in job.sub.outputs():
                if out.status == RequestStatus.FAILED:
                    yield sse(self.failure(out).body())
                    break
                index = p * job.n + out.index
                k = len(out.new_tokens)
                generated += k
                text = out.delta_text
                if not job.chat and index not in started:
                    started.add(index)
                    text = job.echo_text(p) + text
                    offsets[index] = len(job.echo_text(p))
                lp = None
                if job.logprobs and k:
                    top = out.top_logprobs[-k:] if out.top_logprobs else None
                    chosen = (out.logprobs or [])[-k:]
                    if job.chat:
                        lp = chat_logprobs(self.text_of, out.new_tokens, chosen, top)
                    else:
                        lp = completion_logprobs(self.text_of, out.new_tokens, chosen, top, offsets[index])
                        offsets[index] += sum(len(t) for t in lp["tokens"])
                reason = finish_reason(out.finish_reason) if out.is_finished else None
                if job.chat and job.tools is not None:
                    parser = parsers.setdefault(index, job.tools.stream(job.id))
                    deltas = chat_deltas(parser.feed(text, out.is_finished))
                    if out.is_finished:
                        self._count_calls(len(parser.calls), parser.failures)
                        reason = "tool_calls" if parser.calls and reason == "stop" else reason
                    if not deltas and (lp is not None or reason is not None):
                        deltas = [{}]
                    for j, delta in enumerate(deltas):
                        yield chunk({"index": index, "delta": delta, "logprobs": lp if j == 0 else None,
                                     "finish_reason": reason if j == len(deltas) - 1 else None})
                    continue
                if not text and lp is None and reason is None:
                    continue  # text held back (a split character, a possible stop string)
                if job.chat:
                    delta = {"content": text} if text else {}
                    yield chunk({"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason})
                else:
                    yield chunk({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
            else:
                if job.include_usage:
                    yield sse({"id": job.id, "object": chunk_object, "created": job.created, "model": job.model,
                               "choices": [], "usage": self._usage(job, generated)})
            yield sse("[DONE]")
        except NonFiniteNumber as exc:  # an error event instead of invalid JSON, then the end
            yield sse(_non_finite(job, exc).body())
            yield sse("[DONE]")
        finally:  # finished, failed, or the client went away (Starlette cancels us)
            if not job.sub.done:
                self.engine.cancel(job.sub)


def call_dict(call: ToolCall) -> dict:
    """A tool call in a chat message."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_deltas(events: list) -> list[dict]:
    """Parser events as chat stream deltas: text as `content`, a call's start (index, id, name)
    and each fragment of its arguments as `tool_calls` entries, as the `openai` client assembles
    them."""
    deltas: list[dict] = []
    for event in events:
        if isinstance(event, Text):
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, CallStart):
            deltas.append({"tool_calls": [{"index": event.index, "id": event.call.id, "type": "function",
                                           "function": {"name": event.call.name, "arguments": ""}}]})
        elif isinstance(event, CallArgs):
            last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
            if last is not None and last["index"] == event.index and "id" not in last:
                last["function"]["arguments"] += event.delta
            else:
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]})
    return deltas


def _non_finite(job: Job, exc: NonFiniteNumber) -> APIError:
    """A NaN in a response: logged once, answered as an OpenAI-shaped 500 (the engine's bug,
    not the client's), never sent as invalid JSON."""
    logger.error("request %s: %s; answered with an error", job.id, exc)
    return APIError(500, "the model produced a non-finite number (NaN) in this response, which JSON cannot carry",
                    code="non_finite_output")
