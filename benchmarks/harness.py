"""Shared machinery for the comparative benchmarks (offline.py, kv_pressure.py, serve.py, prefix_eviction.py).

What every comparative benchmark gets from here, so they all measure the same way:

- `machine_info()`: CPU model (/proc/cpuinfo), cores, torch/transformers/python versions, threads.
- `in_worker(fn)`: every timed run in a fresh worker thread, as the engines' own step loops run.
- `LoadMonitor`: the 1-minute load average before the run and, from a sampling thread, during it,
  against the benchmark's own busy threads (process CPU time / wall time). The noisy rule is
  `noisy_rule()`; its text goes in every report.
- `run_interleaved()`: one untimed warm-up run per system, then N rounds, each running every
  system once, the starting system rotated each round (A B / B A / A B ... for two systems), so
  slow drift and one-off disturbances fall on every system alike.
- `Spread` / `ratio()`: median with [min, max], and ratios of medians with the range from the
  min/max pairs.
- `reference_tokens()` / `check_tokens()`: greedy tokens of `model.generate` on each prompt
  alone, computed once per workload, against which every system's float32 tokens are compared.
- `matmul_rate()` / `weight_read_bandwidth()`: the hardware ceilings at a dtype, measured in the run.
- `md_table()`, `report_header()`, `write_results()`: markdown output, and the rule that a noisy
  run (or one with a token mismatch in a posted row) is not appended to RESULTS.md unless
  `--force-results` is given.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NOISE_THRESHOLD = 0.5  # foreign load (runnable threads not ours), in the units of the load average
LOAD_TAU_S = 60.0  # the 1-minute load average is an exponential average with this time constant
SAMPLE_INTERVAL_S = 1.0


# --------------------------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        info["mem_gib"] = round(int(mem["MemTotal"].split()[0]) / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    return info


def machine_line(m: dict) -> str:
    return (f"{m['cpu']}, {m['cpu_count']} CPUs" + (f", {m['mem_gib']} GiB" if m.get("mem_gib") else "")
            + f"; torch {m['torch']} ({m['torch_threads']} threads)"
            + (f", transformers {m['transformers']}" if m.get("transformers") else "") + f", Python {m['python']}")


# --------------------------------------------------------------------------------------------- load


def noisy_rule(threshold: float = NOISE_THRESHOLD) -> str:
    return (f"noisy = 1-min load average before the run > {threshold}, or the mean foreign load during it > "
            f"{threshold}; foreign load = 1-min load average - own busy threads, where own busy threads are the "
            f"benchmark's process CPU time / wall time (servers' processes included), passed through the same "
            f"{LOAD_TAU_S:.0f} s exponential average as the kernel's load average, sampled every "
            f"{SAMPLE_INTERVAL_S:.0f} s")


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class LoadMonitor:
    """Samples the 1-minute load average and the benchmark's own CPU time in a thread.

    The kernel's load average counts runnable threads, ours included. Our own contribution is
    estimated from CPU time: over each sample interval, busy = d(CPU seconds) / d(wall seconds)
    (the average number of our threads on a CPU), and that is passed through the same
    exponential average (tau 60 s) the kernel applies, starting from 0 at `start()`. What is
    left, `load1 - own_ema`, is the foreign load (plus the decaying load from before the
    start, which was not ours either). `pids` adds other processes (servers) to "own".
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
        return time.process_time() + sum(_proc_cpu_seconds(p) for p in self.pids)

    def add_pid(self, pid: int) -> None:
        self.pids.append(pid)

    def start(self) -> "LoadMonitor":
        self.before = os.getloadavg()
        self._t0 = self._last_t = time.perf_counter()
        self._cpu0 = self._last_cpu = self._cpu()
        self._own_ema = 0.0
        self._thread = threading.Thread(target=self._loop, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        now, cpu = time.perf_counter(), self._cpu()
        dt = now - self._last_t
        if dt <= 0:
            return
        busy = max(0.0, (cpu - self._last_cpu) / dt)
        decay = math.exp(-dt / LOAD_TAU_S)
        self._own_ema = self._own_ema * decay + busy * (1 - decay)
        load1 = os.getloadavg()[0]
        self.samples.append({"t": round(now - self._t0, 2), "load1": load1, "busy": round(busy, 3),
                             "own_ema": round(self._own_ema, 3), "foreign": round(load1 - self._own_ema, 3)})
        self._last_t, self._last_cpu = now, cpu

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


# --------------------------------------------------------------------------------------------- running


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


def interleaved_order(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """Round r runs every system once, starting at system r mod n: A B C / B C A / C A B / ..."""
    n = len(names)
    return [(r, names[(r + i) % n]) for r in range(repeats) for i in range(n)]


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


# --------------------------------------------------------------------------------------------- statistics


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


# --------------------------------------------------------------------------------------------- tokens


def reference_tokens(model, prompts: Sequence[Sequence[int]], max_new: Sequence[int], pad_token_id=None,
                     log: Callable[[str], None] = print) -> list[list[int]]:
    """Greedy `model.generate` on each prompt alone (batch 1, no padding), EOS ignored: the
    tokens every system must reproduce at float32. Run in a worker thread like the systems."""
    import torch
    from transformers import GenerationConfig

    def go() -> list[list[int]]:
        out = []
        start = time.perf_counter()
        with torch.inference_mode():
            for p, n in zip(prompts, max_new):
                gc_ = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=-1,
                                       pad_token_id=pad_token_id)
                ids = torch.tensor([list(p)])
                res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
                out.append(res[0, ids.shape[1]:].tolist())
        log(f"   reference: model.generate on each of {len(prompts)} prompts alone, "
            f"{time.perf_counter() - start:.1f} s")
        return out

    return in_worker(go)


def check_tokens(tokens: Sequence[Sequence[int]] | None, ref: Sequence[Sequence[int]] | None) -> dict:
    """{'checked': bool, 'mismatch': k, 'n': N, 'first': index of the first differing request}"""
    if ref is None or tokens is None:
        return {"checked": False}
    bad = [i for i, (a, b) in enumerate(zip(tokens, ref)) if list(a) != list(b)]
    bad += list(range(min(len(tokens), len(ref)), max(len(tokens), len(ref))))
    return {"checked": True, "mismatch": len(bad), "n": len(ref), "first": bad[0] if bad else None}


def check_label(check: dict) -> str:
    if not check.get("checked"):
        return "not checked"
    return "ok" if check["mismatch"] == 0 else f"MISMATCH {check['mismatch']}/{check['n']}"


def worst_check(checks: Sequence[dict]) -> dict:
    """Over the repeats of one system: the run with the most mismatches speaks for all."""
    checked = [c for c in checks if c.get("checked")]
    return max(checked, key=lambda c: c["mismatch"]) if checked else {"checked": False}


# --------------------------------------------------------------------------------------------- ceilings


def matmul_rate(dtype, n: int = 2048, seconds: float = 1.0) -> float:
    """GFLOP/s of a large square [n x n] @ [n x n] matmul at `dtype`: the best of a timed loop,
    and the best of PyTorch's own kernel, oneDNN's and (bfloat16) the product in float32: the
    machine's ceiling is the fastest (in float32 on AMD CPUs MKL, which `@` calls, runs at about
    half oneDNN's rate). A kernel whose first call outlasts `seconds` is not timed further
    (PyTorch's bfloat16 `@` took ~60 s at 2048^3 on an AVX2-only EPYC)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    kernels = [lambda: a @ b]
    from contbatch.engine.cpu_linear import onednn_available

    if dtype == torch.bfloat16:  # without a bfloat16 GEMM (AVX2-only EPYC: ~0.3 GFLOP/s here), float32 is the
        kernels.append(lambda: a.float() @ b.float())  # fastest bfloat16 product, as the engine's upcast kernel runs it
    if onednn_available(dtype):  # not every CPU runs oneDNN's bfloat16 linear (AVX2-only EPYCs do not)
        bt = b.t().contiguous()
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], ""))
    best = math.inf
    for kernel in kernels:
        t = time.perf_counter()
        kernel()
        if time.perf_counter() - t > seconds:
            best = min(best, time.perf_counter() - t)
            continue
        kernel()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def weight_read_bandwidth(model, repeats: int = 5) -> tuple[float, int, str]:
    """(GB/s, bytes, how): the best time to read every parameter once, as a decode step at
    batch 1 must, by the fastest of several readers (as `matmul_rate` takes the fastest
    GEMM): a sum over each parameter, and a one-row product against each 2-D weight (the
    GEMV a lone decode step runs) through PyTorch's kernel, oneDNN's and contbatch's few-row
    kernel where they run; 1-D parameters are summed. On the 2-core EPYC the sum and our
    kernel read within a few percent of each other in the same run, either one ahead: the
    floor is the faster, so it never rests on a slow reader. Tied weights are counted once
    (`parameters()` deduplicates them)."""
    import torch

    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    rows = {p.shape[1]: torch.randn(1, p.shape[1]).to(p.dtype) for p in mats}
    readers = {"sum": lambda p: p.sum(), "aten GEMV": lambda p: torch.nn.functional.linear(rows[p.shape[1]], p)}
    from contbatch import native
    from contbatch.engine.cpu_linear import onednn_available

    if onednn_available(params[0].dtype):
        readers["oneDNN GEMV"] = lambda p: torch.ops.mkldnn._linear_pointwise(rows[p.shape[1]], p, None, "none", [], "")
    if native.load()[0]:
        readers["contbatch GEMV"] = lambda p: torch.ops.contbatch_cpu.small_linear(rows[p.shape[1]], p, None)
    best, how = math.inf, ""
    with torch.inference_mode():
        for name, read in readers.items():
            for _ in range(repeats):
                t = time.perf_counter()
                for p in mats:
                    read(p)
                for p in vecs:
                    p.sum()
                took = time.perf_counter() - t
                if took < best:
                    best, how = took, name
                elif took > 4 * best:  # a slow reader here (a bfloat16 GEMV without a bfloat16 kernel)
                    break
    return nbytes / best / 1e9, nbytes, how


def non_embedding_params(model) -> int:
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total - emb.numel()


# --------------------------------------------------------------------------------------------- output


def md_table(headers: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool] | None = None) -> str:
    right = right or [i > 0 for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def report_header(title: str, machine: dict, load: dict | None, threshold: float = NOISE_THRESHOLD) -> list[str]:
    lines = [f"\n## {datetime.date.today().isoformat()} — {title}\n",
             f"Command: `{command_line()}`  ",
             f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}  ",
             f"Machine: {machine_line(machine)}  "]
    if load is not None:
        lines.append(f"Load: {load_line(load)}  ")
        lines.append(f"Rule: {noisy_rule(threshold)}.")
    lines.append("")
    return lines


def add_common_args(p, repeats: int = 3) -> None:
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs per system, interleaved (default %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each system")
    p.add_argument("--noise-threshold", type=float, default=NOISE_THRESHOLD,
                   help="foreign load above which a run is labelled noisy (default %(default)s)")
    p.add_argument("--out", type=Path, help="write the full report as JSON here")
    p.add_argument("--results-md", type=Path, help="append the markdown section here (e.g. benchmarks/RESULTS.md), "
                                                   "unless the run is noisy")
    p.add_argument("--force-results", action="store_true", help="append to --results-md even when the run is noisy")


def write_outputs(args, report: dict, markdown: str, blockers: Sequence[str] = ()) -> None:
    """JSON always (when asked); the markdown goes to --results-md unless the run was noisy (or a
    blocker such as a token mismatch is named), where --force-results overrides."""
    report = {**report, "markdown": markdown}
    if getattr(args, "out", None):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    if getattr(args, "results_md", None):
        load = report.get("load") or {}
        reasons = (["noisy run: " + "; ".join(load.get("noisy_reasons", []))] if load.get("noisy") else []) + list(blockers)
        if reasons and not args.force_results:
            print(f"NOT appended to {args.results_md}: " + " / ".join(reasons) + " (--force-results to append anyway)")
            return
        with args.results_md.open("a") as f:
            if reasons:
                f.write(markdown + "\n\n**Forced into this file (--force-results) despite: " + " / ".join(reasons) + ".**\n")
            else:
                f.write(markdown + "\n")
        print(f"appended to {args.results_md}")
