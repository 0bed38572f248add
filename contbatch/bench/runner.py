"""One load level: requests sent at a Poisson rate, or kept at a fixed concurrency, or both.

Arrival times are drawn up front from a seeded generator, so two runs (or two servers) see
the same schedule. A concurrency cap holds requests back client-side, as vLLM's benchmark
does with --max-concurrency.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx
from tqdm.auto import tqdm

from .client import Endpoint, RequestResult, send
from .datasets import BenchRequest


@dataclass(frozen=True)
class Load:
    request_rate: float = math.inf  # requests per second; inf = all at once
    max_concurrency: int | None = None

    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = "" if self.max_concurrency is None else f", concurrency {self.max_concurrency}"
        return f"rate {rate}/s{conc}"


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_level(endpoint: Endpoint, requests: list[BenchRequest], load: Load, seed: int,
                    timeout_s: float = 600.0, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request under `load`; returns the results (in request order) and the wall time."""
    offsets = arrival_offsets(len(requests), load.request_rate, seed)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    limits = httpx.Limits(max_connections=load.max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    bar = tqdm(total=len(requests), desc=load.label(), unit="req", disable=not progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                result = await send(client, endpoint, req)
            else:
                async with gate:
                    result = await send(client, endpoint, req)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration
