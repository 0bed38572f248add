"""Starting the ranks ourselves: `contbatch generate/serve --tensor-parallel-size N` runs this,
so a user never writes the torchrun line.

One process per rank, each the same command, with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free loopback port). Unlike torchrun's agent we do
not kill every rank when one dies: rank 0 notices a dead worker itself and fails its requests
with a clear error, and its exit status is the launcher's. Signals go to rank 0 alone: it
drains, then stops the workers through the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger("contbatch")

WORKER_EXIT_GRACE_S = 30.0  # after rank 0 exits, how long the workers get to follow


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Rank 0 gets SIGTERM if the launcher dies (Linux): it drains and stops the workers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_env(rank: int, size: int, port: int, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # On the CPU the ranks share the cores: without this each would start a pool of all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    return env


def spawn(size: int, command: Sequence[str], timeout: float | None = None, env: dict | None = None) -> int:
    """Run `command` as `size` ranks on this machine; returns rank 0's exit status (124 if it
    ran past `timeout`, every rank then killed)."""
    port = free_port()
    # Each rank in its own session: a terminal's Ctrl-C reaches the launcher alone, which passes
    # it to rank 0 once (workers killed by it would fail the requests rank 0 is draining).
    procs = [subprocess.Popen(list(command), env=rank_env(r, size, port, env), start_new_session=True,
                              preexec_fn=_die_with_parent if r == 0 else None) for r in range(size)]
    logger.info("contbatch: started %d tensor-parallel ranks (pids %s) on 127.0.0.1:%d", size,
                ", ".join(str(p.pid) for p in procs), port)

    def forward(signum, _frame):  # rank 0 drains and stops the workers itself
        procs[0].send_signal(signum)

    main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        try:
            status = procs[0].wait(timeout)
        except subprocess.TimeoutExpired:
            logger.error("contbatch: rank 0 ran past %.0f s; killing every rank", timeout)
            status = 124
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(WORKER_EXIT_GRACE_S if status != 124 else 0)
            except subprocess.TimeoutExpired:
                logger.warning("contbatch: rank %d did not exit after rank 0; killing it", rank)
                proc.kill()
                code = proc.wait()
            if rank and code:
                logger.warning("contbatch: rank %d exited with status %d", rank, code)
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def launch(size: int, cli_argv: Sequence[str]) -> int:
    """`python -m contbatch.cli ARGV` as `size` ranks (the CLI's own entry under TP)."""
    return spawn(size, [sys.executable, "-m", "contbatch.cli", *cli_argv])


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
    from ..models import check_tp_model

    check_tp_model(args.model, size)  # refused here, before any rank starts
    return launch(size, args.argv)


def run_as_rank(model, drive: Callable[[], int]) -> int:
    """Rank 0 (or one process) runs `drive`; a worker rank runs rank 0's steps until stopped.
    Either way the default group, initialized by `load_model`, is destroyed here at the end."""
    import torch.distributed as dist

    from .group import RankFailure, model_tp_size
    from .steps import run_worker

    if model_tp_size(model) == 1:
        return drive()
    try:
        if dist.get_rank() == 0:
            return drive()
        try:
            run_worker(model)
            return 0
        except RankFailure as exc:
            logger.error("contbatch: %s", exc)
            return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
