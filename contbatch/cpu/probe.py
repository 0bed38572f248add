"""Timings of the linear kernels on a model's weight shapes, and the store that keeps them.

`time_kernels` times each kernel on one product (weight shape, row count, dtype): best-of
seconds per call, each timed call reading a different copy of the weight, cut from a pool of
memory as large as the model's linears (at most twice the last-level cache), as a forward
streams its weights from memory; a weight timed over and over stays hot in the cache and chose the wrong kernel.
Compute-bound products (many rows) are timed on a few copies, and kernels that lose clearly
after one pass are not timed again, so that probing a new model costs little of its first job.

`ProbeStore` keeps the timings per machine in `$CONTBATCH_CACHE/linear_probe/<machine>.json`
(the machine: our library's build key and the CPU model), so later processes route, and so
round, the same way without probing again. Delete the file to probe again. Timings taken
while other processes kept more than FOREIGN_LIMIT CPUs busy (`load.ForeignLoad`) route
their own process only and are never saved: a busy neighbour stretches a multithreaded
kernel (its team waits for the thread it preempted) far more than a single-threaded one, and a
file written then would route every later start to the slower kernel.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import cachefiles
from ..paths import cache_dir
from . import linear_kernels, native, ops
from .knobs import LINEAR_KERNELS as KERNELS

logger = logging.getLogger("contbatch")

POOL_BYTES = 128 << 20  # probe weights streamed from at most this much memory
MIN_STREAM_BYTES = 16 << 20
HOT_ROWS = 64  # from this many rows a product is timed as compute-bound (see `time_kernels`); the
# batch regime's 32-row product streams its weights, where the kernels part (docs/cpu.md)
HOT_BYTES = 8 << 20  # weight copies those products are timed on
HOT_OUT = 8192  # output features those products are timed on at most (`timed_shape`)
CLOSE = 1.25  # kernels within this factor of the best get more timed passes (`_best_of`)
PROBE_VERSION = 2
FOREIGN_LIMIT = 0.25  # CPUs other processes may keep busy while we probe for the timings to be saved


@functools.cache
def machine() -> str:
    """The probe file's name: our kernels' build key (sources, torch, CPU flags), the CPU model
    and the probe's own version (PROBE_VERSION: files of earlier probes, which saved timings
    taken under foreign load, are left behind)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return hashlib.sha256(f"{native.build_key()}|{model}|{PROBE_VERSION}".encode()).hexdigest()[:16]


@dataclass
class ProbeStore:
    """Probe timings by product, for this process and persisted in $CONTBATCH_CACHE per machine:
    a later process routes the same way without probing, and so rounds the same way: two runs
    of one job give the same tokens. Delete the file (its path is in the start-up line) to
    probe again. Read on first use.

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
    transient: set[str] = field(default_factory=set)  # timed on a loaded machine: this process only
    fresh: set[str] = field(default_factory=set)  # timed since the last `save`

    def get(self, key: str) -> dict[str, float] | None:
        if self.path is None:
            self.path = cache_dir() / "linear_probe" / f"{machine()}.json"
            loaded = self._read(warn=True)  # an absent, empty or damaged file probes as before
            self.times, self.from_file = {**loaded, **self.times}, set(loaded)
        self.hits += key in self.from_file
        return self.times.get(key)

    def put(self, key: str, times: dict[str, float]) -> None:
        self.times[key] = times
        self.probed += 1
        self.unsaved = True
        self.fresh.add(key)

    def save(self, foreign_cores: float | None = None) -> bool:
        """Write this process's timings next to those already in the file, except those timed
        since the last save when other processes kept more than FOREIGN_LIMIT CPUs busy
        meanwhile (`foreign_cores`; None: not known, taken as quiet). False when timings of
        this window were kept from the file for that reason."""
        loaded = foreign_cores is not None and foreign_cores > FOREIGN_LIMIT and bool(self.fresh)
        if loaded:
            self.transient |= self.fresh
        self.fresh = set()
        if not self.unsaved or self.path is None:
            return not loaded
        self.unsaved = False
        keep = {key: times for key, times in self.times.items() if key not in self.transient}
        if not set(keep) - self.from_file:
            return not loaded
        try:
            with cachefiles.locked(self.path.with_name(f"{self.path.name}.lock"), "saving linear probe timings"):
                cachefiles.remove_temps(self.path)
                for old in self.path.parent.glob(f"{self.path.stem}.*.tmp"):  # an older version's temporary files
                    old.unlink(missing_ok=True)
                merged = {**self._read(), **keep}
                cachefiles.write_atomic(self.path, json.dumps(merged, indent=0, sort_keys=True))
        except OSError as exc:  # a full or read-only cache: probe again next time
            logger.warning("contbatch: linear probe verdicts not saved (%s)", exc)
        return not loaded

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
    aten and for exactly the kernels its key names (`time_kernels`'s keys end with them), and no
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


store = ProbeStore()  # this process's


@dataclass(eq=False)
class ProbePool:
    """Memory to cut weight copies from, drawn only when a product is actually timed: with
    every verdict read from the probe file, no random values are drawn at all."""

    numel: int
    dtype: torch.dtype

    def draw(self) -> torch.Tensor:
        # Evenly spaced values: the kernels' speed does not depend on them, and one parallel
        # fill costs a fraction of drawing random numbers for a pool this size.
        return torch.linspace(-0.5, 0.5, self.numel, dtype=torch.float32).to(self.dtype)

    @functools.cached_property
    def tensor(self) -> torch.Tensor:
        return self.draw()


@functools.cache
def stream_bytes() -> int:
    """Bytes a probe pass streams: twice the last-level cache (a cyclic pass over twice the
    cache misses on every line), within MIN_STREAM_BYTES and POOL_BYTES; POOL_BYTES where the
    OS does not say."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return min(POOL_BYTES, max(MIN_STREAM_BYTES, 2 * max(sizes))) if sizes else POOL_BYTES


def probe_pool(model_bytes: int, largest: int, dtype: torch.dtype) -> ProbePool:
    """As many bytes as the model's linears of that dtype (so a model small enough to stay in
    the cache is probed in the cache), at most `stream_bytes()`, and at least one copy of the
    largest weight."""
    size = torch.tensor([], dtype=dtype).element_size()
    return ProbePool(max(min(model_bytes, stream_bytes()) // size, largest), dtype)


def copies(pool: torch.Tensor, out_features: int, in_features: int) -> list[torch.Tensor]:
    """As many [out, in] weights as `pool` holds (at least one), cut from it without copying."""
    size = out_features * in_features
    return [pool[i * size:(i + 1) * size].view(out_features, in_features) for i in range(max(1, pool.numel() // size))]


def packed_copies(weights: list[torch.Tensor], pack: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """One packed copy per weight for the timed passes: the first packed, the others copies of it
    (a kernel's speed does not depend on the values, and copying is several times cheaper than
    packing: the small shapes' pools hold a hundred copies and more)."""
    first = pack(weights[0])
    return [first] + [first.clone() for _ in weights[1:]]


def packed_pools(pool: ProbePool, out_features: int, in_features: int) -> dict[str, Callable[[], list]]:
    """`time_kernels`'s `packs` for one weight shape: per kernel that runs on a packed copy, the
    pool's copies packed (oneDNN's prepacked weights; `panel`'s (plain, packed) pairs), each made
    at its first use and kept for every row count timed (the pool is drawn only then too)."""
    weights = functools.cache(lambda: copies(pool.tensor, out_features, in_features))
    return {"onednn": functools.cache(lambda: packed_copies(weights(), linear_kernels.pack)),
            "panel": functools.cache(lambda: list(zip(weights(), packed_copies(weights(), ops.panel_pack))))}


def _pass(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Seconds per call over one pass calling `fn` once on every weight in turn."""
    start = time.perf_counter()
    for w in weights:
        fn(w)
    return (time.perf_counter() - start) / len(weights)


def _best_of(fns: dict[str, Callable[[torch.Tensor], object]], weights: dict[str, list[torch.Tensor]],
             most: int) -> dict[str, float]:
    """Best-of seconds per call for each kernel: one warm-up and one timed pass each, then
    more passes (up to `most`) only for the kernels still within CLOSE of the best, until one
    is left: a clear loser is not timed again, a close call is timed as often as before."""
    for k, fn in fns.items():
        fn(weights[k][0])
    times = {k: _pass(fn, weights[k]) for k, fn in fns.items()}
    for _ in range(most - 1):
        best = min(times.values())
        close = [k for k in fns if times[k] <= CLOSE * best]
        if len(close) < 2:
            break
        for k in close:
            times[k] = min(times[k], _pass(fns[k], weights[k]))
    return times


def timed_shape(out_features: int, in_features: int, rows: int) -> tuple[int, int]:
    """The weight shape a product of `rows` rows is timed on: its own, but for a compute-bound
    product (HOT_ROWS rows or more) at most HOT_OUT output features. Each output feature is the
    same work there, so the kernels' ratio holds for the whole weight, and a vocabulary-sized
    LM head at 512 rows (tens of GFLOP a call) does not stretch a first start's probe."""
    return (min(out_features, HOT_OUT) if rows >= HOT_ROWS else out_features), in_features


def time_kernels(out_features: int, in_features: int, rows: int, pool: ProbePool, kernels: tuple[str, ...],
                 packs: dict[str, Callable[[], list]] | None = None) -> dict[str, float]:
    """Best-of seconds per kernel for one product, from the store or timed (and stored), per
    thread count and pool. `packs`, where oneDNN runs on prepacked weights and for `panel`
    (which runs only so), gives per kernel the pool's copies packed (what will run), made once
    per shape for every row count probed.

    From HOT_ROWS rows a product does enough arithmetic per weight byte to be compute-bound,
    so a weight read from the cache times as one streamed from memory: those products are timed
    on HOT_BYTES of copies rather than the whole pool."""
    packs = packs or {}
    prepack = "onednn" in packs
    hot = rows >= HOT_ROWS
    where = f"hot={HOT_BYTES}" if hot else f"pool={pool.numel}"
    key = (f"{out_features}x{in_features} rows={rows} threads={torch.get_num_threads()} {where} "
           f"{pool.dtype} {','.join(kernels)}{' packed' if prepack else ''}")
    times = store.get(key)
    if times is None:
        weights = copies(pool.tensor, out_features, in_features)
        size = out_features * in_features * pool.tensor.element_size()
        count = max(1, HOT_BYTES // size) if hot else len(weights)
        x = (torch.rand(rows, in_features, generator=torch.Generator().manual_seed(0)) - 0.5).to(pool.dtype)
        most = max(3, min(10, int(2e8 // max(out_features * in_features * rows * count, 1))))
        fns = {"aten": torch.nn.functional.linear,
               "onednn": linear_kernels.packed_linear if prepack else linear_kernels.onednn_linear,
               "small_linear": ops.small_linear, "upcast": linear_kernels.upcast_linear,
               "panel": lambda x, pair, b: ops.panel_linear(x, pair[0], pair[1], b)}
        with torch.inference_mode():
            times = _best_of({k: (lambda w, f=fns[k]: f(x, w, None)) for k in kernels},
                             {k: (packs[k]() if k in packs else weights)[:count] for k in kernels}, most)
        store.put(key, times)
    return times
