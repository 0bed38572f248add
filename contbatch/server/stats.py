"""The dashboard's numbers: a short history of the engine and its most recent requests.

Prometheus (`metrics.py`) answers "what is the total so far"; a person watching the engine
wants "what happened over the last minutes" without running a Prometheus server. So the
server keeps a small ring buffer of engine samples (taken once a second from the manager's
public `stats()`, by an asyncio task the app's lifespan starts) and, from its own result
handler, the last requests and their latencies. `GET /stats` returns all of it as JSON
(`snapshot`), behind the API key like every route but `/health`.

The result handler runs on the engine thread: it only appends to bounded containers under a
lock held for microseconds. Everything that sorts or formats runs in `snapshot`, on the event
loop, when a dashboard polls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..requests import GenerationOutput

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 300  # five minutes at one sample a second
RECENT_REQUESTS = 25  # rows of the dashboard's table
LATENCY_WINDOW = 4096  # TTFT values (one per request) and ITL values (one per token) kept
PERCENTILES = (50, 90, 99)
RATE_SAMPLES = 5  # the headline tok/s: over the last five intervals, not the last noisy one


@dataclass
class Sample:
    """The engine at one moment: gauges as read, counters as running totals."""

    t: float
    running: int
    waiting: int
    kv_used: int  # blocks held by requests
    kv_cached: int  # free blocks still holding a reusable prefix
    kv_free: int  # blocks holding nothing
    generated: int  # tokens generated so far (result handler's count)
    prefix_queries: int
    prefix_hits: int
    soft_resets: int
    offloads: int


@dataclass
class RequestRow:
    """One sample of one request, as the table shows it; live until its final output."""

    id: str
    index: int
    queued_at: float
    prompt_tokens: int
    cached_tokens: int = 0
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    def as_dict(self, now: float) -> dict:
        end = self.finished_at or now
        decode = (end - self.first_token_at) if self.first_token_at is not None else 0.0
        return {
            "id": self.id if self.index == 0 else f"{self.id}#{self.index}",
            "state": self.finish_reason or ("decoding" if self.first_token_at is not None else "queued"),
            "queued_at": self.queued_at,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated": self.generated,
            "ttft_s": None if self.first_token_at is None else max(0.0, self.first_token_at - self.queued_at),
            "duration_s": max(0.0, end - self.queued_at),
            # decode rate: tokens after the first over the time since it came
            "tok_s": (self.generated - 1) / decode if self.generated > 1 and decode > 0 else None,
            "error": self.error,
        }


def percentiles(values: list[float]) -> dict:
    """Nearest-rank percentiles (no interpolation: every figure is a latency that happened)."""
    if not values:
        return {"count": 0, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(values)
    n = len(ordered)
    return {"count": n, **{f"p{p}": ordered[min(n - 1, max(0, -(-p * n // 100) - 1))] for p in PERCENTILES}}


def _rate(samples: list[Sample]) -> float:
    """Tokens generated per second between the first and last of `samples`."""
    if len(samples) < 2 or samples[-1].t <= samples[0].t:
        return 0.0
    return (samples[-1].generated - samples[0].generated) / (samples[-1].t - samples[0].t)


class EngineStats:
    """Engine history and recent requests of one app; `on_output` is the manager's result handler."""

    def __init__(self, stats: Callable[[], dict], num_blocks: int, block_size: int, model_name: str,
                 interval_s: float = SAMPLE_INTERVAL_S, history: int = HISTORY_SAMPLES) -> None:
        self._stats = stats
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_name = model_name
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._live: dict[tuple[str, int], RequestRow] = {}
        self._recent: deque[RequestRow] = deque(maxlen=RECENT_REQUESTS)
        self._ttft: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._itl: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.generated = 0
        self.finished = 0

    # -- engine thread -------------------------------------------------------------------
    def on_output(self, out: GenerationOutput) -> None:
        now = time.time()
        key = (out.request_id, out.index)
        k = len(out.new_tokens)
        with self._lock:
            row = self._live.get(key)
            if row is None:
                row = self._live[key] = RequestRow(out.request_id, out.index, out.queued_at, len(out.prompt_ids))
            if row.first_token_at is None and out.first_token_at is not None:
                row.first_token_at = row.last_token_at = out.first_token_at
                row.cached_tokens = out.cached_tokens
                if out.index == 0:  # once per request, as the Prometheus histogram counts it
                    self._ttft.append(max(0.0, out.first_token_at - out.queued_at))
                k -= 1  # the first token's wait is TTFT, not an inter-token gap
            if k > 0 and row.last_token_at is not None:
                gap = max(0.0, now - row.last_token_at) / k  # a chunk of k tokens: spread its wait
                self._itl.extend([gap] * k)
            if out.new_tokens:
                row.last_token_at = now
                row.generated += len(out.new_tokens)
                self.generated += len(out.new_tokens)
            if out.is_finished:
                row.generated = len(out.generated_tokens)
                row.finished_at = out.finished_at or now
                row.finish_reason = out.finish_reason or "error"
                row.error = out.error
                self._recent.append(self._live.pop(key))
                self.finished += 1

    # -- event loop ----------------------------------------------------------------------
    def sample(self) -> Sample:
        s = self._stats()
        free = int(s.get("free_blocks", self.num_blocks))
        cached = int(s.get("cached_blocks", 0))
        sample = Sample(t=time.time(), running=int(s.get("running", 0)), waiting=int(s.get("waiting", 0)),
                        kv_used=max(0, self.num_blocks - free), kv_cached=cached, kv_free=max(0, free - cached),
                        generated=self.generated, prefix_queries=int(s.get("prefix_cache_queries", 0)),
                        prefix_hits=int(s.get("prefix_cache_hits", 0)), soft_resets=int(s.get("soft_resets", 0)),
                        offloads=int(s.get("offloads", 0)))
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        """Sample until cancelled (the app's lifespan owns this task)."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def snapshot(self) -> dict:
        """Everything the dashboard draws, in one JSON-able dict."""
        now = time.time()
        current = self.sample() if not self.samples or now - self.samples[-1].t > 2 * self.interval_s \
            else self.samples[-1]
        with self._lock:
            live = sorted(self._live.values(), key=lambda r: r.queued_at)
            recent = list(self._recent)
            ttft, itl = list(self._ttft), list(self._itl)
            rows = [r.as_dict(now) for r in reversed(recent + live)][:RECENT_REQUESTS]
        samples = list(self.samples)
        series: dict[str, list] = {name: [getattr(x, name) for x in samples]
                                   for name in ("t", "running", "waiting", "kv_used", "kv_cached", "kv_free")}
        series["tok_s"], series["hit_rate"] = [], []
        for prev, cur in zip([None] + samples[:-1], samples):
            dt = cur.t - prev.t if prev else 0.0
            series["tok_s"].append((cur.generated - prev.generated) / dt if prev and dt > 0 else 0.0)
            dq = cur.prefix_queries - prev.prefix_queries if prev else 0
            series["hit_rate"].append((cur.prefix_hits - prev.prefix_hits) / dq if dq > 0 else None)
        first = samples[0] if samples else current
        window_q = current.prefix_queries - first.prefix_queries
        return {
            "model": self.model_name, "now": now, "interval_s": self.interval_s,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "current": asdict(current),
            "prefix_hit_rate": current.prefix_hits / current.prefix_queries if current.prefix_queries else None,
            "prefix_hit_rate_window": (current.prefix_hits - first.prefix_hits) / window_q if window_q else None,
            "output_tok_s": _rate(samples[-1 - RATE_SAMPLES:]),
            "finished_requests": self.finished,
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "series": series, "recent": rows,
        }
