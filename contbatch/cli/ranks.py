"""`--tensor-parallel-size N` for the CLI's commands: start N ranks of this same command
(`distributed.launch`), and in each, run rank 0's command or a worker's life; a group that
fails ends the process with `GROUP_FAILED_STATUS`, so that a supervisor restarts it."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from ..distributed.group import RankFailure, model_tp_size, on_failure
from ..distributed.launch import GROUP_FAILED_STATUS, launch
from ..engine.worker import run_worker
from ..setup.loading import check_tp_model

logger = logging.getLogger("contbatch")


def launch_ranks(args) -> int | None:
    """The CLI's `--tensor-parallel-size N`: outside a rank (no WORLD_SIZE), check that N fits
    the model, start the N ranks and return rank 0's exit status; inside one, None (go on)."""
    size = args.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"--tensor-parallel-size {size} but this process is one of WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']} ranks")
        return None
    if size == 1:
        return None
    check_tp_model(args.model, size)  # refused here, before any rank starts
    return launch(size, args.argv)


def run_as_rank(model, drive: Callable[[], int]) -> int:
    """Rank 0 (or one process) runs `drive`; a worker rank runs rank 0's steps until stopped.
    Either way the default group, initialized by `load_model`, is destroyed here at the end,
    unless the group failed (a dead peer may keep the teardown waiting; the process exits).

    Rank 0 whose group fails while `drive` runs logs it once, returns GROUP_FAILED_STATUS,
    and, if the process has a SIGTERM handler (the server's: a drain), sends itself SIGTERM,
    so that a server whose engine can no longer answer ends instead of answering 503 forever.
    Without one (`contbatch generate`), `drive` ends on its own: its requests fail."""
    import torch.distributed as dist

    if model_tp_size(model) == 1:
        return drive()
    failures: list[RankFailure] = []
    try:
        if dist.get_rank() == 0:
            remove = on_failure(lambda failure: _end_rank0(failure, failures))
            try:
                status = drive()
            finally:
                remove()
            return GROUP_FAILED_STATUS if failures else status
        try:
            run_worker(model)
            return 0
        except RankFailure as exc:
            failures.append(exc)
            logger.error("contbatch: %s", exc)
            return GROUP_FAILED_STATUS
    finally:
        if dist.is_initialized() and not failures:
            dist.destroy_process_group()


def _end_rank0(failure: RankFailure, failures: list[RankFailure]) -> None:
    """Rank 0's reaction to its group failing (any thread): record it, say it once, end."""
    failures.append(failure)
    handler = signal.getsignal(signal.SIGTERM)
    ending = "this server drains and exits" if callable(handler) else "this run ends"
    logger.error("contbatch: the tensor-parallel group failed, so %s with status %d (for a supervisor to restart "
                 "it): %s", ending, GROUP_FAILED_STATUS, failure)
    if callable(handler):
        os.kill(os.getpid(), signal.SIGTERM)
