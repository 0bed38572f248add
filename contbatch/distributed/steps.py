"""One driver, many workers: what rank 0 sends each step, and the loop the workers run.

Rank 0 alone schedules, samples, detokenizes and answers requests; the workers are forward
executors over their shard of the weights and of the KV heads. Before each forward rank 0
sends the step's batch (token ids, positions, cache slots, block tables: the `StepBatch`
tensors, tens of kilobytes at most) and the host-tier copies made since the last one, and
every rank runs the same forward, whose collectives meet in the model's layers.

Why the batch and not the scheduler's inputs: a replicated scheduler would have to see the
same world on every rank, but some of what it sees is rank 0's alone and depends on timing
(a structured-output grammar still compiling on a background thread holds its request back,
a stop string is found by the detokenizer). Sending the batch cannot diverge, costs one small
broadcast a step, and needs no request state on the workers; sampled tokens reach them as
the next step's input ids. The price: the step's inputs must be whole on the host when sent,
so async batching (tokens carried over on the device) is off under TP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.step_batch import StepBatch
from .group import RankFailure, TensorParallel

logger = logging.getLogger("contbatch")

_TENSORS = ("input_ids", "carry", "positions", "write_slots", "cu_seqlens_q", "kv_lens", "block_table",
            "logits_indices")


@dataclass
class StepMessage:
    """What rank 0 sends before a forward, or `stop` to end the workers' loop."""

    host_ops: list[tuple[str, tuple]] = field(default_factory=list)  # HostKVTier calls, in order
    batch: dict[str, np.ndarray] | None = None
    stop: bool = False


class DriverRunner:
    """Rank 0's runner: the engine's own `StepRunner`, which first tells the workers. Any
    failure of a launch is final under TP (the ranks' collectives no longer meet), so the
    first one is kept and raised again from then on."""

    def __init__(self, runner, tp: TensorParallel, host) -> None:
        self.__dict__.update(_runner=runner, _tp=tp, _ops=[], failure=None, send_seconds=0.0, sends=0)
        host.listener = self._record

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value) -> None:
        target = self if name in self.__dict__ else self._runner
        object.__setattr__(target, name, value)

    def _record(self, op: str, args: tuple) -> None:
        self._ops.append((op, tuple(list(a) if isinstance(a, list) else a for a in args)))

    def launch(self, batch: StepBatch, prev):
        self.check()
        message = StepMessage(self._ops, {name: getattr(batch, name).numpy() for name in _TENSORS})
        self.__dict__["_ops"] = []
        try:
            t0 = time.perf_counter()
            self._tp.send(message)
            self.__dict__["send_seconds"] += time.perf_counter() - t0
            self.__dict__["sends"] += 1
            return self._runner.launch(batch, prev)
        except Exception as exc:
            if self.failure is None:
                reason = exc if isinstance(exc, RankFailure) else RankFailure(
                    f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {str(exc)[:200]}); the ranks "
                    "are out of step, so the engine stops")
                self.__dict__["failure"] = reason
            raise

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def stop_workers(self) -> None:
        """Tell the workers to leave their loop (once; not after a failure: they are gone)."""
        if self.failure is None and self._tp.group is not None:
            try:
                self._tp.send(StepMessage(self._ops, stop=True))
            except RankFailure as exc:
                logger.warning("contbatch: could not stop the tensor-parallel workers: %s", exc)
            self.__dict__["failure"] = RankFailure("the tensor-parallel workers were stopped with the manager; "
                                                   "a stopped TP manager cannot start again")


def run_worker_loop(manager) -> int:
    """A worker rank: run rank 0's steps until it says stop; returns the steps run. Raises
    RankFailure when rank 0 goes away, and any error of its own forward: a worker that cannot
    run a step must end, so that rank 0 sees it and fails its requests, never diverge."""
    from ..attention.paged import attach, detach

    from ..engine.resolve import describe

    tp: TensorParallel = manager.tensor_parallel
    core = manager.core
    logger.info("contbatch: %s; %s", tp.describe(), describe(manager.resolved_config))
    saved = attach(manager.model)
    steps = 0
    try:
        with torch.inference_mode():
            while True:
                message: StepMessage = tp.recv()
                for op, args in message.host_ops:
                    getattr(core.host, op)(*args)
                if message.stop:
                    return steps
                batch = message.batch
                tensors = {name: torch.from_numpy(batch[name]) for name in _TENSORS}
                rows = [None] * len(tensors["logits_indices"])  # only counted: no request state here
                core.runner.launch(StepBatch(**tensors, sampled=rows, chunks=[]), None)
                steps += 1
    finally:
        detach(manager.model, saved)


def run_worker(model: torch.nn.Module, generation_config=None) -> int:
    """The whole life of a worker rank: build the engine (rank 0's config arrives at start),
    run rank 0's steps until it stops, release the engine's group. Returns the steps run."""
    from ..engine.manager import ContinuousBatchingManager

    manager = ContinuousBatchingManager(model, generation_config)
    try:
        steps = run_worker_loop(manager)
        logger.info("contbatch: %s stopped by rank 0 after %d steps", manager.tensor_parallel.describe(), steps)
        return steps
    finally:
        manager.destroy()
