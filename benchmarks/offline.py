"""Offline throughput: contbatch vs transformers' continuous batching vs padded `generate`, on CPU.

One run measures every system at each dtype on the same seeded workload (random prompts of
varied length, a fixed number of new tokens, EOS ignored), plus the dense matmul rate of the
machine at that dtype, so the numbers can be read against a compute ceiling measured in the
same conditions. Wall times include each system's start-up (cache allocation, thread start),
because that is what a user of `generate_batch` pays. Every timed system runs in a worker
thread, as the engines' own step loops do (see `in_worker`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from math import ceil
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig

import contbatch

SYSTEMS = ("contbatch", "contbatch-8192", "tf-cb", "padded16", "padded64", "padded16-sorted")
PEER = "tf-cb"
TF_PAGE_SIZE = 256  # transformers' default page size, stated so num_blocks below is sized for it


@dataclass
class Workload:
    prompts: list[list[int]]
    new_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        return len(self.prompts) * self.new_tokens


@dataclass
class Row:
    """One system at one dtype. Ratios are filled in once every system has run."""

    system: str
    wall_s: float
    output_tokens: int
    tok_s: float
    vs_peer: float | None = None
    vs_best_padded: float | None = None
    outside_forward: float | None = None  # share of engine step time spent outside the model forward
    note: str = ""


def make_prompts(tok, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Random ids, never special/added tokens: those could trigger template or stop behaviour."""
    g = torch.Generator().manual_seed(seed)
    banned = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    allowed = torch.tensor([i for i in range(len(tok)) if i not in banned])
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [allowed[torch.randint(len(allowed), (n_tok,), generator=g)].tolist() for n_tok in lengths]


def machine_info() -> dict:
    """Load average matters: every multithreaded matmul waits for its slowest thread."""
    cpu = platform.processor()
    if not cpu and Path("/proc/cpuinfo").exists():
        names = [l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in l]
        cpu = names[0] if names else ""
    return {"cpu": cpu or "unknown", "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
            "transformers": transformers.__version__}


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """GFLOP/s of an [m x k] @ [k x n] matmul: the shapes of one decode step / one prefill chunk."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    iters, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        iters += 1
    return 2 * m * k * n * iters / elapsed / 1e9


def in_worker(fn):
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


def _cleanup(model, attn: str) -> None:
    """Every system starts from the same model state, whatever the previous one left behind."""
    if model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    gc.collect()


def run_contbatch(model, wl: Workload, name: str, max_batch_tokens: int | None) -> tuple[Row, list[list[int]]]:
    """Through the manager (what generate_batch does), so step/forward stats can be read before exit."""
    gc_ = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=None)
    cfg = contbatch.ContinuousBatchingConfig(  # the workload hints generate_batch would fill in
        max_batch_tokens=max_batch_tokens, max_prompt_length=max(len(p) for p in wl.prompts),
        max_generated_length=wl.new_tokens, max_requests_per_batch=len(wl.prompts))
    ids = [f"req_{i}" for i in range(len(wl.prompts))]
    start = time.perf_counter()
    with contbatch.continuous_batching(model, gc_, cfg) as manager:
        manager.add_requests(wl.prompts, request_ids=ids)
        outs = [manager.get_result(rid, timeout=None) for rid in ids]
        stats, rc = manager.stats(), manager.resolved_config
    wall = time.perf_counter() - start
    tokens = [list(o.generated_tokens) for o in outs]
    n_out = sum(map(len, tokens))
    outside = 1 - stats["forward_seconds"] / stats["step_seconds"] if stats["step_seconds"] else None
    note = f"steps={stats['steps']} mbt={rc.max_batch_tokens} blocks={rc.num_blocks}x{rc.block_size} attn={rc.attention_backend}"
    return Row(name, wall, n_out, n_out / wall, outside_forward=outside, note=note), tokens


def run_transformers_cb(model, wl: Workload) -> tuple[Row, list[list[int]]]:
    """The peer. num_blocks is explicit: left unset, it zero-fills a cache sized from most of free RAM.
    eos_token_id=-1 is how transformers' CB spells 'never stop on EOS' (None means the model's)."""
    per_req = ceil((max(len(p) for p in wl.prompts) + wl.new_tokens) / TF_PAGE_SIZE)
    cfg = transformers.ContinuousBatchingConfig(page_size=TF_PAGE_SIZE, num_blocks=len(wl.prompts) * per_req + 2,
                                                max_batch_tokens=2048, max_requests_per_batch=len(wl.prompts))
    gc_ = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=wl.prompts, generation_config=gc_, continuous_batching_config=cfg,
                                progress_bar=False)
    wall = time.perf_counter() - start
    tokens = [list(o.generated_tokens) for o in outs.values()]  # returned in input order
    n_out = sum(map(len, tokens))
    note = f"mbt=2048 blocks={cfg.num_blocks}x{TF_PAGE_SIZE} attn=sdpa" + ("" if len(tokens) == len(wl.prompts) else " MISSING")
    return Row(PEER, wall, n_out, n_out / wall, note=note), tokens


@torch.inference_mode()
def run_padded(model, tok, wl: Workload, name: str, batch_size: int, sort: bool) -> tuple[Row, list[list[int]]]:
    """Static batching with left padding. Sorting by length is its best case (least padding).
    eos_token_id=-1 rather than min_new_tokens: the latter masks the EOS logit and changes greedy tokens."""
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i])) if sort else list(range(len(wl.prompts)))
    gc_ = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    tok.padding_side = "left"
    tokens: list[list[int] | None] = [None] * len(wl.prompts)
    padded = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        batch = tok.pad({"input_ids": [wl.prompts[i] for i in idx]}, return_tensors="pt", padding=True)
        out = model.generate(**batch, generation_config=gc_)
        width = batch["input_ids"].shape[1]
        padded += width * len(idx)
        for row, i in enumerate(idx):
            tokens[i] = out[row, width:].tolist()
    wall = time.perf_counter() - start
    n_out = sum(map(len, tokens))
    note = f"padding {1 - wl.prompt_tokens / padded:.0%} of prompt positions"
    return Row(name, wall, n_out, n_out / wall, note=note), tokens


def warm_up(model, tok) -> None:
    """First calls pay one-off kernel/allocator set-up; keep that out of the first timed system."""
    with torch.inference_mode():
        batch = tok.pad({"input_ids": [[100] * 8, [200] * 16]}, return_tensors="pt", padding=True)
        model.generate(**batch, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1,
                                                                    pad_token_id=tok.pad_token_id))


def bench_dtype(dtype_name: str, args, systems: list[str]) -> dict:
    dtype = getattr(torch, dtype_name)
    model, tok = contbatch.load_model(dtype=dtype)
    attn = model.config._attn_implementation
    wl = Workload(make_prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed), args.new_tokens)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once
    warm_up(model, tok)  # in the main thread: its OpenMP team exists for every system alike
    mm = {f"{m}x576@576x1536": in_worker(lambda m=m: matmul_rate(m, 576, 1536, dtype)) for m in (64, 512)}
    # Compute floor: every processed token (prompt + generated) costs ~2 * n_params FLOP at the big-matmul rate.
    # It ignores attention FLOPs and that prompt tokens skip the LM head; a rough ceiling, not a bound.
    processed = wl.prompt_tokens + wl.generated_tokens
    ceiling = wl.generated_tokens / (processed * 2 * n_params / (mm["512x576@576x1536"] * 1e9))
    print(f"\n== {dtype_name}: {len(wl.prompts)} prompts, {wl.prompt_tokens} prompt + {wl.generated_tokens} new tokens, "
          f"{n_params / 1e6:.1f}M params")
    print("   matmul GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in mm.items()))
    print(f"   compute ceiling: {ceiling:.1f} output tok/s")
    runners = {
        "contbatch": lambda: run_contbatch(model, wl, "contbatch", None),
        "contbatch-8192": lambda: run_contbatch(model, wl, "contbatch-8192", 8192),
        PEER: lambda: run_transformers_cb(model, wl),
        "padded16": lambda: run_padded(model, tok, wl, "padded16", 16, False),
        "padded64": lambda: run_padded(model, tok, wl, "padded64", 64, False),
        "padded16-sorted": lambda: run_padded(model, tok, wl, "padded16-sorted", 16, True),
    }
    rows, tokens = {}, {}
    for name in systems:
        rows[name], tokens[name] = in_worker(runners[name])
        _cleanup(model, attn)
        print(f"   {name:<16} {rows[name].wall_s:8.2f} s  {rows[name].tok_s:8.1f} tok/s  {rows[name].note}", flush=True)
    best_padded = max((r.tok_s for n, r in rows.items() if n.startswith("padded")), default=None)
    for r in rows.values():
        r.vs_peer = r.tok_s / rows[PEER].tok_s if PEER in rows else None
        r.vs_best_padded = r.tok_s / best_padded if best_padded else None
    checks = {f"{n}_tokens_ok": rows[n].output_tokens == wl.generated_tokens for n in rows}
    if dtype == torch.float32 and "contbatch" in tokens and PEER in tokens:
        k = min(8, len(wl.prompts))
        checks[f"contbatch_vs_{PEER}_agree_first_{k}"] = sum(a == b for a, b in zip(tokens["contbatch"][:k], tokens[PEER][:k]))
    print("   checks: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    print(table(list(rows.values())))
    del model
    gc.collect()
    return {"matmul_gflops": mm, "n_params": n_params, "ceiling_tok_s": ceiling, "prompt_tokens": wl.prompt_tokens,
            "generated_tokens": wl.generated_tokens, "rows": [dataclasses.asdict(r) for r in rows.values()],
            "checks": checks}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    lines = ["| system | wall s | output tok/s | vs tf generate_batch | vs best padded | outside forward | notes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.system} | {r.wall_s:.2f} | {r.tok_s:.1f} | {_fmt(r.vs_peer, '.2f')} | "
                     f"{_fmt(r.vs_best_padded, '.2f')} | {_fmt(r.outside_forward, '.1%')} | {r.note} |")
    return "\n".join(lines)


def markdown_section(report: dict) -> str:
    m, w = report["machine"], report["workload"]
    out = [f"\n## offline.py, {datetime.date.today().isoformat()}\n",
           f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
           f"transformers {m['transformers']}; load average before the run {m['loadavg']}.",
           f"Workload: {w['num_prompts']} prompts of {w['min_len']}..{w['max_len']} tokens (seed {w['seed']}), "
           f"{w['new_tokens']} new tokens each, EOS ignored.\n"]
    for dtype_name, d in report["dtypes"].items():
        mm = ", ".join(f"{k} {v:.1f}" for k, v in d["matmul_gflops"].items())
        out += [f"### {dtype_name}\n", f"Matmul GFLOP/s: {mm}. Compute ceiling {d['ceiling_tok_s']:.1f} output tok/s "
                f"({d['prompt_tokens']} prompt + {d['generated_tokens']} generated tokens, "
                f"{d['n_params'] / 1e6:.1f}M params).\n",
                table([Row(**r) for r in d["rows"]]), "", "Checks: " + ", ".join(f"{k}={v}" for k, v in d["checks"].items()), ""]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"comma list of: {', '.join(SYSTEMS)}")
    p.add_argument("--out", type=Path, help="write the full report as JSON here")
    p.add_argument("--results-md", type=Path, help="append a markdown section here (e.g. benchmarks/RESULTS.md)")
    args = p.parse_args()
    systems = [s for s in args.only.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    transformers.logging.set_verbosity_error()  # eos=-1 warns on every padded batch

    machine = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    if machine["loadavg"][0] > 0.5:
        print(f"WARNING: 1-minute load average {machine['loadavg'][0]} > 0.5: the machine is not quiet, "
              "every multithreaded matmul will wait on the other processes and the numbers will be low and noisy.")
    workload = {k: getattr(args, k) for k in ("num_prompts", "min_len", "max_len", "new_tokens", "seed")}
    report = {"machine": machine, "workload": workload,
              "dtypes": {d: bench_dtype(d, args, systems) for d in args.dtypes.split(",") if d}}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    if args.results_md:
        with args.results_md.open("a") as f:
            f.write(markdown_section(report))
        print(f"appended to {args.results_md}")


if __name__ == "__main__":
    main()
