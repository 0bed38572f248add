"""Fault injection for tests and the soak benchmark: exceptions at chosen sites, at random.

Off unless installed (`install(...)`, or `CONTBATCH_FAULTS="forward=0.02,sampler=0.01"` in the
environment of a fresh process, with `CONTBATCH_FAULTS_SEED`). Each engine site calls
`inject(site)`, which costs one global read when nothing is installed. The engine must turn
every injected fault into the failure of the requests it touches, never of the engine.
"""

from __future__ import annotations

import os
import random
import threading

SITES = ("forward", "sampler", "detokenizer", "handler")


class InjectedFault(RuntimeError):
    """Raised by `inject`: a stand-in for a bug or a numerical failure at `site`."""


class FaultInjector:
    def __init__(self, rates: dict[str, float], seed: int = 0) -> None:
        unknown = set(rates) - set(SITES)
        if unknown:
            raise ValueError(f"unknown fault sites {sorted(unknown)}; known: {SITES}")
        if not all(0.0 <= r <= 1.0 for r in rates.values()):
            raise ValueError(f"fault rates must be in [0, 1], got {rates}")
        self.rates = dict(rates)
        self.counts = dict.fromkeys(SITES, 0)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def check(self, site: str) -> None:
        rate = self.rates.get(site, 0.0)
        if not rate:
            return
        with self._lock:
            hit = self._rng.random() < rate
            if hit:
                self.counts[site] += 1
        if hit:
            raise InjectedFault(f"injected fault at {site}")


_active: FaultInjector | None = None


def parse(spec: str) -> dict[str, float]:
    """`"forward=0.02,sampler=0.01"` -> rates per site."""
    rates = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        site, _, rate = part.partition("=")
        rates[site.strip()] = float(rate)
    return rates


def install(rates: dict[str, float] | str, seed: int = 0) -> FaultInjector:
    global _active
    _active = FaultInjector(parse(rates) if isinstance(rates, str) else rates, seed)
    return _active


def uninstall() -> None:
    global _active
    _active = None


def active() -> FaultInjector | None:
    return _active


def inject(site: str) -> None:
    if _active is not None:
        _active.check(site)


if os.environ.get("CONTBATCH_FAULTS"):
    install(os.environ["CONTBATCH_FAULTS"], int(os.environ.get("CONTBATCH_FAULTS_SEED", "0")))
