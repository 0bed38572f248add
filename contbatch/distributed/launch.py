"""Starting the ranks ourselves: `contbatch generate/serve --tensor-parallel-size N` runs this,
so a user never writes the torchrun line.

One process per rank, each the same command, with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free loopback port). Signals go to rank 0 alone: it
drains, then stops the workers through the engine.

A rank that dies or hangs ends the group, within a bound, with a non-zero exit status, so
that a supervisor restarts it (nothing here restarts a rank: the others' state would no
longer match). Unlike torchrun's agent we do not kill every rank at once: rank 0 fails its
requests with the reason first and drains.
- A worker that dies: rank 0 sees it at once (a step, or the heartbeat within a second, see
  steps.py); its engine stops, so `/health` answers 503; `run_as_rank` then sends rank 0 a
  SIGTERM, which the server takes as a drain, and returns 1 (`cli/ranks.py`). This launcher, which watches
  every rank, logs the death, and kills rank 0 if it is still running `timeout_s()` +
  `WORKER_EXIT_GRACE_S` later.
- A worker that hangs: rank 0 sees it after `CONTBATCH_TP_TIMEOUT` seconds, then as above.
- Rank 0 that dies or hangs: the workers see it at once or after the timeout and exit 1;
  this launcher then gives rank 0 the same bound, then kills it.
Once rank 0 has exited, workers that do not follow are killed (after `WORKER_EXIT_GRACE_S`
when rank 0 stopped them cleanly, `FAILED_EXIT_GRACE_S` when the group failed). The exit
status is rank 0's, or 1 if it was 0 but a worker had died.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .group import timeout_s

logger = logging.getLogger("contbatch")

WORKER_EXIT_GRACE_S = 30.0  # after rank 0 exits cleanly, how long the workers get to follow
FAILED_EXIT_GRACE_S = 5.0  # after the group failed: live workers see rank 0 gone at once
GROUP_FAILED_STATUS = 1  # rank 0's exit status when its group failed (the launcher's too)
POLL_S = 0.2  # how often the launcher looks at its ranks


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
    ran past `timeout`, every rank then killed; 1 if it exited 0 but a worker had died)."""
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
        status, worker_died = _watch(procs, timeout)
        grace = 0.0 if status == 124 else FAILED_EXIT_GRACE_S if status or worker_died else WORKER_EXIT_GRACE_S
        deadline = time.monotonic() + grace
        for rank, proc in enumerate(procs[1:], 1):
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("contbatch: tensor-parallel rank %d did not exit after rank 0; killing it", rank)
                proc.kill()
                proc.wait()
                continue
            if code and not worker_died:
                logger.warning("contbatch: tensor-parallel rank %d %s", rank, _ended(code))
        return GROUP_FAILED_STATUS if status == 0 and worker_died else status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _watch(procs: list[subprocess.Popen], timeout: float | None) -> tuple[int, bool]:
    """Wait for rank 0 to exit, watching the workers: (rank 0's status, whether a worker died
    while rank 0 ran). Rank 0 is killed if it runs past `timeout` (status 124), or past the
    bound after a worker's death (see the module docstring)."""
    start = time.monotonic()
    died_at: float | None = None
    while True:
        status = procs[0].poll()
        if status is not None:
            return status, died_at is not None
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            logger.error("contbatch: rank 0 ran past %.0f s; killing every rank", timeout)
            procs[0].kill()
            procs[0].wait()
            return 124, died_at is not None
        if died_at is None:
            for rank, proc in enumerate(procs[1:], 1):
                code = proc.poll()
                if code:  # 0 is a worker that rank 0 stopped: rank 0 follows
                    died_at = now
                    logger.error("contbatch: tensor-parallel rank %d (pid %d) %s while rank 0 was running: the group "
                                 "cannot go on; rank 0 drains and exits (or is killed in %.0f s), and this launcher "
                                 "exits with status %d", rank, proc.pid, _ended(code),
                                 timeout_s() + WORKER_EXIT_GRACE_S, GROUP_FAILED_STATUS)
                    break
        elif now - died_at > timeout_s() + WORKER_EXIT_GRACE_S:
            logger.error("contbatch: rank 0 still running %.0f s after a worker's death; killing it", now - died_at)
            procs[0].kill()
            return procs[0].wait(), True
        time.sleep(POLL_S)


def _ended(code: int) -> str:
    """How a process ended, from its Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(size: int, cli_argv: Sequence[str]) -> int:
    """`python -m contbatch.cli ARGV` as `size` ranks (the CLI's own entry under TP)."""
    return spawn(size, [sys.executable, "-m", "contbatch.cli", *cli_argv])
