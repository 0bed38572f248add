"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

Streaming is the only way to see time to first token and inter-token latency from outside.
Token counts come from the server's `usage` (asked for with `stream_options.include_usage`);
a server that sends none is counted one token per content chunk, and the result says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from .datasets import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first content
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    started: float = 0.0  # perf_counter at send
    usage_reported: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a single token)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # .../v1
    model: str
    chat: bool = False
    api_key: str | None = None
    ignore_eos: bool = False  # a vLLM extension: only sent when asked for
    temperature: float = 0.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/chat/completions" if self.chat else "/completions")

    def body(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "max_tokens": req.output_len, "temperature": self.temperature}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _content(chunk: dict, chat: bool) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if chat:
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: BenchRequest) -> RequestResult:
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = result.started = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", endpoint.url, json=endpoint.body(req), headers=endpoint.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                if _content(chunk, endpoint.chat):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
                    result.usage_reported = True
        result.e2e = time.perf_counter() - start
        if not result.usage_reported:
            result.output_tokens = chunks
        result.ok = chunks > 0 or result.output_tokens > 0
        if not result.ok:
            result.error = "no content came back"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
