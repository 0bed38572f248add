"""Running an accepted completion or chat request: one JSON body, or a stream of SSE chunks.

A request is submitted to the engine before any response starts, so every refusal (bad
parameters, context, queue full) still gets its proper status code. After that:
- non-streaming: outputs are gathered while a watcher waits for the client to disconnect; a
  disconnect cancels the engine requests at once, freeing their KV blocks;
- streaming: each engine output becomes at most one chunk per choice; if the client goes
  away, Starlette cancels the generator and its `finally` cancels the engine requests.

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
        finals = await self._collect(job, request)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        failed = next((o for o in finals.values() if o.status == RequestStatus.FAILED), None)
        if failed is not None:
            raise self._failure(failed)
        try:
            content = dumps(self._body(job, finals))
        except NonFiniteNumber as exc:
            raise _non_finite(job, exc) from None
        return Response(content, media_type="application/json")

    # -- non-streaming -------------------------------------------------------------------
    async def _collect(self, job: Job, request: Request) -> dict[tuple[int, int], GenerationOutput] | None:
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
                choices.append({"index": index, "message": {"role": "assistant", "content": out.text or ""},
                                "logprobs": lp, "finish_reason": reason})
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

    def _failure(self, out: GenerationOutput) -> APIError:
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
                    yield sse(self._failure(out).body())
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


def _non_finite(job: Job, exc: NonFiniteNumber) -> APIError:
    """A NaN in a response: logged once, answered as an OpenAI-shaped 500 (the engine's bug,
    not the client's), never sent as invalid JSON."""
    logger.error("request %s: %s; answered with an error", job.id, exc)
    return APIError(500, "the model produced a non-finite number (NaN) in this response, which JSON cannot carry",
                    code="non_finite_output")
