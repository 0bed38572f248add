"""Load checks: was the machine quiet while a benchmark ran?

On a 2-core machine any other busy process slows every multithreaded matmul, so each report
states the load. Two tools:

- `LoadMonitor`: for benchmarks that run in one process (plus named server processes). The
  1-minute load average before the run and, from a sampling thread, during it, against the
  benchmark's own busy threads (process CPU time / wall time). A run is *noisy* by
  `noisy_rule()`; `report.write_outputs` keeps a noisy run out of RESULTS.md unless forced.
- `LoadRange`: for benchmarks whose timed work runs in child processes (whose CPU time the
  monitor cannot attribute): the 1-minute load average sampled between runs, reported as a range.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from contbatch.cpu.load import machine_busy_seconds, process_cpu_seconds

NOISE_THRESHOLD = 0.5  # foreign load (runnable threads not ours), in the units of the load average
SAMPLE_INTERVAL_S = 1.0


def noisy_rule(threshold: float = NOISE_THRESHOLD) -> str:
    return (f"noisy = 1-min load average before the run > {threshold}, or the mean foreign load during it > "
            f"{threshold}; foreign load = CPUs busy on the machine (/proc/stat, steal included) - CPUs busy with "
            f"the benchmark's own processes (CPU time / wall time of the benchmark, its child processes, and the "
            f"servers it names with theirs), sampled every {SAMPLE_INTERVAL_S:.0f} s")


def _machine_busy_seconds() -> float:
    return machine_busy_seconds() or 0.0


def _proc_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its waited-for children; 0 when it is gone. Summed over a
    process tree sampled in turn, a child that ends between two samples moves its seconds from
    its own entry to its parent's cutime: the sum telescopes, nothing is lost or counted twice."""
    return process_cpu_seconds(pid) or 0.0


def _descendants(pids: Sequence[int]) -> set[int]:
    """`pids` and every process below them (a server's workers: vLLM's engine runs in a child)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def wait_for_quiet(threshold: float = NOISE_THRESHOLD, timeout_s: float = 240.0, log=print) -> float:
    """Wait (at most `timeout_s`) for the 1-minute load average to fall below `threshold`:
    servers a benchmark has just started load the machine while they start, and that load,
    ours, would still read as load before the run. Returns the load average when done."""
    deadline = time.monotonic() + timeout_s
    load = os.getloadavg()[0]
    if load >= threshold:
        log(f"waiting for the 1-minute load average ({load:.2f}) to fall below {threshold}")
    while load >= threshold and time.monotonic() < deadline:
        time.sleep(5.0)
        load = os.getloadavg()[0]
    return load


class LoadMonitor:
    """Samples the 1-minute load average and the benchmark's own CPU time in a thread.

    Foreign load is measured in CPU time, not from the load average: over each sample interval,
    the machine's busy CPUs (`/proc/stat`) minus ours (d(CPU seconds) / d(wall seconds) of this
    process, of `pids` (servers), and of every process below either). The load average counts
    runnable threads, so a benchmark whose own threads outnumber the cores (a server beside
    its load generator on 2 cores) would read its own queueing as foreign load. The load
    average is still reported, and the one before the run still decides noisiness.
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL_S, threshold: float = NOISE_THRESHOLD,
                 pids: Sequence[int] = ()):
        self.interval, self.threshold, self.pids = interval, threshold, list(pids)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.before: tuple[float, float, float] | None = None
        self.result: dict | None = None

    def _cpu(self) -> float:
        """Our CPU seconds: this process, the named processes, and every process below them
        (the systems a benchmark runs in fresh child processes, a server's workers)."""
        return sum(_proc_cpu_seconds(p) for p in _descendants([os.getpid(), *self.pids]))

    def add_pid(self, pid: int) -> None:
        self.pids.append(pid)

    def start(self) -> "LoadMonitor":
        self.before = os.getloadavg()
        self._t0 = self._last_t = time.perf_counter()
        self._cpu0 = self._last_cpu = self._cpu()
        self._last_machine = _machine_busy_seconds()
        self._thread = threading.Thread(target=self._loop, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def warn_if_loaded(self) -> None:
        """Say at the start that the run will be labelled noisy, so it can be stopped early."""
        if self.before[0] > self.threshold:
            print(f"WARNING: 1-minute load average {self.before[0]:.2f} > {self.threshold}: this run will be "
                  "labelled noisy.", flush=True)

    def _sample(self) -> None:
        now, cpu = time.perf_counter(), self._cpu()
        dt = now - self._last_t
        if dt <= 0:
            return
        busy = max(0.0, (cpu - self._last_cpu) / dt)
        machine = _machine_busy_seconds()
        machine_busy = max(0.0, (machine - self._last_machine) / dt)
        load1 = os.getloadavg()[0]
        self.samples.append({"t": round(now - self._t0, 2), "load1": load1, "busy": round(busy, 3),
                             "machine_busy": round(machine_busy, 3),
                             "foreign": round(max(0.0, machine_busy - busy), 3)})
        self._last_t, self._last_cpu, self._last_machine = now, cpu, machine

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> dict:
        if self._thread is None:
            raise RuntimeError("LoadMonitor.stop() before start()")
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.perf_counter() - self._t0
        own_busy = (self._cpu() - self._cpu0) / wall if wall > 0 else 0.0
        loads = [s["load1"] for s in self.samples]
        foreign = [s["foreign"] for s in self.samples]
        foreign_mean = statistics.fmean(foreign) if foreign else 0.0
        reasons = []
        if self.before[0] > self.threshold:
            reasons.append(f"load before {self.before[0]:.2f} > {self.threshold}")
        if foreign_mean > self.threshold:
            reasons.append(f"mean foreign load during {foreign_mean:.2f} > {self.threshold}")
        self.result = {
            "load_before": [round(x, 2) for x in self.before],
            "load_during_mean": round(statistics.fmean(loads), 2) if loads else None,
            "load_during_max": round(max(loads), 2) if loads else None,
            "own_busy_threads": round(own_busy, 2),
            "foreign_load_mean": round(foreign_mean, 2),
            "foreign_load_max": round(max(foreign), 2) if foreign else None,
            "wall_s": round(wall, 1),
            "noisy": bool(reasons),
            "noisy_reasons": reasons,
            "threshold": self.threshold,
            "samples": self.samples,
        }
        return self.result

    def __enter__(self) -> "LoadMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def load_line(load: dict) -> str:
    s = (f"load average before {load['load_before'][0]:.2f} (1 min), during mean {load['load_during_mean']} / max "
         f"{load['load_during_max']}; own busy threads {load['own_busy_threads']}; foreign load mean "
         f"{load['foreign_load_mean']} / max {load['foreign_load_max']}")
    return s + (" -> NOISY (" + "; ".join(load["noisy_reasons"]) + ")" if load["noisy"] else " -> quiet")


class LoadRange:
    """The 1-minute load average before the first run and after each one (`sample()`), for
    benchmarks whose runs are child processes: on 2 cores a range above ~2 means something else
    ran (the runs' own threads account for up to 2)."""

    def __init__(self) -> None:
        self.values = [os.getloadavg()[0]]
        self.t0 = time.time()

    def sample(self) -> None:
        self.values.append(os.getloadavg()[0])

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.t0

    def line(self) -> str:
        return f"load average (1 min) {min(self.values):.2f}-{max(self.values):.2f}"
