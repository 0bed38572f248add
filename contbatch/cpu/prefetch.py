"""How the kernels that stream memory for few rows ask for it ahead: chosen per machine, by measurement.

A lone request's decode step streams every weight from memory once, one row against it, and
its attention reads the request's keys and values, short runs of rows scattered over the cache.
The C++ kernels that do it (`small_linear` for float weights, the tiled packed kernels for int8
and int4, the decode attention's tiles) can ask for each stream's lines ahead (software prefetches,
csrc/vec.h), into L1 or into L2: the hardware prefetcher follows a stream within a 4 KiB page
and starts over at the next, and the software requests keep the reads going across the border.
What that is worth is the CPU's: on one the requests into L1 make a lone decode step faster, on
another they slow every stream down while the same requests into L2 speed it up (docs/cpu.md has
the figures). So each kind of stream (`ops.STREAM_KINDS`) that a model's steps run is timed once
per machine in each setting (`SETTINGS`: none, into L1, into L2), in interleaved passes over
memory twice the last-level cache (`probe.stream_bytes`, as the linear probe streams its
weights): one-row products on 2 MiB pages where the model's weights move there
(`weight_pages.py`), decode attention over a cache of long requests. The fastest setting is
taken where it is MARGIN faster than the kernels' own (`DEFAULT`). The kernels' values never
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

# (bytes ahead, cache level) per setting and kind. Into L1 as the kernels ask by default
# (csrc/vec.h: the weights a page ahead, the K/V rows 2 KiB); into L2 the K/V rows a page ahead
# too, which measured faster than 2 KiB there.
SETTINGS = ("none", "l1", "l2")
_AHEAD = {"l1": {"float": 4096, "packed": 4096, "kv": 2048}, "l2": {"float": 4096, "packed": 4096, "kv": 4096}}
DEFAULT = "l1"  # the kernels' own (csrc/vec.h), kept unless another setting measures MARGIN faster
MARGIN = 1.03
ROUNDS = 8  # timed rounds, each one pass per setting (their order turned every round)
_SHAPES = {"float": (2048, 1024), "packed": (8192, 1024)}  # a timed weight's [out, in]
_KV = (2, 3, 64, 256, 2048)  # the timed cache's KV heads, query heads per KV head, dim, block size, keys a row
_WORDS = {"none": "none", "l1": "into L1", "l2": "into L2"}


@dataclass(frozen=True)
class PrefetchPlan:
    """The setting per kind of stream the model's steps run (`SETTINGS`' names), and the
    start-up line's words."""

    settings: dict[str, str]
    summary: str

    def apply(self) -> dict[str, tuple[int, int]]:
        """Set the kinds' settings for the process; returns those in force before (for `restore`)."""
        return {kind: ops.stream_prefetch(kind, setting(kind, name)) for kind, name in self.settings.items()}

    @staticmethod
    def restore(before: dict[str, tuple[int, int]]) -> None:
        for kind, setting in before.items():
            ops.stream_prefetch(kind, setting)


def setting(kind: str, name: str) -> tuple[int, int]:
    """`ops.stream_prefetch`'s (bytes ahead, level) for setting `name` of stream `kind`."""
    return (0, 1) if name == "none" else (_AHEAD[name][kind], 1 if name == "l1" else 2)


def choose(times: dict[str, float]) -> str:
    """The fastest setting where it beats DEFAULT by MARGIN, else DEFAULT."""
    best = min(times, key=times.__getitem__)
    return best if times[best] * MARGIN <= times[DEFAULT] else DEFAULT


def plan_prefetch(kinds: tuple[str, ...], asked: str, huge: bool) -> PrefetchPlan:
    """The settings for the stream kinds a model's steps run (`kinds`), as `asked` (the
    `prefetch` override: knobs.OVERRIDES); "auto" takes the machine's verdict, measured here
    the first time (`huge`: weights timed on 2 MiB pages, as the model's are)."""
    settings, words = {}, []
    for kind in kinds:
        if asked != "auto":
            settings[kind] = asked
            words.append(f"{kind} {_WORDS[asked]} (as asked)")
            continue
        times, measured = verdict(kind, huge)
        settings[kind] = choose(times)
        how = "measured" if measured else "from the probe file"
        ratios = ", ".join(f"{_WORDS[n]} {times[DEFAULT] / times[n]:.2f}x" for n in SETTINGS if n != DEFAULT)
        words.append(f"{kind} {_WORDS[settings[kind]]} ({how}, against {_WORDS[DEFAULT]}: {ratios})")
    summary = "streams: " + ", ".join(words) if words else "no streams of our few-row kernels"
    return PrefetchPlan(settings, summary)


def _path() -> Path:
    return cache_dir() / "linear_probe" / f"{probe.machine()}.prefetch.json"


def _read() -> dict:
    """The file's verdicts ({kind: {setting: median seconds a pass}}); {} when absent or damaged."""
    try:
        loaded = json.loads(_path().read_bytes())
    except Exception:  # absent, unreadable, not JSON: measure again
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {k: v for k, v in loaded.items() if k in ops.STREAM_KINDS and isinstance(v, dict)
            and set(v) == set(SETTINGS) and all(type(t) is float and t > 0 for t in v.values())}


_verdicts: dict[str, dict[str, float]] = {}  # this process's (a loaded machine's stay here only)


def verdict(kind: str, huge: bool) -> tuple[dict[str, float], bool]:
    """({setting: median seconds a pass}, whether measured now)."""
    if kind in _verdicts:
        return _verdicts[kind], False
    stored = _read().get(kind)
    if stored is not None:
        _verdicts[kind] = stored
        return stored, False
    watch = ForeignLoad()
    _verdicts[kind] = measure(kind, huge)
    foreign = watch.cores()
    if foreign is not None and foreign > probe.FOREIGN_LIMIT:
        logger.warning("contbatch: stream prefetch timed while other processes kept %.1f CPUs busy: not saved",
                       foreign)
    else:
        _save(kind, _verdicts[kind])
    return _verdicts[kind], True


def _save(kind: str, times: dict[str, float]) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with cachefiles.locked(path.with_name(f"{path.name}.lock"), "saving the stream prefetch verdict"):
            cachefiles.write_atomic(path, json.dumps({**_read(), kind: times}, indent=0, sort_keys=True))
    except OSError as exc:  # a full or read-only cache: measure again next time
        logger.warning("contbatch: stream prefetch verdict not saved (%s)", exc)


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


def _kv_pass(pool: torch.Tensor) -> Callable[[], None]:
    """Decode attention of rows of _KV's keys each whose blocks, shuffled, cover the cache once."""
    kv_heads, group, dim, block, keys = _KV
    slots = pool.numel() // 4 // (2 * kv_heads * dim) // block * block
    caches = pool[: 2 * kv_heads * slots * dim * 4].view(torch.float32).view(2, kv_heads, slots, dim)
    caches.fill_(0.25)
    per_row = keys // block
    rows = slots // block // per_row  # at least 8: probe.MIN_STREAM_BYTES holds 8 rows' blocks
    table = torch.randperm(rows * per_row, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = table.view(rows, per_row)
    lens = torch.full((rows,), keys, dtype=torch.int32)
    query = torch.full((rows, kv_heads * group, dim), 0.5)
    return lambda: ops.paged_decode(query, caches[0], caches[1], table, lens, None, block, dim ** -0.5, None, None)


def measure(kind: str, huge: bool) -> dict[str, float]:
    """Median seconds of a pass over the stream memory in each setting, ROUNDS interleaved rounds
    after one untimed pass of each; the process's setting is left as it was."""
    make = {"float": _float_pass, "packed": _packed_pass, "kv": _kv_pass}[kind]
    run = make(_memory(probe.stream_bytes(), huge and kind != "kv"))  # the KV cache is on 4 KiB pages
    before = ops.stream_prefetch(kind)
    names = list(SETTINGS)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        with torch.inference_mode():
            for name in names:
                ops.stream_prefetch(kind, setting(kind, name))
                run()
            for r in range(ROUNDS):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    ops.stream_prefetch(kind, setting(kind, name))
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
    finally:
        ops.stream_prefetch(kind, before)
    return {name: statistics.median(t) for name, t in times.items()}
