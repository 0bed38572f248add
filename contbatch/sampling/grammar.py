"""Structured output at run time: grammars compiled off the engine thread, one matcher per
request, and one batched token bitmask per step.

- `GrammarCompiler`: one per tokenizer and model vocabulary. A spec is compiled as soon as it
  is submitted, and identical specs share one compile (a bounded LRU of futures, so concurrent
  identical submissions wait on the same work). A small spec (`limits.py`) compiles at once on
  a thread of its own pool; any other is first tried in a worker process under a time budget
  (`compile_worker.py`: killed past `COMPILE_BUDGET_S`, or when everyone waiting for it has
  gone), then compiled here on a second pool, knowing it ends in time. So a slow compile never
  takes the place of a small one, and a shutdown never waits on one (daemon threads, killed
  processes). The request waits in the queue, skipped by the scheduler, until its grammar is
  ready: it never holds up another request or a step.
- `GrammarState`: a request's matcher, advanced by the engine core on every applied token
  (so async batching, which applies a step's tokens one step later, stays in order: the
  sampler only runs after the previous step's tokens are applied). It counts the tokens it
  accepted and replays the request's kept tokens if they ever differ (a soft reset keeps
  tokens, so it normally has nothing to do). Reaching the grammar's end ends the request.
- `GrammarMasks`: each step, one bitmask for the constrained rows, filled in one batched call
  (xgrammar's thread pool) and applied to the logits in one call, before every other
  processor. Unconstrained rows are neither filled nor touched; a step without constrained
  rows costs one scan of the rows. Ids past the tokenizer's vocabulary (padded embedding rows)
  are never allowed. Logprobs are then those of the masked distribution.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from .compile_worker import CompilerUnavailable, CompileWorkers, GrammarAbandoned
from .structured import StructuredOutput, backend_error, json_schema_grammar, xgrammar

CACHE_ENTRIES = 1024
CACHE_BYTES = 512 * 2**20
COMPILE_BUDGET_S = 10.0  # a spec that is not small must compile within this, or it is refused
MAX_GRAMMAR_BYTES = 128 * 2**20  # a compiled grammar larger than this is refused

class GrammarRejected(ValueError):
    """A token the grammar does not allow was applied (a bug, or a mask that was not applied)."""


class DaemonPool:
    """A few daemon threads running calls: unlike `ThreadPoolExecutor`'s, the interpreter
    does not wait for them at exit (a compile in C++ would hold a shutdown for its length)."""

    def __init__(self, threads: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, off the caller's thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] = (), workers: int = 2) -> None:
        xgr = xgrammar()
        if len(tokenizer) > vocab_size:
            raise ValueError(f"structured output needs the model's vocabulary ({vocab_size} ids) to hold every "
                             f"token of the tokenizer ({len(tokenizer)})")
        stops = sorted(stop_token_ids) or None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.vocab_size = vocab_size
        self.workers = workers
        # Our cache holds the futures; xgrammar's own would keep a second copy of each grammar.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._small = DaemonPool(workers, "contbatch-grammar")
        self._large = DaemonPool(workers, "contbatch-grammar-large")
        self._trial_workers: CompileWorkers | None = None  # started on the first spec that is not small
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._trials: dict[tuple[str, str], Future] = {}  # specs being tried in a worker process
        self._waiters: Counter[tuple[str, str]] = Counter()  # callers of compile() not yet served
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of each compiled grammar in the cache
        self._bytes = 0
        self._lock = threading.RLock()  # a done callback may run at once, in the thread that holds it
        self.compiles = 0
        self.cache_hits = 0
        self.compile_seconds = 0.0
        self.abandoned = 0

    def compile(self, spec: StructuredOutput) -> Future:
        """The compiled grammar, as a future: a cached one, or a compile just started. A
        failure is a `ValueError` saying why (`GrammarTooSlow` past the budget)."""
        with self._lock:
            future = self._cache.get(spec.key)
            # A spec that failed is refused again from the cache (a compile past the budget
            # would be past it again); one stopped before it ended is compiled anew.
            if future is not None and not (future.done() and isinstance(future.exception(),
                                                                       (GrammarAbandoned, CompilerUnavailable))):
                self._cache.move_to_end(spec.key)
                self.cache_hits += 1
                if not future.done():
                    self._waiters[spec.key] += 1
                return future
            if spec.small:
                future = self._small.submit(self._compile, spec)
            else:
                future = Future()
                trial = self._trial_pool().submit(spec.kind, spec.source, spec.kind == "json")
                self._trials[spec.key] = trial
                trial.add_done_callback(lambda t, spec=spec, future=future: self._tried(spec, future, t))
            self._cache[spec.key] = future
            self._waiters[spec.key] = 1
            self.compiles += 1
            future.add_done_callback(lambda f, key=spec.key: self._sized(key, f))
            self._evict()
            return future

    def abandon(self, spec: StructuredOutput) -> None:
        """One caller of `compile(spec)` no longer waits (its client has gone). When nobody
        waits any more, a compile still being tried in a worker process is stopped."""
        with self._lock:
            key = spec.key
            self._waiters[key] -= 1
            if self._waiters[key] > 0:
                return
            del self._waiters[key]
            trial = self._trials.get(key)
            if trial is not None and self._trial_workers is not None:
                self.abandoned += 1
                self._trial_workers.cancel(trial)

    def state(self, spec: StructuredOutput, stop_ids: Sequence[int]) -> GrammarState:
        return GrammarState(self.compile(spec), sorted(stop_ids) or None, self.vocab_size)

    def close(self) -> None:
        """Kill the worker processes now (compiles tried there fail); never waits."""
        with self._lock:
            workers, self._trial_workers = self._trial_workers, None
        if workers is not None:
            workers.close()

    def _trial_pool(self) -> CompileWorkers:
        if self._trial_workers is None:
            # One process on small machines: a compile there competes with the engine's steps.
            processes = 1 if (os.cpu_count() or 1) <= 4 else self.workers
            self._trial_workers = CompileWorkers(self.info.serialize_json(), processes, COMPILE_BUDGET_S)
        self._trial_workers.budget_s = COMPILE_BUDGET_S
        return self._trial_workers

    def _tried(self, spec: StructuredOutput, future: Future, trial: Future) -> None:
        """A worker process tried the spec: compile it here if it fit, else fail `future`."""
        with self._lock:
            self._trials.pop(spec.key, None)
            self._waiters.pop(spec.key, None)
        if trial.cancelled():
            error: BaseException | None = GrammarAbandoned("the grammar compile was abandoned: nobody waits for it")
        else:
            error = trial.exception()
        if error is None and trial.result()["bytes"] > MAX_GRAMMAR_BYTES:
            error = ValueError(f"structured output: the compiled grammar would take "
                               f"{trial.result()['bytes'] / 2**20:.0f} MiB; at most {MAX_GRAMMAR_BYTES // 2**20} "
                               "MiB are allowed")
        if error is not None:
            future.set_exception(error)
            return
        done = self._large.submit(self._compile, spec)
        done.add_done_callback(lambda d: future.set_exception(d.exception()) if d.exception() is not None
                               else future.set_result(d.result()))

    def _compile(self, spec: StructuredOutput):
        t0 = time.perf_counter()
        c = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                compiled = c.compile_grammar(json_schema_grammar(spec.source, strict=spec.kind == "json"))
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.source)
            else:
                compiled = c.compile_grammar(spec.source)
        except Exception as exc:  # the spec was checked when built: this is the backend's own failure
            raise RuntimeError(backend_error(exc)) from None
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - t0
        return compiled

    def _sized(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            self._waiters.pop(key, None)
            if self._cache.get(key) is future and future.exception() is None:
                self._sizes[key] = future.result().memory_size_bytes
                self._bytes += self._sizes[key]
                self._evict()

    def _evict(self) -> None:
        """Oldest compiled grammars go first, past an entry or a byte budget (running requests
        keep theirs: they hold the future)."""
        while len(self._cache) > CACHE_ENTRIES or (self._bytes > CACHE_BYTES and len(self._cache) > 1):
            key, _ = self._cache.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)

    def stats(self) -> dict:
        with self._lock:
            return {"compiles": self.compiles, "cache_hits": self.cache_hits, "compile_seconds": self.compile_seconds,
                    "cached": len(self._cache), "cached_bytes": self._bytes, "abandoned": self.abandoned,
                    "killed": self._trial_workers.killed if self._trial_workers else 0}


class GrammarState:
    """One request's position in its grammar; used on the engine thread only."""

    __slots__ = ("future", "stop_ids", "vocab_size", "matcher", "accepted")

    def __init__(self, future: Future, stop_ids: list[int] | None, vocab_size: int) -> None:
        self.future = future
        self.stop_ids = stop_ids  # the request's own stop tokens end the grammar (None: the tokenizer's)
        self.vocab_size = vocab_size
        self.matcher = None  # built when the request first samples
        self.accepted = 0  # tokens the matcher has accepted

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the scheduler may admit the request."""
        return self.future.done()

    @property
    def error(self) -> str | None:
        if not self.future.done() or self.future.exception() is None:
            return None
        return f"compiling the structured-output grammar failed: {self.future.exception()}"

    @property
    def active(self) -> bool:
        """Still constraining: not past its end."""
        return self.matcher is None or not self.matcher.is_terminated()

    def _matcher(self):
        if self.matcher is None:
            self.matcher = xgrammar().GrammarMatcher(self.future.result(), override_stop_tokens=self.stop_ids)
        return self.matcher

    def sync(self, tokens: Sequence[int]):
        """The matcher after exactly `tokens` (the request's kept tokens): rebuilt by replaying
        them if it saw more, caught up if it saw fewer; normally already there."""
        matcher = self._matcher()
        if self.accepted > len(tokens):
            matcher.reset()
            self.accepted = 0
        for token in tokens[self.accepted:]:
            self._accept(token)
        return matcher

    def advance(self, token: int) -> bool:
        """Accept one applied token; True once the grammar has reached its end."""
        self._accept(token)
        return self.matcher.is_terminated()

    def _accept(self, token: int) -> None:
        matcher = self._matcher()
        if not matcher.accept_token(token):
            raise GrammarRejected(f"token {token} is not allowed by the request's structured-output grammar")
        self.accepted += 1


class GrammarMasks:
    """The batched bitmask of one sampler: a reused buffer, one fill and one apply per step."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None
        self._batch = None  # xgrammar's BatchGrammarMatcher (its fill thread pool), made on first use
        self.seconds = 0.0  # spent filling and applying masks: the cost of structured output
        self.steps = 0
        self.rows = 0

    def apply(self, logits: torch.Tensor, reqs: Sequence) -> None:
        """Mask, in place, every row whose request has an active grammar (`reqs[i].grammar`,
        with `reqs[i].generated` its kept tokens) to the tokens its grammar allows."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]
        if not rows:
            return
        t0 = time.perf_counter()
        xgr = xgrammar()
        matchers = [reqs[i].grammar.sync(reqs[i].generated) for i in rows]
        vocab = reqs[rows[0]].grammar.vocab_size
        bitmask = self._buffer(len(reqs), (vocab + 31) // 32)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        apply_bitmask(logits, bitmask, rows, vocab)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        self.rows += len(rows)

    def _buffer(self, num_rows: int, words: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(num_rows, 8), words, dtype=torch.int32)
        return self._bitmask[:num_rows]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """Masked ids -> -inf in `rows` of `logits`, in one call; ids past the grammar's
    vocabulary (a wider lm_head than the embedding) are never allowed either."""
    width = logits.shape[1]
    xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, width), indices=rows)
    if width > vocab:
        logits[torch.tensor(rows, device=logits.device), vocab:] = float("-inf")


def wait_for_grammars(states, timeout: float) -> None:
    """Sleep until one of these requests' grammars is ready, or `timeout` passes: an engine
    with nothing else to run waits here instead of spinning."""
    pending = [s.grammar.future for s in states if s.grammar is not None and not s.grammar.ready]
    if pending:
        wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
