"""The benchmarks' load monitor counts a server's child processes as the benchmark's own load
(vLLM's engine runs in a child of its API server): otherwise its work reads as foreign load
and a quiet run is labelled noisy."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness.load import LoadMonitor  # noqa: E402

# A parent that only waits on a child that spins for two seconds.
PARENT = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
          "'import time\\nend = time.time() + 2.0\\nwhile time.time() < end: pass'])")


def test_a_named_process_childrens_cpu_is_own():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        time.sleep(0.3)  # the child has started
        monitor = LoadMonitor(pids=[parent.pid])
        before, t0 = monitor._cpu(), time.perf_counter()
        time.sleep(1.0)
        own = (monitor._cpu() - before) / (time.perf_counter() - t0)
    finally:
        parent.wait(10)
    assert own > 0.6, own  # the spinning child, counted through its parent's pid


def _foreign_while_spinning(own: bool) -> float:
    """Mean foreign load while a process outside this one's tree (started through a shell
    that exits at once) spins for 2 s, named as ours or not."""
    spin = "import time\nend = time.time() + 2.0\nwhile time.time() < end: pass"
    shell = subprocess.run(["sh", "-c", f'{sys.executable} -c "{spin}" > /dev/null 2>&1 & echo $!'],
                           capture_output=True, text=True, check=True)
    pid = int(shell.stdout.strip())
    with LoadMonitor(interval=0.4, pids=[pid] if own else []) as monitor:
        time.sleep(1.6)
    while Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    return sum(s["foreign"] for s in monitor.samples) / len(monitor.samples)


def test_foreign_load_is_cpu_time_of_other_processes():
    """Another process's spinning is foreign; the same process named as ours is not."""
    assert _foreign_while_spinning(own=False) - _foreign_while_spinning(own=True) > 0.5


def test_children_of_the_benchmark_are_its_own():
    """Systems a benchmark runs in fresh child processes are its own load, unnamed."""
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with LoadMonitor(interval=0.4) as monitor:
            time.sleep(1.2)
    finally:
        child.wait(10)
    assert sum(s["busy"] for s in monitor.samples) / len(monitor.samples) > 0.5
