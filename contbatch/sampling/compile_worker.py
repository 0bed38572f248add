"""Grammar compiles tried in worker processes, under a time budget, so they can be stopped.

xgrammar compiles in C++ and a thread running it cannot be stopped: a grammar that compiles
for minutes would hold its thread, and keep a shutting-down process alive, to the end. So a
spec that is not small (`limits.is_small`) is first compiled in a worker process: past
`budget_s`, or once nobody waits for it any more, the process is killed (and a fresh one
started), and the compile fails (`GrammarTooSlow`, `GrammarAbandoned`). A compile that ends
in time reports its seconds and the compiled grammar's size; the caller then compiles it again
in its own process, knowing it ends within the budget. (The compiled grammar itself does not
come back: xgrammar's serialized form is tens of times its size and slower to write than to
compile.)

The parent side is `CompileWorkers`: daemon threads, one per worker process, take jobs from
one queue. The child side is `main()` (`python -m contbatch.sampling.compile_worker`): it
loads the tokenizer's description, then answers one JSON line per job. It dies with its parent
(`PR_SET_PDEATHSIG`), and with a closed pipe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

logger = logging.getLogger("contbatch")

START_TIMEOUT_S = 120.0  # a worker imports xgrammar (and torch) before it answers


class GrammarTooSlow(ValueError):
    """The grammar did not compile within the budget: the client's spec is too complex."""


class GrammarAbandoned(RuntimeError):
    """Nobody waits for this compile any more; it was stopped."""


class CompilerUnavailable(RuntimeError):
    """No worker could run this compile (closed when the manager stopped, or failed to start)."""


@dataclass(eq=False)
class _Job:
    kind: str
    source: str
    strict: bool
    future: Future = field(default_factory=Future)
    cancelled: bool = False


class _Worker:
    """One child process and its pipes (used by one driver thread only)."""

    def __init__(self, info_json: str) -> None:
        cmd = [sys.executable, "-m", "contbatch.sampling.compile_worker", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     bufsize=0, start_new_session=True)
        self._buffer = b""
        self.proc.stdin.write(info_json.encode() + b"\n")
        reply = self.read_line(time.monotonic() + START_TIMEOUT_S, lambda: False)
        if reply != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start ({reply})")

    def run(self, job: _Job, budget_s: float) -> dict:
        self.proc.stdin.write(json.dumps({"kind": job.kind, "source": job.source, "strict": job.strict}).encode()
                              + b"\n")
        return self.read_line(time.monotonic() + budget_s, lambda: job.cancelled)

    def read_line(self, deadline: float, cancelled) -> dict:
        """The child's next answer; {"timeout": True} past `deadline`, {"cancelled": True} once
        `cancelled()`, {"died": code} if the child ended."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if cancelled():
                return {"cancelled": True}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"timeout": True}
            ready, _, _ = select.select([fd], [], [], min(left, 0.05))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return {"died": self.proc.wait()}
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()


class CompileWorkers:
    """Up to `workers` compiles at once, each in its own process, each within `budget_s`."""

    def __init__(self, info_json: str, workers: int, budget_s: float) -> None:
        self.info_json = info_json
        self.budget_s = budget_s
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self.killed = 0  # workers killed for a compile past its budget or abandoned
        for i in range(workers):
            threading.Thread(target=self._drive, name=f"contbatch-grammar-trial-{i}", daemon=True).start()

    def submit(self, kind: str, source: str, strict: bool) -> Future:
        """A future of {"seconds", "bytes"}, or of the reason it failed."""
        job = _Job(kind, source, strict)
        job.future.job = job  # for cancel()
        if self._closed:
            job.future.set_exception(CompilerUnavailable("the grammar compiler is closed"))
        else:
            self._jobs.put(job)
        return job.future

    def cancel(self, future: Future) -> None:
        """Stop a job nobody waits for: dropped if queued, its process killed if running."""
        job = getattr(future, "job", None)
        if job is not None and not future.done():
            job.cancelled = True
            if future.cancel():  # still queued: it never runs
                return

    def close(self) -> None:
        """Kill every worker now; queued jobs fail. Never waits on a compile."""
        self._closed = True
        with self._lock:
            workers, self._live = list(self._live), set()
        for worker in workers:
            worker.kill()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompilerUnavailable("the grammar compiler was closed"))
        for _ in range(len(workers) + 8):
            self._jobs.put(None)

    # -- a driver thread -----------------------------------------------------------------
    def _drive(self) -> None:
        worker: _Worker | None = None
        while not self._closed:
            if worker is None:  # started before the next job arrives, so it waits warm
                try:
                    worker = self._start()
                except Exception as exc:  # no interpreter, no memory: fail the next job with it
                    logger.warning("contbatch: %s", exc)
                    job = self._jobs.get()
                    if job is not None and job.future.set_running_or_notify_cancel():
                        job.future.set_exception(CompilerUnavailable(f"no grammar compile worker: {exc}"))
                    time.sleep(1.0)
                    continue
            job = self._jobs.get()
            if job is None or self._closed:
                break
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            budget = self.budget_s  # read per job: a change applies to the next one
            try:
                answer = worker.run(job, budget)
            except OSError as exc:  # the child's pipe broke: it died
                answer = {"died": str(exc)}
            if "seconds" in answer:
                job.future.set_result(answer)
                continue
            if "error" in answer:
                job.future.set_exception(ValueError(answer["error"]))
                continue
            self._retire(worker)
            worker = None
            if "timeout" in answer:
                self.killed += 1
                job.future.set_exception(GrammarTooSlow(
                    f"structured output: the grammar did not compile within {budget:g} s, the limit; "
                    "simplify the schema (fewer optional properties, alternatives or counted repetitions)"))
            elif "cancelled" in answer:
                self.killed += 1
                job.future.set_exception(GrammarAbandoned("the grammar compile was abandoned: nobody waits for it"))
            else:
                job.future.set_exception(ValueError(
                    f"structured output: compiling the grammar ended its process ({answer['died']})"))
        if worker is not None:
            self._retire(worker)

    def _start(self) -> _Worker:
        worker = _Worker(self.info_json)
        with self._lock:
            if self._closed:
                worker.kill()
                raise RuntimeError("the grammar compiler is closed")
            self._live.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.kill()
        return None


# -- the child process ---------------------------------------------------------------------
def main() -> None:
    parent = int(sys.argv[1])
    try:  # die with the parent, whatever kills it
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    os.nice(10)  # a compile yields the cores to the engine's steps
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # answers only: whatever a library prints goes to stderr
    os.dup2(2, 1)
    import xgrammar as xgr

    from .structured import json_schema_grammar

    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out.write(b'{"ready": true}\n')
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        try:
            if job["kind"] in ("json", "json_object"):
                compiled = compiler.compile_grammar(json_schema_grammar(job["source"], strict=job["strict"]))
            elif job["kind"] == "regex":
                compiled = compiler.compile_regex(job["source"])
            else:
                compiled = compiler.compile_grammar(job["source"])
            answer = {"seconds": time.perf_counter() - start, "bytes": compiled.memory_size_bytes}
        except Exception as exc:  # the spec was parsed already: this is the backend's own refusal
            from .structured import backend_error

            answer = {"error": f"structured output: the grammar does not compile: {backend_error(exc)}"}
        out.write(json.dumps(answer).encode() + b"\n")


if __name__ == "__main__":
    main()
