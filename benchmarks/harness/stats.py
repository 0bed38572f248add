"""Medians with their spread, and ratios of them.

Every figure a benchmark reports is the median of its repeats with [min, max]; a ratio of two
systems is the ratio of their medians, with the range from the min/max pairs (worst / best ..
best / worst), so overlapping ranges are visible in the ratio itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Spread:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, spec: str = ".1f") -> str:
        if self.n == 1:
            return format(self.median, spec)
        return f"{self.median:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def ratio(a: Spread, b: Spread) -> Spread:
    """a / b: ratio of medians, range from the min/max pairs (worst a / best b .. best a / worst b)."""
    return Spread(a.median / b.median, a.lo / b.hi, a.hi / b.lo, min(a.n, b.n))


def fmt_ratio(r: Spread | None) -> str:
    if r is None:
        return "-"
    if r.n == 1:
        return f"{r.median:.2f}x"
    return f"{r.median:.2f}x [{r.lo:.2f}, {r.hi:.2f}]"


def spreads(runs: Sequence[dict]) -> dict[str, Spread]:
    """Per key of a list of runs' numeric results (one dict per run): the spread over the runs."""
    return {k: Spread.of([r[k] for r in runs]) for k, v in runs[0].items() if isinstance(v, (int, float))}
