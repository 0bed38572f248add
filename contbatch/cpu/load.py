"""Other processes' CPU time while we measure: was the machine ours?

On a machine with few cores, another busy process stretches every multithreaded kernel call
(a team of OpenMP threads waits for its slowest member), and stretches some kernels far more
than others. A kernel timing taken then says nothing about a quiet machine, so the probe
(`probe.py`) keeps such timings for its own process only. Foreign load is measured in CPU
time, not from the load average (which counts our own runnable threads too): the machine's
busy CPU seconds (`/proc/stat`, steal included) minus this process's (`/proc/self/stat`),
over a window of wall time. Where `/proc` is not there, nothing is known and nothing is
claimed (`ForeignLoad.cores()` is None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


def machine_busy_seconds() -> float | None:
    """CPU seconds spent busy on the whole machine so far (every CPU; time a hypervisor gave to
    another guest counts as busy, as foreign as another process); None without /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in (fields + ["0"] * 8)[:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int | str = "self") -> float | None:
    """utime + stime of a process (all its threads) and cutime + cstime (children it has waited
    for), from /proc; None when it is gone or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class ForeignLoad:
    """A window from construction: `cores()` is the mean number of CPUs other processes kept
    busy during it. Both counters tick at the kernel's clock (usually 10 ms), so two ticks
    of each are forgiven: a short window is not judged loaded by rounding."""

    wall: float = field(default_factory=time.perf_counter)
    machine: float | None = field(default_factory=machine_busy_seconds)
    own: float | None = field(default_factory=process_cpu_seconds)

    def cores(self) -> float | None:
        machine, own = machine_busy_seconds(), process_cpu_seconds()
        wall = time.perf_counter() - self.wall
        if None in (machine, own, self.machine, self.own) or wall <= 0:
            return None
        slack = 4 / os.sysconf("SC_CLK_TCK")
        return max(0.0, (machine - self.machine) - (own - self.own) - slack) / wall
