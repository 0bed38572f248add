"""The CPU linear probe's timings, kept per machine in `$CONTBATCH_CACHE/linear_probe/`.

`cpu_linear` times each kernel on each weight shape at start-up; this store keeps those
timings so that later processes route (and so round) the same way without probing again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import cachefiles, native
from ..config import CPU_LINEAR_KERNELS as KERNELS
from ..paths import cache_dir

logger = logging.getLogger("contbatch")


@functools.cache
def _machine() -> str:
    """The probe file's name: our kernels' build key (sources, torch, CPU flags) and the CPU model."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return hashlib.sha256(f"{native.build_key()}|{model}".encode()).hexdigest()[:16]


@dataclass
class ProbeStore:
    """Probe timings by product, for this process and persisted in $CONTBATCH_CACHE per machine:
    a later process routes the same way without probing (2-7 s of every start on the default
    model), and so rounds the same way: two runs of one job give the same tokens. Delete the
    file (its path is in the start-up line) to probe again. Read on first use.

    Reading never raises: a file that is not JSON, and entries that are not timings the planner
    can use (`_usable`), are dropped with one warning naming the file, and those products are
    probed again; the next save writes the file whole again. Saves merge this process's timings
    into the file's under an `flock` (two processes saving at once keep both's) and replace it
    atomically; a save that fails (a full or read-only disk) leaves the file as it was and no
    temporary file beside it."""

    path: Path | None = None
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    from_file: set[str] = field(default_factory=set)
    hits: int = 0  # verdicts taken from the file in this process
    probed: int = 0  # products timed in this process
    unsaved: bool = False

    def get(self, key: str) -> dict[str, float] | None:
        if self.path is None:
            self.path = cache_dir() / "linear_probe" / f"{_machine()}.json"
            loaded = self._read(warn=True)  # an absent, empty or damaged file probes as before
            self.times, self.from_file = {**loaded, **self.times}, set(loaded)
        self.hits += key in self.from_file
        return self.times.get(key)

    def put(self, key: str, times: dict[str, float]) -> None:
        self.times[key] = times
        self.probed += 1
        self.unsaved = True

    def save(self) -> None:
        """Write this process's timings next to those already in the file."""
        if not self.unsaved or self.path is None:
            return
        self.unsaved = False
        try:
            with cachefiles.locked(self.path.with_name(f"{self.path.name}.lock"), "saving linear probe timings"):
                cachefiles.remove_temps(self.path)
                for old in self.path.parent.glob(f"{self.path.stem}.*.tmp"):  # an older version's temporary files
                    old.unlink(missing_ok=True)
                merged = {**self._read(), **self.times}
                cachefiles.write_atomic(self.path, json.dumps(merged, indent=0, sort_keys=True))
        except OSError as exc:  # a full or read-only cache: probe again next time
            logger.warning("contbatch: linear probe verdicts not saved (%s)", exc)

    def _read(self, warn: bool = False) -> dict[str, dict[str, float]]:
        """The file's usable entries: {} for an absent or damaged file. Never raises."""
        try:
            loaded = json.loads(self.path.read_bytes())
            why = "" if isinstance(loaded, dict) else "not a JSON object"
        except FileNotFoundError:
            return {}
        except Exception as exc:  # unreadable, not JSON, nested too deep: never the planner's failure
            loaded, why = {}, f"{type(exc).__name__}: {exc}"
        if why:
            if warn:
                logger.warning("contbatch: %s: damaged linear probe file (%s); probing again", self.path, why)
            return {}
        usable = {key: times for key, times in loaded.items() if _usable(key, times)}
        if warn and len(usable) < len(loaded):
            logger.warning("contbatch: %s: %d of %d linear probe entries damaged (not timings of known kernels); "
                           "probing those again", self.path, len(loaded) - len(usable), len(loaded))
        return usable


def _usable(key: str, times: object) -> bool:
    """Whether a stored entry is timings the planner can compare: positive, finite seconds for
    aten and for exactly the kernels its key names (`_probe`'s keys end with them), and no
    other. An empty or zero entry would fail every start (an empty `min()`, a division by zero)."""
    if not isinstance(times, dict) or "aten" not in times:
        return False
    if not all(name in KERNELS and type(t) in (int, float) and math.isfinite(t) and t > 0
               for name, t in times.items()):
        return False
    words = key.split()
    if words[-1:] == ["packed"]:
        words = words[:-1]
    named = set(words[-1].split(",")) if words else set()
    return not named <= set(KERNELS) or named == set(times)
