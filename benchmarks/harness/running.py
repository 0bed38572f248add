"""Running systems in the same conditions: worker threads and interleaved repeats.

- `in_worker(fn)`: a timed run in a fresh worker thread, as the engines' own step loops run.
- `run_interleaved()`: one untimed warm-up run per system, then N rounds, each running every
  system once with the starting system rotated each round (A B / B A / A B ... for two), so
  slow drift and one-off disturbances fall on every system alike.
- `rounds()`: the same order for benchmarks that drive their own loop (child processes).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def in_worker(fn: Callable):
    """Run fn in a fresh thread, as both continuous-batching engines run their model steps.
    With the main thread's OpenMP team alive, a second team means more OpenMP threads than CPUs, so
    libgomp throttles its spin-wait; the main team spins in full. Under competing load that alone
    made one forward ~5x slower on the main thread (OMP_WAIT_POLICY=PASSIVE removed the gap), so
    every timed system runs in a worker, under the same policy."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, name="bench-worker")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class Sample:
    """One timed run of one system. `tokens`: per-request generated ids (counted, then checked)."""

    wall_s: float
    output_tokens: int
    tokens: list[list[int]] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def interleaved_order(names: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """Round r runs every system once, starting at system r mod n: A B C / B C A / C A B / ..."""
    n = len(names)
    return [(r, names[(r + i) % n]) for r in range(repeats) for i in range(n)]


def rounds(names: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, system) in interleaved order, for loops that run each system themselves."""
    yield from interleaved_order(list(names), repeats)


def run_interleaved(systems: dict[str, Callable[[], Sample]], repeats: int, warmup: bool = True,
                    between: Callable[[], None] | None = None, log: Callable[[str], None] = print,
                    worker: bool = True) -> dict[str, list[Sample]]:
    """One untimed warm-up run per system (in order), then `repeats` interleaved rounds."""
    call = (lambda f: in_worker(f)) if worker else (lambda f: f())
    names = list(systems)
    if warmup:
        for name in names:
            s = call(systems[name])
            if between:
                between()
            log(f"   warm-up  {name:<28} {s.wall_s:8.2f} s  {s.tok_s:8.1f} {s.extra.get('unit', 'tok/s')}")
    out: dict[str, list[Sample]] = {n: [] for n in names}
    for r, name in interleaved_order(names, repeats):
        s = call(systems[name])
        if between:
            between()
        out[name].append(s)
        log(f"   round {r + 1}  {name:<28} {s.wall_s:8.2f} s  {s.tok_s:8.1f} {s.extra.get('unit', 'tok/s')}")
    return out


def cleanup() -> None:
    gc.collect()
