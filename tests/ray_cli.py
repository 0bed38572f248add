"""Helpers for tests/test_ray.py: `contbatch serve --ray-replicas` run as a process of its own
(with a Ray runtime of its own, found and checked through the processes it leaves), and a
stand-in for a replica call as the front sees one. Kept out of the test module for its size.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray

TAG_ENV = "CONTBATCH_TEST_RAY_CLI"  # in the environment every process of one CLI run inherits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, ray.exceptions.RayError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class FakeCall:
    """A replica call as the front sees it: `parts`, then (with `stall`) nothing until cancelled,
    when it raises as Serve's response generator does."""

    def __init__(self, parts: list[bytes], stall: bool = False) -> None:
        self.parts, self.stall, self.cancelled = list(parts), stall, asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self.parts:
            await asyncio.sleep(0.01)
            return self.parts.pop(0)
        if self.stall:
            await self.cancelled.wait()
            raise RuntimeError("request cancelled")
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled.set()


SSE_HEAD = {"status": 200, "headers": [("content-type", "text/event-stream; charset=utf-8")]}


@dataclass
class RayCLI:
    """`contbatch serve --ray-replicas ...` in a session of its own, and its log."""

    proc: subprocess.Popen
    url: str
    tag: str
    log: Path

    def processes(self, name: str = "") -> list[int]:
        """Its live processes with `name` in their command line: those in its session or whose
        environment carries its tag (a process that sets its title, as Ray's agents do, may
        blank its environment; one that starts a session of its own keeps the environment)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, _ppid, _pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            ours = session == str(self.proc.pid) or f"{TAG_ENV}={self.tag}".encode() in environ
            if ours and state != "Z" and name.encode() in cmdline:  # a zombie is not live
                found.append(int(pid))
        return found

    def end(self) -> None:
        """Whatever a test left running: the CLI and every process of its Ray runtime."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def exits_cleanly(self) -> None:
        """Status 0, without Ray's fatal-signal report, and no process of it left behind."""
        assert self.proc.wait(timeout=120) == 0, self.log.read_text()[-3000:]
        assert "SIGTERM received" not in self.log.read_text()
        wait_for(lambda: not self.processes(), 15, "every process of the CLI's Ray runtime to exit")


def start_ray_cli(tiny_dir: Path, tmp_path: Path, *extra: str) -> RayCLI:
    """The CLI serving the tiny model on a Ray runtime of its own, healthy."""
    port, log = free_port(), tmp_path / "ray-cli.log"
    cmd = [sys.executable, "-m", "contbatch.cli", "serve", "--model", str(tiny_dir), "--ray-num-cpus", "0.5",
           "--block-size", "16", "--num-blocks", "256", "--served-model-name", "tiny", "--port", str(port),
           *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own runtime, not this one's
    tag = uuid.uuid4().hex
    cli = RayCLI(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**env, "PYTHONUNBUFFERED": "1", TAG_ENV: tag}),
                 f"http://127.0.0.1:{port}", tag, log)

    def serving() -> bool:  # deployed (a replica may answer /health before the others are up)
        assert cli.proc.poll() is None, f"the Ray CLI exited with {cli.proc.returncode}:\n{log.read_text()[-3000:]}"
        return "contbatch serve (Ray): ready at" in log.read_text() and \
            httpx.get(cli.url + "/health", timeout=5).status_code == 200

    try:
        wait_for(serving, 180, "the Ray CLI to serve")
    except BaseException:
        cli.end()
        raise
    return cli
