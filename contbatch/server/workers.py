"""A small, bounded thread pool for the CPU-heavy part of a request: JSON parsing and
validation, chat templating, tokenizing, decoding token-id prompts.

On the event loop, one large body (a 15 MB prompt, a 300k-message chat) stalled every other
client, streams and /health included, for tens of seconds. In a worker thread the loop goes
on: the tokenizer (Rust) releases the interpreter lock while it works and Jinja (Python)
hands it over every few milliseconds; the JSON parse, which holds it, is bounded by the body
limit.

The pool is bounded twice: `threads` jobs run at once and at most `max_queued` more wait;
beyond that a request is refused at once with 503, so a flood costs a quick refusal rather
than an ever-growing backlog of parsed bodies. A job holds its slot until its thread is done
with it, even if the request that submitted it has gone away.

The threads share the model's tokenizer with each other and the engine thread. A fast
tokenizer is safe to read from several threads; what is not is changing its truncation,
padding or `split_special_tokens` state mid-encode ("Already borrowed"), which transformers
does whenever a call asks for other settings than the last. So every call here uses the
defaults, and escaping special tokens goes through `sanitize_control_tokens`, which changes
nothing on the tokenizer.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from .errors import APIError

P = ParamSpec("P")
T = TypeVar("T")

THREAD_PREFIX = "contbatch-worker"


class WorkerPool:
    """`threads` threads and room for `max_queued` waiting jobs, owned by one app (closed by
    its lifespan)."""

    def __init__(self, threads: int, max_queued: int) -> None:
        self.threads = threads
        self.capacity = threads + max_queued
        self._lock = threading.Lock()
        self._pending = 0  # jobs running or queued; released by the worker side, hence the lock
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=THREAD_PREFIX)

    @property
    def pending(self) -> int:
        """Jobs running or waiting for a thread."""
        return self._pending

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread; its exceptions (APIError included) are
        raised here. 503 when every thread is busy and the queue is full."""
        with self._lock:
            if self._pending >= self.capacity:
                raise APIError(503, f"the server is busy: {self.capacity} requests are already being prepared; "
                                    "retry later", code="server_busy", headers={"Retry-After": "1"})
            self._pending += 1
        try:
            future = self._executor.submit(contextvars.copy_context().run, fn, *args, **kwargs)
        except RuntimeError:  # shut down
            self._release()
            raise APIError(503, "the server is shutting down", code="server_shutting_down") from None
        future.add_done_callback(self._release)  # run, failed or cancelled: the thread is done with it
        return await asyncio.wrap_future(future)

    def _release(self, _: object = None) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """Refuse new jobs, drop queued ones; running ones finish on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
