"""Soak test of `contbatch serve`: a bounded, seeded, mixed load with faults injected, then a verdict.

The server runs in this process (the app of `contbatch.server.app.build_app` under uvicorn in a
background thread, on 127.0.0.1 and a free port) so that the engine can be inspected once the
load is over. A small KV cache and a small `max_queue_size` make KV pressure (soft resets,
offloads) and 429s part of the load. Concurrent asyncio clients (httpx) and raw-socket clients
send, at random with a fixed seed: streaming and non-streaming chat and completions, n > 1,
logprobs with top_p/top_k, stop strings, seeds, several prompts at once, cancels (a stream closed
early, a non-streaming request abandoned), killed connections (a raw socket closed mid-body or
mid-stream, some with a TCP reset), slow readers, malformed bodies and over-long prompts. Faults
are injected at random engine steps through `contbatch.faults` (forward, sampler, detokenizer,
and after a result handler ran).

At the end it checks, prints a JSON summary and exits 1 if any check fails:
- nothing lost: every request got a complete response or an OpenAI-shaped error (a stream ends
  with `data: [DONE]`, after an error event if it failed), and sent = every outcome counted;
- no bad response: no 500 (or error event) except those caused by an injected fault, no 4xx where
  a request was valid (429 queue_full aside), a 4xx for every malformed or over-long body;
- faults accounted for: requests failed by a fault name a site that fired, and sites that fired
  often failed some request;
- the engine idle and clean: no request running or waiting, every KV block free (cached prefix
  blocks count as free), no stream queue, pending result or sample group left in the manager's
  result store, no live entry in the server's AsyncEngine, no offloaded KV, gate in-flight 0;
- the engine alive: its thread still runs, and a greedy chat and a greedy streamed completion
  sent at the end (faults uninstalled) return the text they returned at the start;
- RSS growth after warm-up under `--rss-growth-mib`.

    .venv/bin/python benchmarks/soak.py                       # 10 minutes on the default model
    .venv/bin/python benchmarks/soak.py --duration 120 --results-md benchmarks/RESULTS.md
    .venv/bin/python benchmarks/soak.py --short               # ~30 s, tiny random model (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import gc
import json
import logging
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import uvicorn  # noqa: E402

import contbatch  # noqa: E402
from contbatch import faults  # noqa: E402
from contbatch.cache.paged_cache import KVLayout  # noqa: E402
from contbatch.server import ServerSettings, build_app  # noqa: E402

MODEL_NAME = "soak"
FAULT_RE = re.compile(r"injected fault at (\w+)")
ERROR_KEYS = {"message", "type", "param", "code"}
WORDS = ("the quick brown fox jumps over lazy dog river mountain city paper light stone music garden "
         "window market winter summer engine cloud number story ocean forest bridge table coffee planet "
         "signal yellow purple seven eleven hundred morning evening quiet sudden gentle bright").split()
STOPS = ("e", " the", "a", ".", "\n", "o", "in", ",")
SYSTEM = ("You are a careful assistant. Answer briefly and plainly, in one or two sentences, and never "
          "repeat the question back. ")
BASELINE_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BASELINE_PROMPT = "Once upon a time, in a land far away,"

# What each httpx client picks from, and how often; raw-socket clients pick from RAW_KINDS.
HTTP_KINDS = {
    "chat": 10, "chat_stream": 10, "completion": 10, "completion_stream": 10, "n_samples": 6,
    "logprobs": 6, "stop": 6, "seeded": 4, "multi_prompt": 4, "cancel_stream": 5, "cancel_nonstream": 3,
    "slow_reader": 3, "malformed": 6, "overlong": 3,
}
RAW_KINDS = {"raw_request": 3, "raw_kill_body": 2, "raw_kill_stream": 3, "raw_slow_reader": 2}


@dataclass
class Profile:
    """Defaults of one mode; every field can be overridden by its flag."""

    model: str
    duration: float
    clients: int
    raw_clients: int
    block_size: int
    num_blocks: int
    offload_blocks: int
    max_queue_size: int
    max_model_len: int
    max_tokens: int
    request_timeout: float
    warmup: float
    rss_growth_mib: float


PROFILES = {
    "full": Profile(model="default", duration=600, clients=8, raw_clients=2, block_size=16, num_blocks=24,
                    offload_blocks=6, max_queue_size=6, max_model_len=384, max_tokens=64, request_timeout=180,
                    warmup=30, rss_growth_mib=256),
    "short": Profile(model="tiny", duration=15, clients=6, raw_clients=2, block_size=16, num_blocks=16,
                     offload_blocks=4, max_queue_size=6, max_model_len=256, max_tokens=48, request_timeout=30,
                     warmup=5, rss_growth_mib=128),
}


# -- outcomes -------------------------------------------------------------------------------
@dataclass
class Outcome:
    verdict: str  # ok, clean_error, fault_error, aborted, bad, lost
    status: int | None = None  # HTTP status, None when none was read
    detail: str = ""
    site: str | None = None  # fault_error: where the fault was injected


class Ledger:
    """Every request sent and how it ended; the first examples of each problem, with evidence."""

    MAX_EXAMPLES = 25

    def __init__(self) -> None:
        self.sent = collections.Counter()
        self.kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.verdicts = collections.Counter()
        self.statuses = collections.Counter()
        self.fault_errors = collections.Counter()
        self.examples: list[dict] = []
        self.problem_counts = collections.Counter()

    def record(self, kind: str, out: Outcome, sent: dict | bytes | None) -> None:
        self.kinds[kind][out.verdict] += 1
        self.verdicts[out.verdict] += 1
        self.statuses["none" if out.status is None else str(out.status)] += 1
        if out.verdict == "fault_error":
            self.fault_errors[out.site or "?"] += 1
        if out.verdict in ("bad", "lost"):
            key = f"{kind}/{out.verdict}/{out.status}/{_shape(out.detail)}"
            self.problem_counts[key] += 1
            if self.problem_counts[key] <= 2 and len(self.examples) < self.MAX_EXAMPLES:
                self.examples.append({"kind": kind, "verdict": out.verdict, "status": out.status,
                                      "sent": _clip(sent if isinstance(sent, dict) else repr(sent), 600),
                                      "got": _clip(out.detail, 900)})


def _shape(detail: str) -> str:
    """A problem's detail without ids and numbers, to group the same problem."""
    return re.sub(r"[0-9a-f]{16,}|\d+", "#", detail)[:120]


def _clip(x, n: int) -> str:
    s = x if isinstance(x, str) else json.dumps(x)
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n} chars)"


def error_outcome(status: int, payload, expected: frozenset[int] = frozenset()) -> Outcome:
    """A non-200 answer (or a stream's error event, status 200): clean, caused by a fault, or bad."""
    text = _clip(payload if isinstance(payload, str) else json.dumps(payload), 900)
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS or not isinstance(err.get("message"), str):
        return Outcome("bad", status, f"not an OpenAI-shaped error: {text}")
    message = err["message"]
    if status in expected:
        return Outcome("clean_error", status, message)
    if (status, err.get("code")) in ((429, "queue_full"), (503, "server_busy")):  # "retry later"
        return Outcome("clean_error", status, message)
    fault = FAULT_RE.search(message)
    if fault and status in (200, 500) and "engine loop crashed" not in message:
        return Outcome("fault_error", status, message, fault.group(1))
    return Outcome("bad", status, f"unexpected error {status}: {text}")


# -- the load -------------------------------------------------------------------------------
@dataclass
class Job:
    """One generation request as sent, and what its answer must look like."""

    path: str
    body: dict
    choices: int  # n x prompts
    stream: bool

    @property
    def chat(self) -> bool:
        return self.path.endswith("chat/completions")

    @property
    def stops(self) -> list[str]:
        if self.body.get("include_stop_str_in_output"):
            return []
        stop = self.body.get("stop")
        return [stop] if isinstance(stop, str) else list(stop or [])


class Load:
    def __init__(self, args, url: str, tokenizer, limits_len: int) -> None:
        self.args = args
        self.url = url
        self.host, self.port = "127.0.0.1", int(url.rsplit(":", 1)[1])
        self.tok = tokenizer
        self.max_model_len = limits_len
        self.ledger = Ledger()
        self.stop = asyncio.Event()
        self.deadline = 0.0
        self.inflight = 0
        self.backoff: dict[int, float] = {}  # per client: the next wait after a "retry later"

    # -- what to send --------------------------------------------------------------------
    def words(self, rng: random.Random, lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def messages(self, rng: random.Random) -> list[dict]:
        msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []  # a shared prefix
        msgs.append({"role": "user", "content": self.words(rng, 3, 40)})
        if rng.random() < 0.2:
            msgs += [{"role": "assistant", "content": self.words(rng, 2, 10)},
                     {"role": "user", "content": self.words(rng, 2, 10)}]
        return msgs

    def prompt(self, rng: random.Random):
        r = rng.random()
        if r < 0.6:
            return (SYSTEM if rng.random() < 0.3 else "") + self.words(rng, 2, 60)
        return list(self.tok.encode(self.words(rng, 2, 50)))  # token ids

    def sampling(self, rng: random.Random, body: dict) -> None:
        body["max_tokens"] = rng.randint(1, self.args.max_tokens)
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.3, 1.3), 2)
        if rng.random() < 0.7:
            body["ignore_eos"] = True

    def job(self, kind: str, rng: random.Random) -> Job:
        chat = kind.startswith("chat") or (kind not in ("completion", "completion_stream", "multi_prompt")
                                           and rng.random() < 0.5)
        stream = kind.endswith("_stream") or kind in ("slow_reader", "raw_slow_reader", "raw_kill_stream") or (
            kind in ("n_samples", "logprobs", "stop", "seeded", "multi_prompt", "raw_request") and rng.random() < 0.5)
        if kind == "multi_prompt":
            chat = False
        body: dict = {"model": MODEL_NAME} if rng.random() < 0.7 else {}
        if chat:
            body["messages"] = self.messages(rng)
        else:
            body["prompt"] = self.prompt(rng)
            if kind == "multi_prompt":  # all strings or all token-id lists: the API takes no mix
                ids = isinstance(body["prompt"], list)
                body["prompt"] = [body["prompt"]] + [list(self.tok.encode(self.words(rng, 2, 40))) if ids
                                                     else self.words(rng, 2, 40) for _ in range(rng.randint(1, 2))]
        self.sampling(rng, body)
        n = 1
        if kind == "n_samples":
            n = body["n"] = rng.randint(2, 4)
            body["temperature"] = 1.0
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
        if kind in ("logprobs", "raw_slow_reader"):
            body["temperature"] = round(rng.uniform(0.5, 1.2), 2)
            body["top_p"] = round(rng.uniform(0.5, 0.95), 2)
            body["top_k"] = rng.randint(5, 50)
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
            else:
                body["logprobs"] = rng.randint(0, 5)
        if kind == "stop":
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3)) if rng.random() < 0.7 else rng.choice(STOPS)
            body["include_stop_str_in_output"] = rng.random() < 0.3
            body["max_tokens"] = max(body["max_tokens"], 8)
        if kind == "seeded":
            body["seed"] = rng.randrange(2**31)
            body["temperature"] = 1.0
        if kind in ("cancel_stream", "cancel_nonstream", "raw_kill_stream", "slow_reader", "raw_slow_reader"):
            body["max_tokens"] = max(body["max_tokens"], self.args.max_tokens // 2)
            body["ignore_eos"] = True
        if not chat and rng.random() < 0.1 and "logprobs" not in body and kind != "multi_prompt":
            body["echo"] = True
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        prompts = len(body["prompt"]) if kind == "multi_prompt" else 1
        return Job("/v1/chat/completions" if chat else "/v1/completions", body, n * prompts, stream)

    def malformed(self, rng: random.Random) -> tuple[str, bytes, frozenset[int]]:
        msgs = [{"role": "user", "content": "hi"}]
        c, cc = "/v1/completions", "/v1/chat/completions"
        cases = [
            (c, b"{not json"), (c, b""), (c, b"[1, 2, 3]"), (cc, b"\xff\xfe\x00garbage"), (c, b'{"prompt": "hi",'),
            (c, {"prompt": 5}), (c, {"prompt": "hi", "max_tokens": "5"}), (c, {"prompt": "hi", "temperature": -1}),
            (c, {"prompt": "hi", "n": 0}), (c, {"prompt": "hi", "bogus_field": True}), (c, {"prompt": [-1]}),
            (c, {"prompt": [10**9]}), (c, {"prompt": "hi", "logit_bias": {"999999999": 1}}),
            (c, {"prompt": "hi", "suffix": "x"}), (c, {"prompt": "hi", "top_p": 0}), (c, {"max_tokens": 3}),
            (c, {"prompt": "hi", "stop": [""]}), (c, {"prompt": "hi", "logprobs": 21}),
            (cc, {"messages": "hi"}), (cc, {"messages": [{"role": "user"}]}), (cc, {"messages": []}),
            (cc, {"messages": msgs, "top_logprobs": 3}), (cc, {"messages": msgs, "tools": []}),
            (cc, {"messages": msgs, "response_format": {"type": "json_schema"}}),  # no schema given
            (cc, {"messages": msgs, "max_tokens": 0}), (cc, {"messages": msgs, "n": "2"}),
            ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [-1]}),
        ]
        path, body = rng.choice(cases)
        expected = frozenset({400})
        if rng.random() < 0.08:  # the model named is not served
            path, body, expected = c, {"prompt": "hi", "model": "no-such-model"}, frozenset({404})
        elif rng.random() < 0.05:  # over the body limit
            path, body, expected = c, {"prompt": "x" * (self.args.max_body_bytes + 10)}, frozenset({413})
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return path, raw, expected

    def overlong(self, rng: random.Random) -> tuple[str, dict]:
        if rng.random() < 0.5:  # the prompt alone is over the context
            ids = [rng.randrange(100, 40000 if len(self.tok) > 40000 else len(self.tok) - 1)
                   for _ in range(self.max_model_len + rng.randint(0, 40))]
            return "/v1/completions", {"prompt": ids, "max_tokens": 4, "stream": rng.random() < 0.5}
        if rng.random() < 0.5:  # the prompt fits, the completion asked for does not
            return "/v1/completions", {"prompt": "hello", "max_tokens": self.max_model_len * 2}
        text = " ".join(rng.choice(WORDS) for _ in range(self.max_model_len * 2))
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}

    # -- checking what came back -----------------------------------------------------------
    def check_body(self, job: Job, data) -> str | None:
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
            problem = self.check_text(job, text) or self.check_logprobs(job, c, reason)
            if problem:
                return f"choice {c.get('index')}: {problem}"
        return None

    def check_text(self, job: Job, text: str) -> str | None:
        if job.body.get("echo"):
            return None
        hit = next((s for s in job.stops if s in text), None)
        if hit is not None:
            return f"stop string {hit!r} in the output {text!r}"
        return None

    def check_logprobs(self, job: Job, c: dict, reason: str) -> str | None:
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

    def check_stream(self, job: Job, status: int, raw: str) -> Outcome:
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
            problem = self.check_text(job, text)
            if problem:
                return Outcome("bad", status, f"choice {idx}: {problem}")
        return Outcome("ok", status)

    def json_outcome(self, job: Job | None, status: int, raw: bytes, expected: frozenset[int] = frozenset()) -> Outcome:
        try:
            data = json.loads(raw)
        except ValueError:
            return Outcome("bad", status, f"body is not JSON: {raw[:300]!r}")
        if status == 200:
            if job is None:
                return Outcome("bad", status, f"200 where {sorted(expected)} was expected: {_clip(data, 300)}")
            problem = self.check_body(job, data)
            return Outcome("bad", status, problem + f"; body {_clip(data, 500)}") if problem else Outcome("ok", 200)
        return error_outcome(status, data, expected)

    # -- httpx clients ----------------------------------------------------------------------
    async def http_worker(self, i: int) -> None:
        rng = random.Random(f"{self.args.seed}-http-{i}")
        kinds, weights = zip(*HTTP_KINDS.items())
        async with httpx.AsyncClient(base_url=self.url, timeout=self.args.request_timeout) as client:
            while time.monotonic() < self.deadline and not self.stop.is_set():
                await self.one(rng.choices(kinds, weights)[0], rng, client)

    async def raw_worker(self, i: int) -> None:
        rng = random.Random(f"{self.args.seed}-raw-{i}")
        kinds, weights = zip(*RAW_KINDS.items())
        while time.monotonic() < self.deadline and not self.stop.is_set():
            await self.one(rng.choices(kinds, weights)[0], rng, None)
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def one(self, kind: str, rng: random.Random, client: httpx.AsyncClient | None) -> None:
        self.ledger.sent[kind] += 1
        self.inflight += 1
        sent: dict | bytes | None = None
        try:
            if kind == "malformed":
                path, raw, expected = self.malformed(rng)
                sent = {"path": path, "raw": raw[:300].decode("utf-8", "replace")}
                coro = self.post_raw_body(client, path, raw, expected)
            elif kind == "overlong":
                path, body = self.overlong(rng)
                sent = {"path": path, "body": _clip(body, 200)}
                coro = self.post_expect(client, path, body, frozenset({400}))
            else:
                job = self.job(kind, rng)
                sent = {"path": job.path, **job.body}
                coro = getattr(self, kind if kind.startswith("raw_") or kind.startswith("cancel") or
                               kind == "slow_reader" else "plain")(client, job, rng)
            out = await asyncio.wait_for(coro, self.args.request_timeout)
        except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException):
            out = Outcome("lost", None, f"no complete response within {self.args.request_timeout}s")
        except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as exc:
            out = Outcome("lost", None, f"connection failed before a complete response: {exc!r}")
        except asyncio.CancelledError:  # the soak gave up waiting (the engine died): lost
            self.ledger.record(kind, Outcome("lost", None, "still unanswered when the soak gave up on a dead "
                                                           "engine"), sent)
            raise
        except Exception as exc:  # a bug of this script: still counted, and shown
            out = Outcome("bad", None, f"soak client error: {traceback.format_exc(limit=3)} {exc!r}")
        finally:
            self.inflight -= 1
        self.ledger.record(kind, out, sent)
        # Back off, as a client told "retry later" does: doubling from 0.25 s up to 4 s.
        key = id(rng)
        if out.verdict == "clean_error" and out.status in (429, 503):
            wait = self.backoff.get(key, 0.25)
            self.backoff[key] = min(2 * wait, 4.0)
            await asyncio.sleep(rng.uniform(0.5, 1.0) * wait)
        else:
            self.backoff.pop(key, None)

    async def plain(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        if not job.stream:
            r = await client.post(job.path, json=job.body)
            return self.json_outcome(job, r.status_code, r.content)
        async with client.stream("POST", job.path, json=job.body) as r:
            raw = await r.aread()
        if r.status_code != 200:
            return self.json_outcome(job, r.status_code, raw)
        return self.check_stream(job, 200, raw.decode())

    async def post_raw_body(self, client, path: str, raw: bytes, expected: frozenset[int]) -> Outcome:
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        out = self.json_outcome(None, r.status_code, r.content, expected)
        if out.verdict == "clean_error" and r.status_code not in expected:  # a 429 for a malformed body
            return Outcome("bad", r.status_code, f"{r.status_code} where {sorted(expected)} was expected: {r.text[:300]}")
        return out

    async def post_expect(self, client, path: str, body: dict, expected: frozenset[int]) -> Outcome:
        r = await client.post(path, json=body)
        if r.status_code == 429:  # a queue-full refusal can come before the length check
            return self.json_outcome(None, r.status_code, r.content, frozenset())
        return self.json_outcome(None, r.status_code, r.content, expected)

    async def cancel_stream(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        """Read a few events of a stream, then close the connection."""
        keep = rng.randint(1, 6)
        async with client.stream("POST", job.path, json=job.body) as r:
            if r.status_code != 200:
                return self.json_outcome(job, r.status_code, await r.aread())
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: [DONE]"):
                    return self.check_stream(job, 200, "\n".join(lines) + "\n")
                if '"error"' in line:  # a failed stream: read on to its [DONE]
                    continue
                if sum(x.startswith("data:") for x in lines) >= keep:
                    return Outcome("aborted", 200, "closed the stream early")
        return self.check_stream(job, 200, "\n".join(lines))

    async def cancel_nonstream(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        """Give up on a non-streaming request after a short while (the connection is closed)."""
        try:
            r = await asyncio.wait_for(client.post(job.path, json=job.body), rng.uniform(0.05, 1.0))
        except (asyncio.TimeoutError, TimeoutError):
            return Outcome("aborted", None, "abandoned before the response")
        return self.json_outcome(job, r.status_code, r.content)

    async def slow_reader(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        async with client.stream("POST", job.path, json=job.body) as r:
            if r.status_code != 200:
                return self.json_outcome(job, r.status_code, await r.aread())
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data:"):
                    await asyncio.sleep(rng.uniform(0.01, 0.08))
        return self.check_stream(job, 200, "\n".join(lines) + "\n")

    # -- raw sockets -----------------------------------------------------------------------
    def request_bytes(self, path: str, body: bytes, close: bool = True, length: int | None = None) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\n"
                + ("Connection: close\r\n" if close else "") + "\r\n")
        return head.encode() + body

    async def connect(self, rcvbuf: int | None = None):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        return await asyncio.open_connection(sock=sock)

    @staticmethod
    def kill(writer: asyncio.StreamWriter, reset: bool) -> None:
        sock = writer.get_extra_info("socket")
        if reset and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort() if reset else writer.close()

    def parse_response(self, job: Job, raw: bytes) -> Outcome:
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
            body, complete = _dechunk(body)
            if not complete:
                return Outcome("lost", status, f"chunked body not terminated; tail {body[-300:]!r}")
        elif "content-length" in headers and len(body) != int(headers["content-length"]):
            return Outcome("lost", status, f"body of {len(body)} bytes, content-length {headers['content-length']}")
        if status == 200 and job.stream:
            return self.check_stream(job, status, body.decode())
        return self.json_outcome(job, status, body)

    async def raw_request(self, _, job: Job, rng: random.Random) -> Outcome:
        reader, writer = await self.connect()
        try:
            data = self.request_bytes(job.path, json.dumps(job.body).encode())
            cut = rng.randrange(1, len(data))  # in two writes: headers and body split anywhere
            writer.write(data[:cut])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.02))
            writer.write(data[cut:])
            await writer.drain()
            raw = await reader.read(-1)
        finally:
            writer.close()
        return self.parse_response(job, raw)

    async def raw_slow_reader(self, _, job: Job, rng: random.Random) -> Outcome:
        reader, writer = await self.connect(rcvbuf=2048)
        try:
            writer.write(self.request_bytes(job.path, json.dumps(job.body).encode()))
            await writer.drain()
            chunks = []
            while chunk := await reader.read(rng.choice((256, 1024, 4096))):
                chunks.append(chunk)
                await asyncio.sleep(rng.uniform(0.005, 0.03))
        finally:
            writer.close()
        return self.parse_response(job, b"".join(chunks))

    async def raw_kill_body(self, _, job: Job, rng: random.Random) -> Outcome:
        """Headers announce a body; part of it is sent, then the connection is closed or reset."""
        reader, writer = await self.connect()
        body = json.dumps(job.body).encode()
        writer.write(self.request_bytes(job.path, body[: rng.randrange(0, len(body))], length=len(body)))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.2))
        self.kill(writer, reset=rng.random() < 0.5)
        return Outcome("aborted", None, "killed mid-body")

    async def raw_kill_stream(self, _, job: Job, rng: random.Random) -> Outcome:
        """A stream read up to a few events, then the connection is closed or reset."""
        reader, writer = await self.connect()
        killed = False
        try:
            writer.write(self.request_bytes(job.path, json.dumps(job.body).encode()))
            await writer.drain()
            raw = b""
            want = rng.randint(1, 4)
            while True:
                chunk = await reader.read(4096)
                if not chunk:  # the whole answer came first (an error, or a short stream)
                    return self.parse_response(job, raw)
                raw += chunk
                if raw.startswith(b"HTTP/1.1 200") and raw.count(b"data:") >= want and b"data: [DONE]" not in raw:
                    self.kill(writer, reset=rng.random() < 0.5)
                    killed = True
                    return Outcome("aborted", 200, "killed mid-stream")
        finally:
            if not killed:
                writer.close()


def _dechunk(body: bytes) -> tuple[bytes, bool]:
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


# -- the server -----------------------------------------------------------------------------
class LogTally(logging.Handler):
    """Counts what the engine and the server log at WARNING and above, keeping a few examples;
    keeps the expected tracebacks of injected faults off the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = collections.Counter()
        self.examples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name}:{record.levelname}:{_shape(record.getMessage().splitlines()[0])}"
        self.counts[key] += 1
        if key not in self.examples and len(self.examples) < 20:
            exc = "".join(traceback.format_exception(*record.exc_info))[-1500:] if record.exc_info else ""
            self.examples[key] = (record.getMessage()[:500] + "\n" + exc).strip()


def load_model(args):
    from contbatch.models import default_model_dir

    if args.model == "default":
        return contbatch.load_model()
    if args.model != "tiny":
        return contbatch.load_model(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
        initializer_range=0.2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval(), tok


def start_server(args):
    model, tok = load_model(args)
    dtype = next(model.parameters()).dtype
    per_block = KVLayout.from_model_config(model.config, dtype).bytes_per_block(args.block_size)
    config = contbatch.ContinuousBatchingConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, max_queue_size=args.max_queue_size,
        cpu_offload_space=args.offload_blocks * per_block / 2**30, max_prompt_length=args.max_model_len,
    )
    manager = contbatch.ContinuousBatchingManager(model, None, config, tokenizer=tok)
    settings = ServerSettings(served_model_names=(MODEL_NAME,), max_model_len=args.max_model_len,
                              max_body_bytes=args.max_body_bytes)
    app = build_app(manager, tok, settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # loopback only
    kw = dict(log_level="warning", log_config=None, lifespan="on", timeout_graceful_shutdown=5)
    try:  # as `contbatch serve` builds it, where the server has its own connection handling
        from contbatch.server.connections import uvicorn_config

        uv_config = uvicorn_config(app, settings.header_timeout_s, **kw)
    except ImportError:
        uv_config = uvicorn.Config(app, **kw)
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="soak-uvicorn")
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", manager, app, server, thread, tok


# -- probes and end checks --------------------------------------------------------------------
async def baseline(url: str) -> dict[str, str | None]:
    """A greedy chat and a greedy streamed completion: their texts, or None if they failed."""
    out: dict[str, str | None] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json={"messages": BASELINE_CHAT, "max_tokens": 24,
                                                            "temperature": 0, "ignore_eos": True})
        out["chat"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        async with client.stream("POST", "/v1/completions", json={
                "prompt": BASELINE_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            raw = (await r.aread()).decode()
        if r.status_code == 200 and raw.rstrip().endswith("data: [DONE]"):
            events = [json.loads(line[5:]) for line in raw.split("\n")
                      if line.startswith("data:") and "[DONE]" not in line]
            out["completion_stream"] = "".join(c["text"] for e in events for c in e.get("choices") or [])
        else:
            out["completion_stream"] = None
    return out


def idle_state(manager, app) -> dict:
    """Everything that must be empty once no request is in flight. Beyond `stats()`, this reads
    engine internals; one that is not there (the engine changed) is listed under `not_inspected`."""
    s = manager.stats()
    st = {k: s[k] for k in ("running", "waiting", "free_blocks", "cached_blocks", "offloaded_blocks") if k in s}
    st["num_blocks"] = manager.resolved_config.num_blocks
    missing = []

    def probe(name: str, get) -> None:
        try:
            value = get()
        except AttributeError:
            missing.append(name)
            return
        st[name] = value if isinstance(value, int) else len(value)

    store = getattr(manager, "_results", None)
    probe("block_tables", lambda: manager.cache.block_manager.block_tables)
    probe("referenced_blocks", lambda: sum(1 for r in manager.cache.block_manager._refs if r))
    probe("store_streams", lambda: store._streams)
    probe("store_live", lambda: store.live)
    probe("store_known", lambda: store._known)
    probe("store_finished", lambda: store._finished)
    probe("store_groups", lambda: store._groups)
    probe("manager_samples", lambda: manager._samples)
    probe("inbox", lambda: manager._inbox.qsize())
    if "offloaded_blocks" not in st:
        probe("offloaded_blocks", lambda: manager.scheduler.offloaded_blocks)
    probe("async_engine_live", lambda: app.state.engine.num_live)
    probe("gate_inflight", lambda: app.state.server_state.inflight)
    st["not_inspected"] = missing
    return st


def is_idle(st: dict) -> bool:
    return st["free_blocks"] == st["num_blocks"] and all(
        v == 0 for k, v in st.items() if k not in ("free_blocks", "num_blocks", "cached_blocks", "not_inspected"))


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


async def run(args) -> dict:
    tally = LogTally()
    for name in ("contbatch", "uvicorn"):
        lg = logging.getLogger(name)
        lg.addHandler(tally)
        lg.propagate = False
    t_start = time.time()
    url, manager, app, server, thread, tok = start_server(args)
    print(f"soak: server on {url}, model {args.model}, engine "
          f"{json.dumps({k: v for k, v in manager.resolved_config.as_dict().items() if k in SHOWN})}", flush=True)
    load = Load(args, url, tok, app.state.limits.max_model_len)
    checks: dict[str, dict] = {}
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "results_md"}}
    injector = None
    rss = {"start": round(rss_mib(), 1)}
    try:
        first = await baseline(url)
        report["baseline"] = first
        if args.faults:
            injector = faults.install(dict(zip(faults.SITES, args.fault_rates)), seed=args.seed)

        samples: list[tuple[float, float]] = []
        died_at: list[float] = []

        async def monitor(t0: float) -> None:
            warm_taken = False
            while not load.stop.is_set():
                now = time.monotonic()
                samples.append((round(now - t0, 1), round(rss_mib(), 1)))
                if not warm_taken and now - t0 >= args.warmup:
                    gc.collect()
                    rss["after_warmup"] = round(rss_mib(), 1)
                    warm_taken = True
                if not manager.is_running():
                    died_at.append(round(now - t0, 1))
                    load.stop.set()  # no point loading a dead engine; the checks say why
                    return
                await asyncio.sleep(0.25)

        t0 = time.monotonic()
        load.deadline = t0 + args.duration
        mon = asyncio.create_task(monitor(t0))
        workers = [asyncio.create_task(load.http_worker(i)) for i in range(args.clients)]
        workers += [asyncio.create_task(load.raw_worker(i)) for i in range(args.raw_clients)]
        pending = set(workers)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if died_at and time.monotonic() - t0 > died_at[0] + args.dead_grace:
                for task in pending:  # what the dead engine never answered is lost
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        for task in workers:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()
        load_s = time.monotonic() - t0
        load.stop.set()
        await mon
        counts = dict(injector.counts) if injector else dict.fromkeys(faults.SITES, 0)
        faults.uninstall()

        # Idle: wait for the engine to settle (killed connections are noticed a little later).
        t_idle = time.monotonic()
        state = idle_state(manager, app)
        wait = args.idle_timeout if manager.is_running() else min(args.idle_timeout, 3.0)  # dead: won't change
        while not is_idle(state) and time.monotonic() - t_idle < wait:
            await asyncio.sleep(0.2)
            state = idle_state(manager, app)
        idle_wait = time.monotonic() - t_idle
        alive = manager.is_running()
        last = await baseline(url) if alive else {"chat": None, "completion_stream": None}
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            health = (await client.get("/health")).status_code
        gc.collect()
        rss["end"] = round(rss_mib(), 1)
        rss["peak"] = max([s[1] for s in samples] + [rss["end"]])
        rss.setdefault("after_warmup", samples[-1][1] if samples else rss["start"])
        rss["growth_after_warmup"] = round(rss["end"] - rss["after_warmup"], 1)
        stats = manager.stats()
        led = load.ledger

        # -- checks ------------------------------------------------------------------------
        def check(name: str, ok: bool, detail) -> None:
            checks[name] = {"ok": bool(ok), "detail": detail}

        sent = sum(led.sent.values())
        accounted = sum(led.verdicts.values())
        check("every_request_accounted", sent == accounted and led.verdicts["lost"] == 0,
              f"sent {sent} = ok {led.verdicts['ok']} + clean errors {led.verdicts['clean_error']} + fault errors "
              f"{led.verdicts['fault_error']} + aborted by the client {led.verdicts['aborted']} + bad "
              f"{led.verdicts['bad']} + lost {led.verdicts['lost']} (accounted {accounted})")
        bad_500 = sum(v for k, v in led.problem_counts.items() if "/500/" in k)
        check("no_bad_responses", led.verdicts["bad"] == 0,
              f"{led.verdicts['bad']} bad responses ({bad_500} of them 500s not caused by an injected fault)")
        fired = {s: counts.get(s, 0) for s in faults.SITES}
        failing_sites = ("forward", "sampler", "detokenizer")
        unexplained = {s: n for s, n in led.fault_errors.items() if s not in failing_sites or not fired.get(s)}
        silent = [s for s in failing_sites if fired[s] >= args.fault_min_visible and not led.fault_errors[s]]
        # A step's fault fails the requests of that step (at most one per client); a
        # detokenizer fault fails the one request it hit.
        cap = {"forward": args.clients + args.raw_clients, "sampler": args.clients + args.raw_clients,
               "detokenizer": 1}
        too_many = {s: n for s, n in led.fault_errors.items() if s in cap and n > fired[s] * cap[s]}
        check("fault_errors_match_injections", not unexplained and not silent and not too_many,
              {"injected": fired, "requests_failed_by_fault": dict(led.fault_errors),
               "errors_without_a_fault_at_their_site": unexplained,
               "more_failed_requests_than_the_faults_could_reach": too_many,
               f"sites_fired_{args.fault_min_visible}+_times_without_any_failed_request": silent})
        check("engine_alive", alive and not died_at and health == 200,
              {"engine_thread_running": alive, "died_at_s": died_at[0] if died_at else None, "health": health})
        check("engine_idle_and_clean", is_idle(state), {**state, "waited_s": round(idle_wait, 1)})
        check("same_greedy_text_at_end", first == last and None not in first.values(),
              {"start": first, "end": last})
        check("rss_growth_bounded", rss["growth_after_warmup"] <= args.rss_growth_mib,
              f"{rss['growth_after_warmup']} MiB after warm-up (bound {args.rss_growth_mib} MiB)")
        report["coverage"] = {
            "queue_full_429": led.statuses.get("429", 0), "kv_soft_resets": stats["soft_resets"],
            "kv_offloads": stats["offloads"], "kv_restores": stats["restores"],
            "faults_injected": sum(fired.values()), "aborted_by_client": led.verdicts["aborted"],
        }
        report["coverage_gaps"] = [k for k, v in report["coverage"].items() if not v]
        report.update({
            "passed": all(c["ok"] for c in checks.values()),
            "load_seconds": round(load_s, 1), "wall_seconds": round(time.time() - t_start, 1),
            "sent": sent, "verdicts": dict(led.verdicts), "status_codes": dict(sorted(led.statuses.items())),
            "per_kind": {k: {"sent": led.sent[k], **dict(led.kinds[k])} for k in sorted(led.sent)},
            "faults_injected": fired, "requests_failed_by_fault": dict(led.fault_errors),
            "engine": {k: stats[k] for k in ("steps", "soft_resets", "offloads", "restores", "prefix_cache_hit_rate",
                                             "free_blocks", "cached_blocks", "running", "waiting")},
            "rss_mib": rss, "rss_samples": samples[:: max(1, len(samples) // 20)],
            "checks": checks, "problems": dict(led.problem_counts), "problem_examples": led.examples,
            "server_log": dict(tally.counts), "server_log_examples": tally.examples,
        })
        return report
    finally:
        faults.uninstall()
        server.should_exit = True
        thread.join(30)


SHOWN = ("device", "dtype", "block_size", "num_blocks", "max_queue_size", "cpu_offload_blocks", "attention_backend",
         "max_batch_tokens")


def markdown_section(report: dict, argv: list[str]) -> str:
    c = report["config"]
    out = [f"\n## soak.py, {datetime.datetime.now().isoformat(timespec='minutes')}\n",
           f"`python benchmarks/soak.py {' '.join(argv)}`: model {c['model']}, {report['load_seconds']} s of load, "
           f"{c['clients']} httpx + {c['raw_clients']} raw-socket clients, {c['num_blocks']} blocks of "
           f"{c['block_size']}, max_queue_size {c['max_queue_size']}, fault rates "
           f"{dict(zip(faults.SITES, c['fault_rates'])) if c['faults'] else 'off'}. "
           f"**{'PASSED' if report['passed'] else 'FAILED'}**.\n",
           "| check | ok | detail |", "|---|---|---|"]
    for name, ch in report["checks"].items():
        detail = ch["detail"] if isinstance(ch["detail"], str) else json.dumps(ch["detail"])
        out.append(f"| {name} | {'yes' if ch['ok'] else '**no**'} | {detail.replace('|', '/')[:400]} |")
    out += ["", f"Sent {report['sent']}: {json.dumps(report['verdicts'])}; status codes "
            f"{json.dumps(report['status_codes'])}; faults injected {json.dumps(report['faults_injected'])}; "
            f"engine {json.dumps(report['engine'])}; RSS MiB {json.dumps(report['rss_mib'])}.", ""]
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", action="store_true", help="the CI mode: tiny random model, ~15 s of load")
    p.add_argument("--model", help="default (SmolLM2-135M), tiny (random 2-layer Llama, default tokenizer), "
                                   "or a local HF folder / .gguf")
    p.add_argument("--duration", type=float, help="seconds of load (default 600; --short: 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, help="concurrent httpx clients")
    p.add_argument("--raw-clients", type=int, help="concurrent raw-socket clients")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="small, so that KV pressure happens")
    p.add_argument("--offload-blocks", type=int, help="host blocks for offloaded KV (0: soft resets only)")
    p.add_argument("--max-queue-size", type=int, help="small, so that 429s happen")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-tokens", type=int, help="largest max_tokens of a generation request")
    p.add_argument("--max-body-bytes", type=int, default=65536)
    p.add_argument("--request-timeout", type=float, help="a request without a complete answer by then is lost")
    p.add_argument("--warmup", type=float, help="seconds of load before the RSS reference is taken")
    p.add_argument("--rss-growth-mib", type=float, help="allowed RSS growth from the end of warm-up to the end")
    p.add_argument("--idle-timeout", type=float, default=30, help="seconds to wait for the engine to go idle")
    p.add_argument("--dead-grace", type=float, default=5,
                   help="if the engine thread dies, seconds its requests in flight still get before they are lost")
    for site in faults.SITES:
        p.add_argument(f"--fault-{site}", type=float, default=0.01, help=f"fault rate at {site} (default 0.01)")
    p.add_argument("--no-faults", dest="faults", action="store_false")
    p.add_argument("--fault-min-visible", type=int, default=3,
                   help="a site that fired this often must have failed at least one request")
    p.add_argument("--json", type=Path, help="write the summary here too")
    p.add_argument("--results-md", type=Path, help="append a dated markdown section here")
    args = p.parse_args(argv)
    profile = PROFILES["short" if args.short else "full"]
    for key, value in vars(profile).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.fault_rates = [getattr(args, f"fault_{s}") for s in faults.SITES]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    report = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in report.items() if k not in ("checks",)}, indent=1, default=str))
    print("\nsoak verdict:")
    for name, ch in report["checks"].items():
        detail = ch["detail"] if isinstance(ch["detail"], str) else json.dumps(ch["detail"], default=str)
        print(f"  [{'PASS' if ch['ok'] else 'FAIL'}] {name}: {detail}")
    if report["coverage_gaps"]:
        print(f"  note: this run never exercised {report['coverage_gaps']}")
    print(f"soak: {'PASSED' if report['passed'] else 'FAILED'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.results_md:
        with args.results_md.open("a") as f:
            f.write(markdown_section(report, argv))
        print(f"appended to {args.results_md}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
