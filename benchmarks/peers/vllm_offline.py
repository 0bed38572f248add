"""The offline benchmark's client of vLLM: `vllm_worker.py` in a fresh process of the peers'
venv, one process per (model, dtype, setting), kept for every run of that setting.

Why a kept process: vLLM's start-up (model load, cache allocation, compile) is paid once, as
a user of `vllm.LLM` pays it once; every run times `LLM.generate` alone on the worker's main
thread, and between runs the process sits idle (its OpenMP threads sleep). `close_all()` ends
every worker: the benchmarks call it when a workload's rows are done, so two vLLM engines never
hold memory at once for long.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from peers import knobs, paths

START_TIMEOUT_S = 900.0


class PeerError(RuntimeError):
    """A peer failed to start or to run: the message carries its own error and log tail."""


@dataclass
class VllmProcess:
    model: str
    dtype: str
    setting: dict
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    log: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        py = paths.venv_python()
        if not py.is_file():
            raise PeerError(f"{py} missing: run `make bench-peers` first")
        args = knobs.vllm_engine_args(self.model, self.dtype, self.setting)
        env = {**os.environ, **knobs.vllm_env(self.setting)}
        env.pop("PYTHONPATH", None)  # the project's tree must not shadow the venv's packages
        self.log = paths.work_dir() / "logs" / f"vllm-offline-{os.getpid()}-{knobs.label(self.setting)}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        worker = Path(__file__).resolve().parent / "vllm_worker.py"
        with open(self.log, "w") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([str(py), str(worker), json.dumps(args)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                         cwd=str(paths.work_dir()))
        ready = self._read("READY")
        self.startup_s = ready["startup_s"]

    def _read(self, want: str) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            tag, _, body = line.partition(" ")
            if tag == want:
                return json.loads(body)
            if tag == "ERROR":
                raise PeerError(f"vLLM worker ({knobs.label(self.setting)}): {json.loads(body)['error']}\n"
                                f"{self.tail()}")
        raise PeerError(f"vLLM worker ({knobs.label(self.setting)}) exited {self.proc.wait()} before {want}:\n"
                        f"{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log and self.log.is_file() else ""

    def run(self, prompts: list[list[int]], max_new: list[int]) -> tuple[float, list[list[int]]]:
        """(wall of `LLM.generate`, generated ids per prompt)."""
        with self.lock:
            if self.proc is None:
                self.start()
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_new": max_new}) + "\n")
            self.proc.stdin.flush()
            out = self._read("RESULT")
        return out["wall_s"], out["tokens"]

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


_POOL: dict[tuple, VllmProcess] = {}


def worker(model: str, dtype: str, setting: dict) -> VllmProcess:
    """The kept worker of this (model, dtype, setting), started on its first run."""
    key = (model, dtype, knobs.label(setting))
    if key not in _POOL:
        _POOL[key] = VllmProcess(model, dtype, dict(setting))
    return _POOL[key]


def close_all() -> None:
    while _POOL:
        _POOL.popitem()[1].close()
