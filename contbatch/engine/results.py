"""Where finished results and streamed chunks wait for their readers.

Written by the engine thread, read by any thread: a condition guards the table of finished
results, and each streaming request has its own queue. Samples of an n > 1 request are
gathered here and published once, under their parent's id, when the last one ends.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..faults import inject
from ..requests import GenerationOutput, RequestState, RequestStatus

logger = logging.getLogger("contbatch")


class ResultStore:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._finished: OrderedDict[str, GenerationOutput] = OrderedDict()
        self.live: set[str] = set()  # submitted, not finished (parent ids)
        self._known: set[str] = set()  # submitted, result not yet retrieved
        self._streams: dict[str, queue.Queue] = {}
        self._groups: dict[str, list[GenerationOutput | None]] = {}  # parent id -> samples
        self._sizes: dict[str, int] = {}  # live parent id -> its sequences (n)
        self.live_sequences = 0
        self.handlers: list[Callable[[GenerationOutput], None]] = []

    # -- engine thread -------------------------------------------------------------------
    def register(self, groups: list[list[RequestState]], max_sequences: int, queue_chunks: bool = True) -> None:
        """Register every request of one submission, or none. Called by the submitting
        thread. `max_sequences` (the queue limit) counts sequences: each of n samples is a
        request in the engine. A submission larger than the limit could never be queued, so
        it is refused outright (ValueError), while a full queue is worth a retry (RuntimeError)."""
        ids = [states[0].parent_id for states in groups]
        size = sum(len(states) for states in groups)
        with self._cond:
            taken = [rid for rid in ids if rid in self._known]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in use (live, or its result not yet retrieved)")
            if max_sequences and size > max_sequences:
                raise ValueError(
                    f"this submission has {size} sequences (prompts x n) but the engine queues at most "
                    f"{max_sequences} (max_queue_size): it can never be accepted; split it"
                )
            if max_sequences and self.live_sequences + size > max_sequences:
                raise RuntimeError(
                    f"queue full: {self.live_sequences} sequences in flight, {size} more requested "
                    f"(max_queue_size={max_sequences})"
                )
            for rid, states in zip(ids, groups):
                self._known.add(rid)
                self.live.add(rid)
                self._sizes[rid] = len(states)
                self.live_sequences += len(states)
                if len(states) > 1:
                    self._groups[rid] = [None] * len(states)
                if states[0].streaming and queue_chunks:
                    self._streams[rid] = queue.Queue()

    def _end(self, parent_id: str) -> None:
        """No longer live (under the lock)."""
        if parent_id in self.live:
            self.live.discard(parent_id)
            self.live_sequences -= self._sizes.pop(parent_id, 0)

    def lock(self) -> threading.Condition:
        return self._cond

    def publish(self, state: RequestState, parent_id: str) -> None:
        if not (state.status.is_done or self.handlers or parent_id in self._streams):
            return  # nobody reads a chunk of this one: its snapshot would be thrown away
        out = state.to_output()
        if parent_id != state.request_id:
            out = dataclasses.replace(out, request_id=parent_id)
        stream = self._streams.get(parent_id)
        if stream is not None and state.streaming and not out.is_finished:
            stream.put(out)
        if out.is_finished:
            self._finish(parent_id, out)
        for handler in self.handlers:
            try:
                handler(out)
                inject("handler")  # a handler that raises after its work: the engine goes on
            except Exception:  # a user's callback must never stop the engine
                logger.exception("result handler failed")

    def _finish(self, parent_id: str, out: GenerationOutput) -> None:
        group = self._groups.get(parent_id)
        if group is not None:
            group[out.index] = out
            if any(o is None for o in group):
                stream = self._streams.get(parent_id)
                if stream is not None:  # a sample's own last chunk, not the request's end
                    stream.put(dataclasses.replace(out, status=RequestStatus.DECODING))
                return
            del self._groups[parent_id]
            out = _merge(group)
        stream = self._streams.get(parent_id)
        if stream is not None:
            stream.put(out)
        with self._cond:
            self._end(parent_id)
            self._finished[parent_id] = out
            self._cond.notify_all()

    # -- any thread ----------------------------------------------------------------------
    def get(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None:
        with self._cond:
            if request_id is None:
                self._cond.wait_for(lambda: self._finished or not self.live, timeout)
                if not self._finished:
                    return None
                _, out = self._finished.popitem(last=False)
            else:
                if request_id not in self._known:
                    raise KeyError(f"unknown request id {request_id!r} (never submitted, or already retrieved)")
                if not self._cond.wait_for(lambda: request_id in self._finished, timeout):
                    return None
                out = self._finished.pop(request_id)
            self._known.discard(out.request_id)
            self._streams.pop(out.request_id, None)  # read without its stream: free the chunks
            return out

    def idle(self) -> bool:
        return not self.live and not self._finished

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def stream(self, request_id: str, timeout: float | None) -> Iterator[GenerationOutput] | None:
        """The request's chunks as they come, the final result last (and retrieved). A wait
        longer than `timeout` for the next chunk raises TimeoutError: a stream never ends
        silently without its final result."""
        q = self._streams.get(request_id)
        if q is None:
            return None

        def chunks() -> Iterator[GenerationOutput]:
            while True:
                try:
                    out = q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"no output of request {request_id!r} within {timeout}s; it is still running "
                        "(iterate again, or get_result it later)"
                    ) from None
                if out.is_finished:
                    self.get(request_id, timeout=0)  # retrieves it and drops the stream
                    yield out
                    return
                yield out

        return chunks()


def _merge(samples: list[GenerationOutput]) -> GenerationOutput:
    """An n > 1 result: sample 0's fields at the top level, every sample in `samples`."""
    first = samples[0]
    failed = next((s for s in samples if s.status != RequestStatus.FINISHED), None)
    return dataclasses.replace(
        first,
        status=failed.status if failed else first.status,
        error=failed.error if failed else first.error,
        finished_at=max(s.finished_at or 0 for s in samples),
        samples=samples,
    )
