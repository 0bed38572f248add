"""Checking what came back to the soak's clients.

A 200 JSON body must be well formed for its request (object, choice indices, finish reasons,
usage, logprobs lengths, no stop string in the text); a stream must be a complete SSE body
ending with `data: [DONE]`, an error event (if any) right before it; a raw socket's answer
must be a complete HTTP response (content-length or a terminated chunked body). Anything
else is `bad`, or `lost` when the answer is incomplete.
"""

from __future__ import annotations

import collections
import json

from soak_outcomes import Outcome, clip, error_outcome
from soak_requests import Job


def check_body(job: Job, data) -> str | None:
    """The problem with a 200 JSON body, or None."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return f"no choices in {data!r}"
    want_object = "chat.completion" if job.chat else "text_completion"
    if data.get("object") != want_object:
        return f"object {data.get('object')!r} != {want_object!r}"
    choices = data["choices"]
    if sorted(c.get("index") for c in choices) != list(range(job.choices)):
        return f"choice indices {[c.get('index') for c in choices]} for {job.choices} choices"
    usage = data.get("usage") or {}
    if not isinstance(usage.get("completion_tokens"), int):
        return f"no usage.completion_tokens: {usage}"
    for c in choices:
        reason = c.get("finish_reason")
        if reason not in ("stop", "length"):
            return f"choice {c.get('index')} finish_reason {reason!r}"
        text = c["message"]["content"] if job.chat else c.get("text")
        if not isinstance(text, str):
            return f"choice {c.get('index')} text {text!r}"
        if job.chat and c["message"].get("role") != "assistant":
            return f"role {c['message'].get('role')!r}"
        problem = check_text(job, text) or check_logprobs(job, c, reason)
        if problem:
            return f"choice {c.get('index')}: {problem}"
    return None

def check_text(job: Job, text: str) -> str | None:
    if job.body.get("echo"):
        return None
    hit = next((s for s in job.stops if s in text), None)
    if hit is not None:
        return f"stop string {hit!r} in the output {text!r}"
    return None

def check_logprobs(job: Job, c: dict, reason: str) -> str | None:
    lp = c.get("logprobs")
    wanted = job.body.get("logprobs")
    if wanted is None or wanted is False:
        return None if lp is None else f"logprobs {lp!r} not asked for"
    if not isinstance(lp, dict):
        return f"logprobs {lp!r}"
    if job.chat:
        content = lp.get("content") or []
        # Up to k alternatives: tokens masked by top_k/top_p (-inf) are left out by design
        # (contbatch/server/formatting.py), but the most likely one is never masked.
        k = job.body.get("top_logprobs") or 0
        lens = [len(t.get("top_logprobs") or []) for t in content]
        if any(not min(k, 1) <= n <= k for n in lens):
            return f"top_logprobs lengths {lens} outside [{min(k, 1)}, {k}]"
        n_tok = len(content)
    else:
        lens = {len(lp.get(key) or []) for key in ("tokens", "token_logprobs", "text_offset")}
        if len(lens) != 1:
            return f"logprobs lists of different lengths {lens}"
        n_tok = lens.pop()
    if reason == "length" and job.stream is False and n_tok != job.body["max_tokens"]:
        return f"finish_reason length after {n_tok} tokens, max_tokens={job.body['max_tokens']}"
    return None

def check_stream(job: Job, status: int, raw: str) -> Outcome:
    """A complete SSE body: chunks, maybe an error event, and `data: [DONE]` last."""
    events = [line[len("data:"):].strip() for line in raw.split("\n") if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return Outcome("lost", status, f"stream not ended by data: [DONE] ({len(events)} events); "
                                       f"tail {raw[-300:]!r}")
    texts: dict[int, str] = collections.defaultdict(str)
    reasons: dict[int, list] = collections.defaultdict(list)
    for i, ev in enumerate(events[:-1]):
        try:
            data = json.loads(ev)
        except ValueError:
            return Outcome("bad", status, f"event {i} is not JSON: {ev[:200]!r}")
        if "error" in data:
            if i != len(events) - 2:
                return Outcome("bad", status, f"error event {i} not last before [DONE]: {ev[:300]}")
            return error_outcome(200, data)
        for c in data.get("choices") or []:
            idx = c.get("index")
            if c.get("finish_reason") is not None:
                reasons[idx].append(c["finish_reason"])
            texts[idx] += (c.get("delta") or {}).get("content") or "" if job.chat else c.get("text") or ""
    if sorted(reasons) != list(range(job.choices)) or any(len(r) != 1 for r in reasons.values()):
        return Outcome("bad", status, f"finish reasons per choice {dict(reasons)} for {job.choices} choices")
    if any(r[0] not in ("stop", "length") for r in reasons.values()):
        return Outcome("bad", status, f"finish reasons {dict(reasons)}")
    if job.body.get("stream_options", {}).get("include_usage"):
        last = json.loads(events[-2])
        if last.get("choices") != [] or not isinstance((last.get("usage") or {}).get("completion_tokens"), int):
            return Outcome("bad", status, f"include_usage: last chunk {events[-2][:300]}")
    for idx, text in texts.items():
        problem = check_text(job, text)
        if problem:
            return Outcome("bad", status, f"choice {idx}: {problem}")
    return Outcome("ok", status)

def json_outcome(job: Job | None, status: int, raw: bytes, expected: frozenset[int] = frozenset()) -> Outcome:
    try:
        data = json.loads(raw)
    except ValueError:
        return Outcome("bad", status, f"body is not JSON: {raw[:300]!r}")
    if status == 200:
        if job is None:
            return Outcome("bad", status, f"200 where {sorted(expected)} was expected: {clip(data, 300)}")
        problem = check_body(job, data)
        return Outcome("bad", status, problem + f"; body {clip(data, 500)}") if problem else Outcome("ok", 200)
    return error_outcome(status, data, expected)

def parse_response(job: Job, raw: bytes) -> Outcome:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return Outcome("lost", None, f"incomplete HTTP response: {raw[:300]!r}")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Outcome("bad", None, f"bad status line {lines[0]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, complete = dechunk(body)
        if not complete:
            return Outcome("lost", status, f"chunked body not terminated; tail {body[-300:]!r}")
    elif "content-length" in headers and len(body) != int(headers["content-length"]):
        return Outcome("lost", status, f"body of {len(body)} bytes, content-length {headers['content-length']}")
    if status == 200 and job.stream:
        return check_stream(job, status, body.decode())
    return json_outcome(job, status, body)

def dechunk(body: bytes) -> tuple[bytes, bool]:
    out, i = [], 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return b"".join(out), False
        size = int(body[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out), True
        out.append(body[j + 2: j + 2 + size])
        i = j + 2 + size + 2

