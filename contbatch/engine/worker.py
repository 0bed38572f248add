"""The life of a tensor-parallel worker rank: build the same engine as rank 0, run the steps
rank 0 sends until it says stop, and end loudly if rank 0 goes away.

Workers hold no request state: rank 0 schedules, samples, detokenizes and applies grammars;
a worker's forwards are its shard of each step, which the model's own collectives join. A
worker that cannot run a step must end (rank 0 then sees it and fails its requests): it never
diverges.
"""

from __future__ import annotations

import logging

import torch

from ..attention.paged import attach, detach
from ..distributed.group import RankFailure, TensorParallel
from ..distributed.steps import StepMessage, unpack_batch
from ..setup.resolve import describe
from .manager import ContinuousBatchingManager

logger = logging.getLogger("contbatch")


def run_worker_loop(manager) -> int:
    """A worker rank: run rank 0's steps until it says stop; returns the steps run. Raises
    RankFailure when rank 0 goes away or a step cannot run here (rank 0 died mid-forward, or
    the forward itself failed): a worker that cannot run a step must end, so that rank 0 sees
    it and fails its requests, never diverge."""
    tp: TensorParallel = manager.tensor_parallel
    core = manager.core
    logger.info("contbatch: %s; %s", tp.describe(), describe(manager.resolved_config))
    saved = attach(manager.model)
    steps = 0
    try:
        with torch.inference_mode():
            while True:
                message: StepMessage = tp.recv()
                if message.ping:
                    tp.answer()
                    continue
                for op, args in message.host_ops:
                    getattr(core.host, op)(*args)
                if message.stop:
                    return steps
                try:
                    batch = unpack_batch(message.batch)
                    core.cache.make_resident(batch.block_table)
                    core.runner.launch(batch, None)
                except Exception as exc:
                    raise RankFailure(f"{tp.describe()} could not run step {steps + 1} (rank 0 died or hung "
                                      f"mid-step, or the forward failed here): {type(exc).__name__}: "
                                      f"{str(exc)[:200]}") from exc
                steps += 1
    finally:
        detach(manager.model, saved)


def run_worker(model: torch.nn.Module, generation_config=None) -> int:
    """The whole life of a worker rank: build the engine (rank 0's config arrives at start),
    run rank 0's steps until it stops, release the engine's group. Returns the steps run."""
    manager = ContinuousBatchingManager(model, generation_config)
    try:
        steps = run_worker_loop(manager)
        logger.info("contbatch: %s stopped by rank 0 after %d steps", manager.tensor_parallel.describe(), steps)
        return steps
    finally:
        manager.destroy()
