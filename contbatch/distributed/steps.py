"""One driver, many workers: what rank 0 sends each step, and the loop the workers run.

Rank 0 alone schedules, samples, detokenizes and answers requests; the workers are forward
executors over their shard of the weights and of the KV heads. Before each forward rank 0
sends the step's batch (token ids, positions, cache slots, block tables: the `StepBatch`
tensors, a few kilobytes for a decode step) and the host-tier copies made since the last one, and
every rank runs the same forward, whose collectives meet in the model's layers.

Why the batch and not the scheduler's inputs: a replicated scheduler would have to see the
same world on every rank, but some of what it sees is rank 0's alone and depends on timing
(a structured-output grammar still compiling on a background thread holds its request back,
a stop string is found by the detokenizer). Sending the batch cannot diverge, costs one small
broadcast a step, and needs no request state on the workers; sampled tokens reach them as
the next step's input ids. The price: the step's inputs must be whole on the host when sent,
so async batching (tokens carried over on the device) is off under TP.

Liveness: a worker that dies or hangs while steps run fails the step (the model's collectives
time out or break). While no step is sent, rank 0 sends a heartbeat every `HEARTBEAT_S` and
waits for every worker's answer, so a rank lost while the engine idles is found as soon (a
dead one within the interval, a hung one after the timeout) rather than at the next request;
and a worker never waits for rank 0 longer than the timeout without hearing from it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.step_batch import StepBatch
from .group import RankFailure, TensorParallel, report_failure

logger = logging.getLogger("contbatch")

_STATE_FIELDS = ("sampled", "chunks")  # request state: rank 0's alone, never sent
HEARTBEAT_S = 1.0  # rank 0 sends a heartbeat when it has sent nothing for this long


def pack_batch(batch: StepBatch) -> dict:
    """The batch's fields but its request state: tensors as NumPy arrays (they pickle small),
    the rest as they are; the sampled rows as their count. Every field is sent, whichever the
    engine adds, so that the workers build the very batch rank 0 runs."""
    out = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if f.name not in _STATE_FIELDS:
            out[f.name] = value.numpy() if isinstance(value, torch.Tensor) else value
    out["num_sampled"] = len(batch.sampled)
    return out


def unpack_batch(packed: dict) -> StepBatch:
    fields = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in packed.items()
              if k != "num_sampled"}
    # The runner counts the sampled rows (the lm-head's rows); which requests they are, it never asks.
    return StepBatch(**fields, sampled=[None] * packed["num_sampled"], chunks=[])


@dataclass
class StepMessage:
    """What rank 0 sends before a forward, `stop` to end the workers' loop, or `ping` (the
    heartbeat: every worker answers with `TensorParallel.answer`)."""

    host_ops: list[tuple[str, tuple]] = field(default_factory=list)  # HostKVTier calls, in order
    batch: dict | None = None  # pack_batch's
    stop: bool = False
    ping: bool = False


class DriverRunner:
    """Rank 0's runner: the engine's own `StepRunner`, which first tells the workers. Any
    failure of a launch is final under TP (the ranks' collectives no longer meet), so the
    first one is kept and raised again from then on; the heartbeat (a thread of its own) keeps
    a failure it finds the same way, for the engine loop's next `check()`. One lock orders
    everything sent on the engine's group: steps, heartbeats, the stop."""

    def __init__(self, runner, tp: TensorParallel, host) -> None:
        # Set before __setattr__ routes anything: these few are ours, the rest the runner's.
        self.__dict__.update(_runner=runner, _tp=tp, _ops=[], failure=None, send_seconds=0.0, sends=0,
                             _lock=threading.Lock(), _last_send=time.monotonic(), _closed=threading.Event())
        host.listener = self._record
        threading.Thread(target=self._heartbeat, name="contbatch-tp-heartbeat", daemon=True).start()

    def __getattr__(self, name):  # only for names not ours: the engine reads the runner through us
        return getattr(self._runner, name)

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self if name in self.__dict__ else self._runner, name, value)

    def _record(self, op: str, args: tuple) -> None:
        self._ops.append((op, tuple(list(a) if isinstance(a, list) else a for a in args)))

    def launch(self, batch: StepBatch, prev):
        with self._lock:
            self.check()  # under the lock: the heartbeat may have found a failure meanwhile
            message = StepMessage(self._ops, pack_batch(batch))
            self._ops = []
            try:
                t0 = time.perf_counter()
                self._tp.send(message)
                self.send_seconds += time.perf_counter() - t0
                self.sends += 1
                self._last_send = time.monotonic()
                return self._runner.launch(batch, prev)
            except Exception as exc:  # raised as the RankFailure: the requests of the step fail with its words
                self._fail(exc if isinstance(exc, RankFailure) else RankFailure(
                    f"a tensor-parallel step failed on rank 0, so the engine stops (a worker rank died or hung, or "
                    f"the step itself failed; the ranks are out of step): {type(exc).__name__}: {str(exc)[:200]}"))
                raise self.failure from exc

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, failure: RankFailure) -> None:
        """Keep the first failure, and report it (`group.on_failure`) once."""
        if self.failure is None:
            self.failure = failure
            self._closed.set()
            report_failure(failure)

    def _heartbeat(self) -> None:
        """While no step is sent: a ping, and every worker's answer within the timeout."""
        while not self._closed.wait(HEARTBEAT_S / 4):
            if time.monotonic() - self._last_send < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue  # a step went out lately, or one is going out now: that is the heartbeat
            try:
                if self.failure is None and not self._closed.is_set():
                    self._tp.send(StepMessage(ping=True))
                    self._tp.answer()
                    self._last_send = time.monotonic()
            except RankFailure as exc:  # logged by the engine loop, which stops on it
                self._fail(exc)
            finally:
                self._lock.release()

    def stats(self) -> dict:
        return {"tp_steps_sent": self.sends, "tp_broadcast_seconds": self.send_seconds}

    def close(self) -> None:
        """Tell the workers to leave their loop (once; not after a failure: they are gone)."""
        self._closed.set()  # no heartbeat from now on
        with self._lock:
            if self.failure is None and self._tp.group is not None:
                try:
                    self._tp.send(StepMessage(self._ops, stop=True))
                except RankFailure as exc:
                    logger.warning("contbatch: could not stop the tensor-parallel workers: %s", exc)
                self.failure = RankFailure("the tensor-parallel workers were stopped with the manager; a stopped TP "
                                           "manager cannot start again")
