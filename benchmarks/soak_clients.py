"""The soak's clients: concurrent httpx clients and raw-socket clients under one `Load`.

Each httpx client loops until the deadline, picking a kind of request by weight
(`soak_requests.HTTP_KINDS`): plain requests, streams closed early, requests abandoned, slow
readers, malformed and over-long bodies. Raw-socket clients (`RAW_KINDS`) split a request
across writes, read with a 2 KiB receive buffer, or kill the connection mid-body or
mid-stream (some with a TCP reset). Every request is recorded in the `Ledger` with its
outcome; a client told 429 or 503 `server_busy` backs off (0.25 s, doubling up to 4 s).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
import traceback

import httpx

from soak_checks import check_stream, json_outcome, parse_response
from soak_outcomes import Ledger, Outcome, clip
from soak_requests import HTTP_KINDS, RAW_KINDS, Job, Requests


class Load:
    def __init__(self, args, url: str, tokenizer, limits_len: int) -> None:
        self.args = args
        self.url = url
        self.host, self.port = "127.0.0.1", int(url.rsplit(":", 1)[1])
        self.requests = Requests(args, tokenizer, limits_len)
        self.ledger = Ledger()
        self.stop = asyncio.Event()
        self.deadline = 0.0
        self.inflight = 0
        self.backoff: dict[int, float] = {}  # per client: the next wait after a "retry later"

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
                path, raw, expected = self.requests.malformed(rng)
                sent = {"path": path, "raw": raw[:300].decode("utf-8", "replace")}
                coro = self.post_raw_body(client, path, raw, expected)
            elif kind == "overlong":
                path, body = self.requests.overlong(rng)
                sent = {"path": path, "body": clip(body, 200)}
                coro = self.post_expect(client, path, body, frozenset({400}))
            else:
                job = self.requests.job(kind, rng)
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
            return json_outcome(job, r.status_code, r.content)
        async with client.stream("POST", job.path, json=job.body) as r:
            raw = await r.aread()
        if r.status_code != 200:
            return json_outcome(job, r.status_code, raw)
        return check_stream(job, 200, raw.decode())

    async def post_raw_body(self, client, path: str, raw: bytes, expected: frozenset[int]) -> Outcome:
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        out = json_outcome(None, r.status_code, r.content, expected)
        if out.verdict == "clean_error" and r.status_code not in expected:  # a 429 for a malformed body
            return Outcome("bad", r.status_code, f"{r.status_code} where {sorted(expected)} was expected: {r.text[:300]}")
        return out

    async def post_expect(self, client, path: str, body: dict, expected: frozenset[int]) -> Outcome:
        r = await client.post(path, json=body)
        if r.status_code == 429:  # a queue-full refusal can come before the length check
            return json_outcome(None, r.status_code, r.content, frozenset())
        return json_outcome(None, r.status_code, r.content, expected)

    async def cancel_stream(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        """Read a few events of a stream, then close the connection."""
        keep = rng.randint(1, 6)
        async with client.stream("POST", job.path, json=job.body) as r:
            if r.status_code != 200:
                return json_outcome(job, r.status_code, await r.aread())
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: [DONE]"):
                    return check_stream(job, 200, "\n".join(lines) + "\n")
                if '"error"' in line:  # a failed stream: read on to its [DONE]
                    continue
                if sum(x.startswith("data:") for x in lines) >= keep:
                    return Outcome("aborted", 200, "closed the stream early")
        return check_stream(job, 200, "\n".join(lines))

    async def cancel_nonstream(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        """Give up on a non-streaming request after a short while (the connection is closed)."""
        try:
            r = await asyncio.wait_for(client.post(job.path, json=job.body), rng.uniform(0.05, 1.0))
        except (asyncio.TimeoutError, TimeoutError):
            return Outcome("aborted", None, "abandoned before the response")
        return json_outcome(job, r.status_code, r.content)

    async def slow_reader(self, client: httpx.AsyncClient, job: Job, rng: random.Random) -> Outcome:
        async with client.stream("POST", job.path, json=job.body) as r:
            if r.status_code != 200:
                return json_outcome(job, r.status_code, await r.aread())
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data:"):
                    await asyncio.sleep(rng.uniform(0.01, 0.08))
        return check_stream(job, 200, "\n".join(lines) + "\n")

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
        return parse_response(job, raw)

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
        return parse_response(job, b"".join(chunks))

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
                    return parse_response(job, raw)
                raw += chunk
                if raw.startswith(b"HTTP/1.1 200") and raw.count(b"data:") >= want and b"data: [DONE]" not in raw:
                    self.kill(writer, reset=rng.random() < 0.5)
                    killed = True
                    return Outcome("aborted", 200, "killed mid-stream")
        finally:
            if not killed:
                writer.close()

