"""The long-lived engine: a background thread that steps the model while requests come and go.

The manager is the front end: it validates submissions (`submission.py`), runs the thread,
and keeps the results (`results.py`); the thread drives the `EngineCore` (`core.py`), which
owns the scheduler, the cache and the runner. Other threads talk to the engine only through
thread-safe structures: an inbox queue for commands (add, cancel, wake) and the
`ResultStore` for what comes back. Request state is touched by the engine thread alone.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import torch

from ..attention.paged import attach, detach
from ..cache.paged_cache import PagedAttentionCache
from ..config import ContinuousBatchingConfig, ResolvedConfig
from ..cpu.routers import CpuRouters
from ..requests import GenerationOutput, RequestState, RequestStatus
from ..runtime.core import EngineCore
from ..runtime.step_runner import RunnerFailure
from ..sampling.params import SamplingParams
from ..sampling.structured import StructuredOutput
from ..scheduling.scheduler import Scheduler
from ..setup.build import build_engine
from ..setup.loading import load_draft
from ..setup.resolve import describe
from ..speculative.speculator import make_speculator
from .adapter_api import AdapterControl, EngineAdapters
from .control import CONTROL, AdminLock, EngineControl
from .results import ResultStore
from .stopping import stop_defaults
from .submission import RequestBuilder, prefix_order
from .threads import release_openmp_pool
from .warmup import warm_up

logger = logging.getLogger("contbatch")

_IDLE_POLL_S = 0.05


class ContinuousBatchingManager(EngineControl, AdapterControl):
    def __init__(self, model: torch.nn.Module, generation_config=None, config: ContinuousBatchingConfig | None = None,
                 tokenizer=None) -> None:
        self.model = model
        built = build_engine(model, config, self._publish)  # a model it cannot run exactly: ValueError
        self.config = built.config
        self.resolved_config: ResolvedConfig = built.resolved
        self.tensor_parallel = built.group  # rank 0 drives; the other ranks run its steps (engine/worker.py)
        self.defaults = stop_defaults(model, generation_config)
        self.tokenizer = tokenizer
        vocab = model.get_input_embeddings().num_embeddings
        self._builder = RequestBuilder(self.resolved_config, self.defaults, vocab, tokenizer)
        self.core: EngineCore | None = built.core
        r = self.resolved_config
        if r.speculative is not None:
            self.core.speculator = make_speculator(r.speculative, r, load_draft(r.speculative, model))
        self._inbox: queue.Queue = queue.Queue()
        self._results = ResultStore()
        self._samples: dict[str, list[str]] = {}  # parent id -> ids of its n > 1 samples
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_mode: str | None = None  # None, "graceful", "hard"
        self._saved_attn: str | None = None
        self._routers: CpuRouters | None = None
        self._warm = threading.Event()  # compiled steps are warmed up (set at once without compile)
        self._paused = False  # no step is scheduled while set; requests wait with their KV
        self._admin = AdminLock()  # admin commands (control.py) one at a time
        self._adapters = EngineAdapters(model, self.resolved_config, self.tensor_parallel)  # LoRA (adapter_api.py)

    @property
    def cache(self) -> PagedAttentionCache | None:
        return self.core.cache if self.core else None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler if self.core else None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, *, wait_warm: bool = True) -> None:
        """Start the engine thread. With compiled steps it first warms them up (compiles the
        decode and varlen paths on a few internal requests): `wait_warm=False` returns at once
        and `is_warm()` tells when that is done (the server answers 503 until then)."""
        if self.core is None:
            raise RuntimeError("this manager was destroyed; create a new one")
        self._check_driver("start")
        if self.is_running():
            logger.warning("contbatch manager already running; start() ignored")
            return
        self.core.runner.check()  # a tensor-parallel group: its workers were stopped with it, or are gone
        r = self.resolved_config
        self._saved_attn = attach(self.model)
        self._routers = CpuRouters(self.model, r.cpu)
        self._routers.install()
        self._adapters.hooks.sync()
        logger.info(describe(r))
        for warning in r.warnings:
            logger.warning("contbatch: %s", warning)
        self._stop_mode = None
        self._accepting = True
        # The forward must be the only OpenMP pool on these cores: the caller's (it usually
        # loaded the model) would make every parallel op of the engine thread sleep and wake.
        release_openmp_pool()
        self._thread = threading.Thread(target=self._run, name="contbatch-engine", daemon=True)
        self._thread.start()
        self._warm.clear()
        if r.decode_compile is None and r.varlen_compile is None:
            self._warm.set()
        elif wait_warm:
            warm_up(self)
        else:
            threading.Thread(target=warm_up, args=(self,), name="contbatch-warmup", daemon=True).start()

    def is_warm(self) -> bool:
        return self._warm.is_set()

    def stop(self, hard_stop: bool = False, timeout: float | None = None) -> None:
        """Graceful: finish everything submitted. Hard: fail what is not finished.

        From the engine thread itself (a result handler) it only asks the loop to end: the
        thread cannot wait for itself, and it detaches the model on its way out."""
        self._accepting = False
        thread = self._thread
        if thread is None:
            return
        self._stop_mode = "hard" if hard_stop else (self._stop_mode or "graceful")
        self._paused = False  # a graceful stop finishes what was submitted, paused or not
        self._inbox.put(("wake", None))
        if thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("contbatch engine thread still running after %.1fs; forcing a hard stop", timeout or 0)
            self._stop_mode = "hard"
            thread.join()
        self._thread = None
        # Anything that slipped into the inbox as the thread exited still gets an answer.
        self._fail_all("manager stopped before the request was scheduled")
        self._builder.close_grammars()  # grammar compile worker processes (compiled grammars stay cached)

    def destroy(self) -> None:
        """Stop (hard) and free the KV cache; the manager cannot start again. Under tensor
        parallelism it also releases the engine's own process group (idempotent)."""
        self.stop(hard_stop=True)
        if self.core is not None:
            self.core.runner.close()  # tensor parallelism, never started: the workers still wait for a first step
        self.core = None
        if self.tensor_parallel is not None:
            self.tensor_parallel.destroy()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- submission (any thread) ---------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        queue_chunks: bool = True,
        adapter: str | None = None,
    ) -> str:
        """Queue one prompt (token ids, a 1-D tensor, or a tokenizer's `BatchEncoding`).

        `streaming=True` produces incremental outputs, passed to result handlers and queued
        for `request_id_iter`; a caller that reads them through a handler alone (the HTTP
        server does) passes `queue_chunks=False` so that nothing is kept for a reader who
        never comes. `adapter` names a loaded LoRA adapter (`load_adapter`); None: the base model."""
        self._check_running()
        states = self._builder.build(input_ids, request_id, max_new_tokens, streaming, eos_token_id, sampling_params)
        self._adapters.attach([states], [adapter])
        self._submit([states], queue_chunks)
        return states[0].parent_id

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        request_ids: Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        queue_chunks: bool = True,
        adapters: Sequence[str | None] | None = None,
    ) -> list[str]:
        """Submit many at once, all validated before any is queued; `adapters`: a LoRA adapter
        name or None per input. With prefix sharing on, one request per distinct leading block
        goes first and the others follow grouped by prefix: the leaders compute the shared
        blocks, and the followers, admitted in later steps, find them cached. Returns ids in
        input order."""
        self._check_running()
        if request_ids is not None and len(request_ids) != len(inputs):
            raise ValueError(f"got {len(request_ids)} request ids for {len(inputs)} inputs")
        if isinstance(sampling_params, Sequence) and len(sampling_params) != len(inputs):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(inputs)} inputs")
        ids = request_ids or [None] * len(inputs)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(inputs)
        groups = [
            self._builder.build(x, rid, max_new_tokens, streaming, None, p) for x, rid, p in zip(inputs, ids, params)
        ]
        self._adapters.attach(groups, adapters)
        dupes = len(groups) - len({g[0].parent_id for g in groups})
        if dupes:
            raise ValueError(f"{dupes} duplicate request ids in one add_requests call")
        self._submit(groups if not self.resolved_config.allow_block_sharing else
                     prefix_order(groups, self.resolved_config.block_size), queue_chunks)
        return [g[0].parent_id for g in groups]

    def compile_grammar(self, spec: StructuredOutput) -> Future:
        """Start compiling a structured-output spec, or find it compiled, before submitting it:
        a server awaits this future to answer a spec that does not compile (a `ValueError`, such
        as `GrammarTooSlow`) with 400 before the request is queued, and calls `abandon_grammar`
        when its client has gone (a compile nobody waits for is stopped)."""
        return self._builder.grammar_compiler().compile(spec)

    def abandon_grammar(self, spec: StructuredOutput) -> None:
        self._builder.grammar_compiler().abandon(spec)

    def cancel_request(self, request_id: str) -> None:
        self._check_driver("cancel_request")
        self._inbox.put(("cancel", request_id))

    def _check_driver(self, call: str) -> None:
        tp = self.tensor_parallel
        if tp is not None and not tp.is_driver:
            raise RuntimeError(f"{call}() on {tp.describe()}: only rank 0 takes requests and commands; run "
                               "contbatch.engine.run_worker(model) on the other ranks")

    def _check_running(self) -> None:
        self._check_driver("add_request")
        if not self._accepting or not self.is_running():
            raise RuntimeError("the manager is not running: call start() before adding requests")

    def _submit(self, groups: list[list[RequestState]], queue_chunks: bool = True) -> None:
        with self._results.lock():  # the engine thread stops accepting under the same lock
            if not self._accepting:
                raise RuntimeError("the manager is not running: call start() before adding requests")
            self._results.register(groups, self.resolved_config.max_queue_size, queue_chunks)
            for states in groups:
                if len(states) > 1:
                    self._samples[states[0].parent_id] = [s.request_id for s in states]
                for state in states:
                    state.arrival = next(self._arrivals)
                    self._inbox.put(("add", state))

    # -- results (any thread) ------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """With an id: wait for that request. Without: the next finished one. None on timeout."""
        self._check_driver("get_result")
        return self._results.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Finished results as they come, until nothing submitted is left unretrieved."""
        while True:
            out = self.get_result(timeout=_IDLE_POLL_S)
            if out is not None:
                yield out
            elif self._results.idle():
                return

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Incremental outputs of one request; the last one is final and is also retrieved.
        Waiting more than `timeout` seconds for the next output raises TimeoutError."""
        self._check_driver("request_id_iter")
        chunks = self._results.stream(request_id, timeout)
        if chunks is not None:
            yield from chunks
            return
        out = self.get_result(request_id, timeout)
        if out is None:
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout}s; it is still running")
        yield out

    def register_result_handler(self, callback: Callable[[GenerationOutput], None]) -> None:
        """Called from the engine thread with every streamed chunk and every final result."""
        self._results.handlers.append(callback)

    def _publish(self, state: RequestState) -> None:
        """The core's output: a streamed chunk, or a request's end (engine thread)."""
        self._adapters.finished(state)
        if state.status.is_done and state.detokenizer is not None:
            try:
                state.delta_text += state.detokenizer.update(state.known_tokens, final=True)
            except Exception as exc:  # its text cannot be made: the request fails, nothing else
                logger.exception("detokenizing %s failed", state.request_id)
                state.finish(RequestStatus.FAILED, "error", f"detokenizing the output failed: {exc!r}")
        self._results.publish(state, state.parent_id or state.request_id)
        # The store ends the parent only once its last sample has ended.
        if state.parent_id in self._samples and state.parent_id not in self._results.live:
            del self._samples[state.parent_id]

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():  # once for the thread, not per step
                self._loop()
        finally:  # however the loop ended (stop(), a crash): the model is the user's again
            self.core.runner.close()  # tensor parallelism: graceful, drained already; hard, failed below
            with self._results.lock():  # no submission gets past this point any more...
                self._accepting = False
            self._fail_all("manager stopped before the request was scheduled")  # ...and any that did is answered
            if self._saved_attn is not None:
                detach(self.model, self._saved_attn)
                self._saved_attn = None
                self._routers.uninstall()
                self._adapters.close()
            if self.core is not None and self.core.speculator is not None:
                self.core.speculator.close()

    def _loop(self) -> None:
        try:
            while True:
                self._drain_inbox(block=self._paused or not (self.core.has_work() or self.core.cache.populate_ahead()))
                self._adapters.retry(self.core)  # requests that wait for an adapter slot, freed since
                if self._stop_mode == "hard":
                    break
                busy = self.core.has_work() and not self._paused
                if self._stop_mode == "graceful" and not busy and self._inbox.empty():
                    break
                if busy:
                    self.core.step()
                self.core.runner.check()  # busy or idle: a tensor-parallel rank gone stops here, failing everything
        except Exception as exc:  # a bug in the loop itself, or a rank gone: fail everything, lose nothing
            if isinstance(exc, RunnerFailure):  # the reason is the whole story: no traceback
                logger.error("contbatch engine stopped: %s", exc)
            else:
                logger.exception("contbatch engine loop crashed")
            with self._results.lock():
                self._accepting = False
            self._fail_all(str(exc) if isinstance(exc, RunnerFailure) else f"engine loop crashed: {exc!r}")
            return
        if self._stop_mode == "hard":
            self._fail_all("manager stopped (hard stop) before the request finished")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._adapters.admit(payload, self.core)
            elif kind == "cancel":
                for rid in self._samples.get(payload, [payload]):
                    self._adapters.cancel(rid, self.core)
            elif kind in CONTROL:
                try:
                    result = self._do_control(kind, payload[0])
                except Exception as exc:  # handed to the caller, who raises it
                    self._answer(payload, error=exc)
                else:
                    self._answer(payload, result)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, reason: str) -> None:
        """Fail every request the engine holds, and those still in the inbox."""
        pending = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                pending.append(payload)
            elif kind in CONTROL:  # a caller waits on it: answer, never leave it hanging
                self._answer(payload, error=RuntimeError("the manager stopped before the command ran"))
        if self.core is not None:
            self.core.fail_all(reason, pending + self._adapters.take_held())

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for tests, logs and the server's metrics (read without locking: a
        snapshot may mix values from two consecutive steps)."""
        core = self.core.stats() if self.core else {}
        return {
            **core,
            "live_sequences": self._results.live_sequences,  # submitted, not finished (n samples each)
            "stream_queues": self._results.num_streams,  # streams whose final chunk is not read yet
            **(self.core.runner.stats() if self.core else {}), **self._adapters.stats(),
        }
