"""Whether the one-row kernels ask for their weight streams ahead: chosen per machine, by measurement.

A lone request's decode step streams every weight from memory once, one row against it. The
C++ kernels that do it (`small_linear` for float weights, the tiled packed kernels for int8 and
int4) can ask for each stream's lines 4 KiB ahead (`_mm_prefetch`, csrc/vec.h): the hardware
prefetcher follows a stream within a 4 KiB page and starts over at the next, and the software
request keeps the reads going across the border. On some CPUs that makes a lone decode step
faster; on others the same requests slow every stream down (docs/cpu.md has both machines'
figures). So each kind of stream (`ops.STREAM_KINDS`) that a model's steps run is timed both
ways, once per machine: one-row products over memory twice the last-level cache
(`probe.stream_bytes`, as the linear probe streams its weights), on 2 MiB pages where the
model's weights move there (`weight_pages.py`), in interleaved passes; the requests are dropped
where the passes without them are MARGIN faster, and kept otherwise. The kernels' values never
depend on it, only their speed.

The verdict is kept beside the linear probe's timings (`$CONTBATCH_CACHE/linear_probe/<machine>
.prefetch.json`; delete it to measure again), except one measured while other processes kept
CPUs busy (`load.ForeignLoad`), which this process alone uses. The plan carries it (start-up
line, `resolved_config`); `routers.CpuRouters` sets it for the process while a manager runs.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import cachefiles, hugepages
from ..paths import cache_dir
from . import ops, probe
from .load import ForeignLoad
from .quant.format import QuantFormat, quantize, tile

logger = logging.getLogger("contbatch")

AHEAD = 4096  # bytes ahead when the kernels ask (csrc/vec.h's kPrefetchBytes, their default)
MARGIN = 1.03  # passes without the requests must be this much faster to drop them
ROUNDS = 8  # timed pairs of passes (one with, one without, in alternating order)
_SHAPES = {"float": (2048, 1024), "packed": (8192, 1024)}  # a timed weight's [out, in]


@dataclass(frozen=True)
class PrefetchPlan:
    """Bytes ahead per kind of stream (0: no requests; None: the model's steps stream none of that
    kind), and the start-up line's words."""

    float_streams: int | None
    packed_streams: int | None
    summary: str

    def distances(self) -> dict[str, int]:
        pairs = zip(ops.STREAM_KINDS, (self.float_streams, self.packed_streams))
        return {kind: d for kind, d in pairs if d is not None}

    def apply(self) -> dict[str, int]:
        """Set the distances for the process; returns those in force before (for `restore`)."""
        return {kind: ops.stream_prefetch(kind, d) for kind, d in self.distances().items()}

    @staticmethod
    def restore(before: dict[str, int]) -> None:
        for kind, d in before.items():
            ops.stream_prefetch(kind, d)


def plan_prefetch(kinds: tuple[str, ...], asked: str, huge: bool) -> PrefetchPlan:
    """The distances for the stream kinds a model's one-row steps run (`kinds`), as `asked`
    (the `prefetch` override: knobs.OVERRIDES); "auto" takes the machine's verdict, measured here
    the first time (`huge`: time on 2 MiB pages, as the model's weights are)."""
    distances, words = {}, []
    for kind in kinds:
        if asked != "auto":
            distances[kind] = AHEAD if asked == "ahead" else 0
            words.append(f"{kind} {'ahead' if distances[kind] else 'none'} (as asked)")
            continue
        (on, off), measured = verdict(kind, huge)
        distances[kind] = 0 if on >= MARGIN * off else AHEAD
        how = "measured" if measured else "from the probe file"
        words.append(f"{kind} {'none' if distances[kind] == 0 else f'{AHEAD} B ahead'} "
                     f"({how}: without {on / off:.2f}x as fast)")
    summary = "one-row weight streams: " + ", ".join(words) if words else "no one-row weight streams of ours"
    return PrefetchPlan(distances.get("float"), distances.get("packed"), summary)


def _path() -> Path:
    return cache_dir() / "linear_probe" / f"{probe.machine()}.prefetch.json"


def _read() -> dict:
    """The file's verdicts ({kind: [seconds with, seconds without]}); {} when absent or damaged."""
    try:
        loaded = json.loads(_path().read_bytes())
    except Exception:  # absent, unreadable, not JSON: measure again
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {k: v for k, v in loaded.items() if k in ops.STREAM_KINDS and isinstance(v, list) and len(v) == 2
            and all(type(t) is float and t > 0 for t in v)}


_verdicts: dict[str, tuple[float, float]] = {}  # this process's (a loaded machine's stay here only)


def verdict(kind: str, huge: bool) -> tuple[tuple[float, float], bool]:
    """((median seconds a pass with the requests, without), whether measured now)."""
    if kind in _verdicts:
        return _verdicts[kind], False
    stored = _read().get(kind)
    if stored is not None:
        _verdicts[kind] = (stored[0], stored[1])
        return _verdicts[kind], False
    watch = ForeignLoad()
    _verdicts[kind] = measure(kind, huge)
    foreign = watch.cores()
    if foreign is not None and foreign > probe.FOREIGN_LIMIT:
        logger.warning("contbatch: one-row prefetch timed while other processes kept %.1f CPUs busy: not saved",
                       foreign)
    else:
        _save(kind, _verdicts[kind])
    return _verdicts[kind], True


def _save(kind: str, times: tuple[float, float]) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with cachefiles.locked(path.with_name(f"{path.name}.lock"), "saving the one-row prefetch verdict"):
            cachefiles.write_atomic(path, json.dumps({**_read(), kind: list(times)}, indent=0, sort_keys=True))
    except OSError as exc:  # a full or read-only cache: measure again next time
        logger.warning("contbatch: one-row prefetch verdict not saved (%s)", exc)


def _memory(nbytes: int, huge: bool) -> torch.Tensor:
    """`nbytes` of uint8, on 2 MiB pages with `huge` (where the OS gives them)."""
    if huge and hugepages.availability()[0]:
        buffer, start = hugepages.zeroed_buffer(nbytes)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start)
    return torch.zeros(nbytes, dtype=torch.uint8)


def _float_pass(pool: torch.Tensor) -> Callable[[], None]:
    out, in_ = _SHAPES["float"]
    copies = probe.copies(pool.view(torch.float32), out, in_)
    for w in copies:  # written: untouched pages all read as one zero page, which the cache keeps
        w.fill_(0.25)
    x = torch.full((1, in_), 0.5)
    return lambda: [ops.small_linear(x, w, None) for w in copies]


def _packed_pass(pool: torch.Tensor) -> Callable[[], None]:
    out, in_ = _SHAPES["packed"]
    packed = tile(quantize(torch.linspace(-1, 1, out * in_).view(out, in_), QuantFormat(4, 32, "int4-g32")))
    size = packed.codes.numel()
    copies = []
    for i in range(max(1, pool.numel() // size)):
        codes = pool[i * size:(i + 1) * size].view(packed.codes.shape)
        codes.copy_(packed.codes)
        copies.append((codes, packed.scales.clone(), packed.mins.clone()))
    x = torch.full((1, in_), 0.5)
    bits = packed.fmt.op_bits
    return lambda: [ops.quant_linear(x, c, s, m, None, bits, 32) for c, s, m in copies]


def measure(kind: str, huge: bool) -> tuple[float, float]:
    """Median seconds of a pass over the stream memory with the requests and without, ROUNDS
    interleaved pairs after one of each untimed; the process's distance is left as it was."""
    make = _float_pass if kind == "float" else _packed_pass
    run = make(_memory(probe.stream_bytes(), huge))
    before = ops.stream_prefetch(kind)
    times: dict[int, list[float]] = {AHEAD: [], 0: []}
    try:
        with torch.inference_mode():
            for distance in times:
                ops.stream_prefetch(kind, distance)
                run()
            for r in range(ROUNDS):
                for distance in ((AHEAD, 0) if r % 2 == 0 else (0, AHEAD)):
                    ops.stream_prefetch(kind, distance)
                    start = time.perf_counter()
                    run()
                    times[distance].append(time.perf_counter() - start)
    finally:
        ops.stream_prefetch(kind, before)
    return statistics.median(times[AHEAD]), statistics.median(times[0])
