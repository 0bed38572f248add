"""Offline throughput: contbatch vs transformers' continuous batching vs padded `generate`, on CPU.

Every request is there at the start. For each dtype and each workload (fixed or mixed
lengths x prompts cut from one text or built with the chat template) the run:

1. computes the float32 reference once: greedy `model.generate` on each prompt alone;
2. sweeps each system's own knobs the way its best user would (`--sweep`), one timed run per
   candidate after one untimed warm-up per system, and keeps the fastest token-exact one:
   contbatch `max_batch_tokens` / `block_size`; transformers' `generate_batch`
   (`ContinuousBatchingConfig`) `max_batch_tokens` / `page_size`; padded `generate` batch size
   and length sorting;
3. runs each system's default and best configuration, one untimed warm-up each, then
   `--repeats` interleaved rounds (the first system rotated each round), and reports the median
   tok/s with [min, max], the ratio to each peer's best (ratio of medians, range from the
   min/max pairs), each system's fraction of the matmul floor, and the token check.

Plus, at each dtype: the hardware ceilings measured in the same run (dense matmul GFLOP/s,
weight-read GB/s) and a single-stream row (one request, 256 new tokens: contbatch against
plain `model.generate` at batch 1) against the weight-read floor, end to end and decoding alone:
each system also runs the same prompt for one new token in every round, and (new tokens - 1) /
(the difference of the two walls) is its decode rate, start-up and prefill left out alike.

Wall times include each system's start-up (cache allocation, thread start), because that is
what a user pays. Shared machinery (load sampling, noisy rule, interleaving, statistics,
tables) is in `harness.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import contbatch  # noqa: E402
import harness as H  # noqa: E402

FAMILIES = ("contbatch", "tf-cb", "padded")
PEERS = ("tf-cb", "padded")
FAMILY_TITLE = {"contbatch": "contbatch", "tf-cb": "transformers generate_batch", "padded": "padded generate"}
ATTENTION = {
    "contbatch": "torch backend with our C++ kernels: every prompt chunk of a step in one call, every decode row in "
                 "another, both reading K/V in place through the block tables",
    "tf-cb": "sdpa: a dense [batch tokens x (cache tokens + batch tokens)] mask built every step, attention over the "
             "whole batch's keys",
    "padded": "sdpa over the padded batch, [B, 1, q, k] mask",
}
TF_DEFAULT_PAGE = 256  # transformers' default page_size


# --------------------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    kind: str  # "fixed" or "mixed"
    source: str  # "text" or "chat"
    prompts: list[list[int]]
    max_new: list[int]
    reference: list[list[int]] | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.source}"

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def generated_tokens(self) -> int:
        return sum(self.max_new)

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        new = (f"{self.max_new[0]} new tokens each" if self.kind == "fixed" else
               f"max_new_tokens log-uniform {min(self.max_new)}..{max(self.max_new)} (mean {self.generated_tokens / len(self.max_new):.0f})")
        src = ("cut from one text (Python's pydoc topics)" if self.source == "text"
               else "built with the chat template around text cut from the same source")
        return (f"{len(self.prompts)} prompts {src}, {min(lens)}..{max(lens)} tokens ({self.prompt_tokens} in all), "
                f"{new}, EOS ignored; {self.generated_tokens} output tokens")


def source_text() -> str:
    """One long, fixed English text that ships with Python: the pydoc topics (~465k characters)."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def cut_pieces(ids: list[int], n: int, lo: int, hi: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def make_prompts(tok, source: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{source}-{seed}")
    ids = tok(source_text())["input_ids"]
    if source == "text":
        return cut_pieces(ids, n, lo, hi, rng)
    out = []
    for piece in cut_pieces(ids, n, lo, hi, rng):
        msg = [{"role": "user", "content": tok.decode(piece) + "\n\nSummarize the text above."}]
        enc = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def make_new_tokens(kind: str, n: int, fixed: int, lo: int, hi: int, seed: int) -> list[int]:
    if kind == "fixed":
        return [fixed] * n
    rng = random.Random(f"mixed-{seed}")
    return [min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(n)]


# --------------------------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class Config:
    family: str
    params: tuple  # sorted (knob, value) pairs; () = the family's default

    @property
    def label(self) -> str:
        if not self.params:
            return f"{self.family} (default)"
        return f"{self.family} " + " ".join(f"{k}={v}" for k, v in self.params)

    def get(self, key, default=None):
        return dict(self.params).get(key, default)

    def with_(self, **kw) -> "Config":
        d = dict(self.params)
        d.update(kw)
        return Config(self.family, tuple(sorted(d.items())))


def run_contbatch(model, wl: Workload, cfg: Config) -> H.Sample:
    """Through the manager (what `contbatch.generate_batch` does), so step/forward stats can be read."""
    gen = GenerationConfig(max_new_tokens=max(wl.max_new), do_sample=False, eos_token_id=None)
    sps = [contbatch.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wl.max_new]
    kw = dict(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.max_new),
              max_requests_per_batch=len(wl.prompts))  # the workload hints generate_batch fills in
    if cfg.get("mbt"):
        kw["max_batch_tokens"] = cfg.get("mbt")
    if cfg.get("block"):
        kw["block_size"] = cfg.get("block")
    if cfg.get("level") is not None:
        kw["default_compile_level"] = cfg.get("level")
    ids = [f"req_{i}" for i in range(len(wl.prompts))]
    start = time.perf_counter()
    with contbatch.continuous_batching(model, gen, contbatch.ContinuousBatchingConfig(**kw)) as manager:
        manager.add_requests(wl.prompts, request_ids=ids, sampling_params=sps)
        outs = [manager.get_result(rid, timeout=None) for rid in ids]
        stats, rc = manager.stats(), manager.resolved_config
    wall = time.perf_counter() - start
    tokens = [list(o.generated_tokens) for o in outs]
    return H.Sample(wall, sum(map(len, tokens)), tokens, {
        "steps": stats["steps"], "step_seconds": stats["step_seconds"],
        "resolved": f"mbt={rc.max_batch_tokens} blocks={rc.num_blocks}x{rc.block_size} attn={rc.attention_backend}"})


def run_tf_cb(model, wl: Workload, cfg: Config) -> H.Sample:
    """The peer: transformers' continuous batching, through the context manager `generate_batch`
    uses, so each request gets its own max_new_tokens. num_blocks is sized for the workload (left
    unset on the CPU, it zero-fills a cache sized from most of free RAM). eos_token_id=-1 is how
    it spells 'never stop on EOS'."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page = cfg.get("page", TF_DEFAULT_PAGE)
    blocks = sum(ceil((len(p) + n + 1) / page) for p, n in zip(wl.prompts, wl.max_new)) + 2
    cb = transformers.ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=cfg.get("mbt"),
                                               max_requests_per_batch=len(wl.prompts))
    gen = GenerationConfig(max_new_tokens=max(wl.max_new), do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.max_new),
                          num_requests=len(wl.prompts))
    ids = [f"req_{i}" for i in range(len(wl.prompts))]
    results: dict = {}
    resolved = ""
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                   timeout=5, workload_hints=hints) as manager:
        for rid, p, n in zip(ids, wl.prompts, wl.max_new):
            manager.add_request(input_ids=p, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None:
                if out.is_finished():
                    results[out.request_id] = out
            elif not manager.is_running():
                break
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        if cache is not None:
            resolved = f"mbt={getattr(cache, 'max_batch_tokens', '?')} blocks={blocks}x{page}"
    wall = time.perf_counter() - start
    tokens = [list(results[r].generated_tokens) if r in results else [] for r in ids]
    extra = {"resolved": resolved or f"blocks={blocks}x{page}"}
    if len(results) < len(ids):
        extra["missing"] = len(ids) - len(results)
    return H.Sample(wall, sum(map(len, tokens)), tokens, extra)


def padded_order(wl: Workload, sort: str) -> list[int]:
    idx = list(range(len(wl.prompts)))
    if sort == "prompt":
        return sorted(idx, key=lambda i: len(wl.prompts[i]))
    if sort == "new":  # requested length first, prompt length second: the least wasted decode steps
        return sorted(idx, key=lambda i: (wl.max_new[i], len(wl.prompts[i])))
    return idx


@torch.inference_mode()
def run_padded(model, tok, wl: Workload, cfg: Config) -> H.Sample:
    """Static batching with left padding: each batch runs to its longest request; only the
    requested tokens of each request count. eos_token_id=-1 rather than min_new_tokens: the
    latter masks the EOS logit and changes greedy tokens."""
    batch_size = cfg.get("batch") or len(wl.prompts)
    order = padded_order(wl, cfg.get("sort", "none"))
    tok.padding_side = "left"
    tokens: list[list[int] | None] = [None] * len(wl.prompts)
    positions = decode_slots = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        steps = max(wl.max_new[i] for i in idx)
        gen = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id)
        batch = tok.pad({"input_ids": [wl.prompts[i] for i in idx]}, return_tensors="pt", padding=True)
        out = model.generate(**batch, generation_config=gen)
        width = batch["input_ids"].shape[1]
        positions += width * len(idx)
        decode_slots += steps * len(idx)
        for row, i in enumerate(idx):
            tokens[i] = out[row, width:width + wl.max_new[i]].tolist()
    wall = time.perf_counter() - start
    return H.Sample(wall, sum(map(len, tokens)), tokens, {
        "padding": 1 - wl.prompt_tokens / positions, "wasted_decode": 1 - wl.generated_tokens / decode_slots})


def runner(model, tok, wl: Workload, cfg: Config) -> Callable[[], H.Sample]:
    if cfg.family == "contbatch":
        return lambda: run_contbatch(model, wl, cfg)
    if cfg.family == "tf-cb":
        return lambda: run_tf_cb(model, wl, cfg)
    return lambda: run_padded(model, tok, wl, cfg)


# --------------------------------------------------------------------------------------------- sweep


def sweep_stages(family: str, wl: Workload, mode: str) -> list[list[dict]]:
    """Coordinate sweep: each stage is a list of knob settings tried on top of the best found so
    far. Values equal to the default are left out so the default is not run twice."""
    n = len(wl.prompts)
    if mode == "none":
        return []
    if family == "contbatch":
        if mode == "quick":
            return [[{"mbt": 1024}]]
        return [[{"mbt": v} for v in (1024, 4096, 8192)], [{"block": 64}]]
    if family == "tf-cb":
        if mode == "quick":
            return [[{"mbt": 512}]]
        return [[{"mbt": v} for v in (256, 512, 1024, 2048)], [{"page": v} for v in (64, 16)]]
    # padded: sorting only matters with more than one batch, so batch size and sort key are a grid
    sorts = ["prompt", "new"] if wl.kind == "mixed" else ["prompt"]
    if mode == "quick":
        return [[{"batch": max(1, n // 2), "sort": sorts[-1]}]]
    return [[{"batch": b, "sort": s} for b in (4, 8, 16, 32) if b < n for s in sorts]]


def run_sweep(model, tok, wl: Workload, family: str, mode: str, between, warmup: bool, log) -> tuple[Config, list[dict]]:
    """One untimed warm-up (the default config), then one timed run per candidate; the fastest
    token-exact candidate wins (at bf16 there is no reference: the fastest)."""
    default = Config(family, ())
    stages = sweep_stages(family, wl, mode)
    if not stages:
        return default, []
    tried: dict[Config, dict] = {}

    def measure(cfg: Config) -> dict:
        if cfg not in tried:
            s = H.in_worker(runner(model, tok, wl, cfg))
            between()
            check = H.check_tokens(s.tokens, wl.reference)
            ok = (not check.get("checked") or check["mismatch"] == 0) and s.output_tokens == wl.generated_tokens
            tried[cfg] = {"config": cfg.label, "tok_s": s.tok_s, "wall_s": s.wall_s, "check": H.check_label(check),
                          "ok": ok, **{k: v for k, v in s.extra.items() if k != "resolved"}}
            log(f"   sweep    {cfg.label:<28} {s.wall_s:8.2f} s  {s.tok_s:8.1f} tok/s  {H.check_label(check)}")
        return tried[cfg]

    if warmup:
        s = H.in_worker(runner(model, tok, wl, default))
        between()
        log(f"   sweep warm-up {default.label:<23} {s.wall_s:8.2f} s")
    best = default
    measure(default)
    for stage in stages:
        for setting in stage:
            measure(best.with_(**setting))
        ok = {c: r for c, r in tried.items() if r["ok"]}
        if ok:
            best = max(ok, key=lambda c: ok[c]["tok_s"])
    return best, list(tried.values())


# --------------------------------------------------------------------------------------------- one scenario


@dataclass
class RowResult:
    config: Config
    role: str  # "default", "best", "default = best"
    samples: list[H.Sample] = field(default_factory=list)

    @property
    def spread(self) -> H.Spread:
        return H.Spread.of([s.tok_s for s in self.samples])

    @property
    def wall(self) -> H.Spread:
        return H.Spread.of([s.wall_s for s in self.samples])


def posted(row: RowResult, wl: Workload) -> tuple[bool, str]:
    """A row's speed is posted only if every run produced the requested tokens and, at float32,
    the reference's tokens."""
    check = H.worst_check([H.check_tokens(s.tokens, wl.reference) for s in row.samples])
    counts_ok = all(s.output_tokens == wl.generated_tokens for s in row.samples)
    label = H.check_label(check)
    if not counts_ok:
        label += f"; COUNT {min(s.output_tokens for s in row.samples)}/{wl.generated_tokens}"
    return (counts_ok and (not check.get("checked") or check["mismatch"] == 0)), label


CEILING = "ceiling probe"  # a pseudo-system: the hardware ceiling, re-measured in every round


def ceiling_probe(measure: Callable[[], float], unit: str) -> Callable[[], H.Sample]:
    """The ceiling as a system of the interleaved rounds (its reading as `tok_s`): this
    machine's memory bandwidth and GEMM rate drifted by up to 2x within minutes (a one-row
    product over the default model's weights took 11 ms, then 20 ms, 20 minutes apart), so a
    floor measured once at the start misreads every later run. Fractions of the floor use the
    median of the readings taken between the runs."""
    return lambda: H.Sample(1.0, measure(), extra={"unit": unit})


def bench_scenario(model, tok, wl: Workload, args, best: dict[str, Config], flops_per_run: float, between,
                   log) -> dict:
    systems: dict[str, Callable[[], H.Sample]] = {}
    rows: dict[str, RowResult] = {}
    dtype = next(model.parameters()).dtype
    n = 1024 if args.sweep == "quick" else 2048  # as the ceiling measured at the start
    systems[CEILING] = ceiling_probe(lambda: H.matmul_rate(dtype, n=n, seconds=0.3), "GFLOP/s")
    for fam in args.families:
        cfgs = [(Config(fam, ()), "default")]
        if best.get(fam) and best[fam] != cfgs[0][0]:
            cfgs.append((best[fam], "best"))
        elif best.get(fam):
            cfgs = [(cfgs[0][0], "default = best")]
        if fam == "contbatch":  # compile levels as rows, on the best configuration (compiled once per
            # model: the untimed warm-up run pays the compile, as a long-running user would)
            cfgs += [(cfgs[-1][0].with_(level=level), f"{cfgs[-1][1]}, compile level {level}")
                     for level in args.compile_levels]
        for cfg, role in cfgs:
            rows[cfg.label] = RowResult(cfg, role)
            systems[cfg.label] = runner(model, tok, wl, cfg)
    samples = H.run_interleaved(systems, args.repeats, warmup=not args.no_warmup, between=between, log=log)
    gflops = H.Spread.of([s.tok_s for s in samples.pop(CEILING)])
    floor_tok_s = wl.generated_tokens / (flops_per_run / (gflops.median * 1e9))
    for name, ss in samples.items():
        rows[name].samples = ss
    status = {name: posted(r, wl) for name, r in rows.items()}
    peer_best: dict[str, RowResult | None] = {}
    for fam in FAMILIES:
        ok = [r for n, r in rows.items() if r.config.family == fam and status[n][0]]
        peer_best[fam] = max(ok, key=lambda r: r.spread.median) if ok else None
    out_rows = []
    for name, r in rows.items():
        ok, label = status[name]
        notes = []
        extras = r.samples[-1].extra
        if "resolved" in extras:
            notes.append(extras["resolved"])
        if r.config.family == "contbatch":
            notes.append(f"{extras['steps']} steps")
        if r.config.family == "padded":
            notes.append(f"padding {extras['padding']:.0%} of prompt positions, {extras['wasted_decode']:.0%} of decode "
                         f"slots wasted")
        vs = {}
        for peer in PEERS:
            pb = peer_best.get(peer)
            vs[peer] = H.ratio(r.spread, pb.spread) if ok and pb is not None else None
        out_rows.append({
            "system": name, "family": r.config.family, "role": r.role, "params": dict(r.config.params),
            "attention": ATTENTION[r.config.family], "posted": ok, "check": label,
            "tok_s": r.spread.as_dict(), "wall_s": r.wall.as_dict(),
            "tok_s_runs": [s.tok_s for s in r.samples],
            "floor_fraction": r.spread.median / floor_tok_s if floor_tok_s else None,
            "vs": {p: (v.as_dict() if v else None) for p, v in vs.items()}, "notes": "; ".join(notes),
            "_vs": vs, "_spread": r.spread,
        })
    return {"rows": out_rows, "peer_best": {f: (r.config.label if r else None) for f, r in peer_best.items()},
            "matmul_gflops_rounds": gflops.as_dict(), "matmul_floor_tok_s": floor_tok_s}


def scenario_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        speed = r["_spread"].fmt() if r["posted"] else f"not posted ({r['_spread'].median:.1f})"
        body.append([r["system"], r["role"], speed, r["check"],
                     f"{r['floor_fraction']:.0%}" if r["posted"] and r["floor_fraction"] else "-",
                     H.fmt_ratio(r["_vs"]["tf-cb"]), H.fmt_ratio(r["_vs"]["padded"]), r["notes"]])
    return H.md_table(["system", "config", "output tok/s median [min, max]", "tokens vs reference", "of matmul floor",
                       "vs tf generate_batch best", "vs padded best", "notes"], body,
                      [False, False, True, False, True, True, True, False])


def sweep_table(sweeps: dict[str, list[dict]]) -> str:
    body = [[r["config"], f"{r['tok_s']:.1f}", r["check"], "yes" if r["ok"] else "no"]
            for fam in sweeps for r in sweeps[fam]]
    return H.md_table(["candidate", "tok/s (1 run)", "tokens", "eligible"], body, [False, True, False, False])


# --------------------------------------------------------------------------------------------- single stream


FIRST_ONLY = " (first token only)"  # the same system on the same prompt, one new token: what decoding excludes


def bench_single(model, tok, prompt: list[int], args, ceilings: dict, is_fp32: bool, between, log) -> dict:
    """One request, end to end and decoding alone. The end-to-end rate counts the engine's
    start-up and the prompt's prefill; the decode rate is what the weight-read floor is about:
    (new tokens - 1) / (wall of the run - wall of the same system's one-token run in the same
    round), for every system alike."""
    wl = Workload("fixed", "text", [prompt], [args.single_new_tokens])
    first = Workload("fixed", "text", [prompt], [1])
    if is_fp32:
        wl.reference = H.reference_tokens(model, wl.prompts, wl.max_new, tok.pad_token_id, log=log)
        first.reference = [wl.reference[0][:1]]
    configs = {"contbatch (default), 1 request": Config("contbatch", ())}
    for level in args.compile_levels:
        configs[f"contbatch compile level {level}, 1 request"] = Config("contbatch", (("level", level),))
    configs["model.generate, batch 1"] = Config("padded", (("batch", 1),))
    systems = {}
    for name, cfg in configs.items():
        systems[name] = runner(model, tok, wl, cfg)
        systems[name + FIRST_ONLY] = runner(model, tok, first, cfg)
    readers: list[str] = []

    def read() -> float:
        gb_s, _, how = H.weight_read_bandwidth(model, repeats=3)
        readers.append(how)
        return gb_s

    systems[CEILING] = ceiling_probe(read, "GB/s")
    samples = H.run_interleaved(systems, args.repeats, warmup=not args.no_warmup, between=between, log=log)
    bandwidth = H.Spread.of([s.tok_s for s in samples.pop(CEILING)])
    floor_wr = bandwidth.median * 1e9 / ceilings["weight_bytes"]
    floor_mm = wl.generated_tokens / (2 * ceilings["non_embedding_params"] * (wl.prompt_tokens + wl.generated_tokens)
                                      / (ceilings["matmul_gflops"] * 1e9))
    spreads, decode, checks = {}, {}, {}
    for name in configs:
        full, once = samples[name], samples[name + FIRST_ONLY]
        spreads[name] = H.Spread.of([s.tok_s for s in full])
        # Rounds pair up: both runs of a round are minutes apart at most, on the same machine state.
        decode[name] = H.Spread.of([(wl.generated_tokens - 1) / (f.wall_s - o.wall_s)
                                    for f, o in zip(full, once) if f.wall_s > o.wall_s] or [0.0])
        ok, label = posted(RowResult(Config("x", ()), "", full), wl)
        ok_first, label_first = posted(RowResult(Config("x", ()), "", once), first)
        checks[name] = (ok and ok_first, label if ok_first else f"{label}; first-token run: {label_first}")
    base, base_decode = spreads["model.generate, batch 1"], decode["model.generate, batch 1"]
    rows = []
    for name in configs:
        sp, dec = spreads[name], decode[name]
        ok, label = checks[name]
        rows.append({"system": name, "posted": ok, "check": label, "tok_s": sp.as_dict(), "_spread": sp,
                     "weight_read_floor_fraction": sp.median / floor_wr, "matmul_floor_fraction": sp.median / floor_mm,
                     "vs_generate": H.ratio(sp, base).as_dict(), "_vs": H.ratio(sp, base),
                     "decode_tok_s": dec.as_dict(), "_decode": dec,
                     "decode_weight_read_floor_fraction": dec.median / floor_wr,
                     "decode_vs_generate": H.ratio(dec, base_decode).as_dict(), "_decode_vs": H.ratio(dec, base_decode)})
    return {"prompt_tokens": len(prompt), "new_tokens": args.single_new_tokens, "weight_read_floor_tok_s": floor_wr,
            "weight_read_gb_s_rounds": bandwidth.as_dict(), "weight_readers": sorted(set(readers)),
            "matmul_floor_tok_s": floor_mm, "rows": rows}


def single_table(single: dict) -> str:
    body = [[r["system"], r["_spread"].fmt() if r["posted"] else f"not posted ({r['_spread'].median:.1f})", r["check"],
             f"{r['weight_read_floor_fraction']:.0%}", f"{r['matmul_floor_fraction']:.0%}", H.fmt_ratio(r["_vs"]),
             r["_decode"].fmt() if r["posted"] else "-", f"{r['decode_weight_read_floor_fraction']:.0%}",
             H.fmt_ratio(r["_decode_vs"])]
            for r in single["rows"]]
    return H.md_table(["system", "tok/s median [min, max]", "tokens vs reference", "of weight-read floor",
                       "of matmul floor", "vs generate batch 1", "decoding alone: tok/s", "of weight-read floor",
                       "vs generate"], body, [False, True, False, True, True, True, True, True, True])


# --------------------------------------------------------------------------------------------- per dtype


def measure_ceilings(model, dtype, quick: bool) -> dict:
    gflops = H.in_worker(lambda: H.matmul_rate(dtype, n=1024 if quick else 2048, seconds=0.3 if quick else 1.5))
    bw, nbytes, reader = H.in_worker(lambda: H.weight_read_bandwidth(model, repeats=3 if quick else 10))
    return {"matmul_gflops": gflops, "matmul_shape": "1024^3" if quick else "2048^3", "weight_read_gb_s": bw,
            "weight_reader": reader,
            "weight_bytes": nbytes, "params": sum(p.numel() for p in model.parameters()),
            "non_embedding_params": H.non_embedding_params(model)}


def bench_dtype(dtype_name: str, args, monitor: H.LoadMonitor, log) -> dict:
    dtype = getattr(torch, dtype_name)
    t_start = time.perf_counter()
    model, tok = contbatch.load_model(args.model, dtype=dtype)
    attn = model.config._attn_implementation
    is_fp32 = dtype == torch.float32

    def between() -> None:  # every system starts from the same model state
        if model.config._attn_implementation != attn:
            model.set_attn_implementation(attn)
        gc.collect()

    ceilings = measure_ceilings(model, dtype, args.sweep == "quick")
    log(f"\n== {dtype_name}: {ceilings['params'] / 1e6:.1f}M params ({ceilings['non_embedding_params'] / 1e6:.1f}M "
        f"non-embedding); matmul {ceilings['matmul_gflops']:.1f} GFLOP/s ({ceilings['matmul_shape']}), "
        f"weight read {ceilings['weight_read_gb_s']:.1f} GB/s ({ceilings['weight_bytes'] / 1e6:.0f} MB, "
        f"{ceilings['weight_reader']})")
    out = {"ceilings": ceilings, "attn_implementation": attn, "scenarios": {}}
    prompts = {src: make_prompts(tok, src, args.num_prompts, args.min_len, args.max_len, args.seed)
               for src in args.sources}
    best_by_kind: dict[str, dict[str, Config]] = {}
    for kind in args.workloads:
        max_new = make_new_tokens(kind, args.num_prompts, args.new_tokens, args.mixed_min, args.mixed_max, args.seed)
        for src in args.sources:
            wl = Workload(kind, src, prompts[src], max_new)
            t0 = time.perf_counter()
            log(f"\n-- {dtype_name} {wl.name}: {wl.describe()}")
            if is_fp32:
                wl.reference = H.reference_tokens(model, wl.prompts, wl.max_new, tok.pad_token_id, log=log)
            sweeps = {}
            if kind not in best_by_kind:  # the sweep runs on the first prompt source of each workload kind
                best_by_kind[kind] = {}
                for fam in args.families:
                    best_by_kind[kind][fam], sweeps[fam] = run_sweep(model, tok, wl, fam, args.sweep, between,
                                                                     not args.no_warmup, log)
            flops = 2 * ceilings["non_embedding_params"] * (wl.prompt_tokens + wl.generated_tokens)
            res = bench_scenario(model, tok, wl, args, best_by_kind[kind], flops, between, log)
            res.update(workload=wl.describe(), prompt_tokens=wl.prompt_tokens, generated_tokens=wl.generated_tokens,
                       sweep=sweeps, sweep_on=f"{kind}/{args.sources[0]}",
                       elapsed_s=time.perf_counter() - t0, reference=is_fp32)
            out["scenarios"][wl.name] = res
            log(scenario_table(res["rows"]))
    if args.single_new_tokens:
        log(f"\n-- {dtype_name} single stream: 1 request of {len(prompts[args.sources[0]][0])} prompt tokens, "
            f"{args.single_new_tokens} new tokens")
        out["single"] = bench_single(model, tok, prompts[args.sources[0]][0], args, ceilings, is_fp32, between, log)
        log(single_table(out["single"]))
    out["elapsed_s"] = time.perf_counter() - t_start
    del model
    gc.collect()
    return out


# --------------------------------------------------------------------------------------------- report


def markdown(report: dict, args) -> str:
    lines = H.report_header("offline throughput (`benchmarks/offline.py`)", report["machine"], report["load"],
                            args.noise_threshold)
    lines.append(f"{args.repeats} timed runs per system, interleaved (first system rotated each round), after one "
                 f"untimed warm-up each; sweep `{args.sweep}`; figures are median [min, max]. Ratios: ratio of "
                 f"medians [worst/best .. best/worst]. A system whose float32 tokens differ from `model.generate` on "
                 f"each prompt alone is not posted. Matmul floor = 2 x non-embedding params x (prompt + generated "
                 f"tokens) / matmul rate; weight-read floor (one stream) = weight bytes / read bandwidth.\n")
    lines.append("Attention paths: " + "; ".join(f"**{FAMILY_TITLE[f]}**: {ATTENTION[f]}" for f in FAMILIES) + ".\n")
    for dname, d in report["dtypes"].items():
        c = d["ceilings"]
        lines.append(f"### {dname}\n")
        lines.append(f"Ceilings in this run: matmul {c['matmul_gflops']:.1f} GFLOP/s ({c['matmul_shape']}), weight read "
                     f"{c['weight_read_gb_s']:.1f} GB/s ({c['weight_bytes'] / 1e6:.0f} MB of weights, fastest reader "
                     f"{c['weight_reader']}; "
                     f"{c['non_embedding_params'] / 1e6:.1f}M non-embedding params).\n")
        for name, s in d["scenarios"].items():
            g = s["matmul_gflops_rounds"]
            lines.append(f"**{name}**: {s['workload']}. Matmul floor {s['matmul_floor_tok_s']:.0f} tok/s (GEMM rate "
                         f"re-measured between the runs: {g['median']:.0f} [{g['min']:.0f}, {g['max']:.0f}] GFLOP/s).\n")
            lines.append(scenario_table(s["rows"]))
            lines.append("")
            if s["sweep"]:
                lines.append(f"<details><summary>sweep on {s['sweep_on']}</summary>\n\n{sweep_table(s['sweep'])}\n\n</details>\n")
        if "single" in d:
            sg = d["single"]
            b = sg["weight_read_gb_s_rounds"]
            lines.append(f"**single stream**: 1 request, {sg['prompt_tokens']} prompt + {sg['new_tokens']} new tokens; "
                         f"weight-read floor {sg['weight_read_floor_tok_s']:.0f} tok/s (read bandwidth re-measured "
                         f"between the runs: {b['median']:.1f} [{b['min']:.1f}, {b['max']:.1f}] GB/s, by "
                         f"{', '.join(sg['weight_readers'])}), matmul floor {sg['matmul_floor_tok_s']:.0f} tok/s. "
                         f"Decoding alone: (new tokens - 1) / (the run's wall - the same system's one-new-token "
                         f"run's wall in the same round).\n")
            lines.append(single_table(sg))
            lines.append("")
    return "\n".join(lines)


def strip_private(obj):
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="fixed,mixed", help="comma list of: fixed, mixed")
    p.add_argument("--prompts", dest="sources_arg", default="text,chat", help="comma list of: text, chat")
    p.add_argument("--systems", default=",".join(FAMILIES), help=f"comma list of: {', '.join(FAMILIES)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16, help="prompt (or chat user text) length, tokens")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64, help="fixed workload: new tokens per request")
    p.add_argument("--mixed-min", type=int, default=16, help="mixed workload: max_new_tokens drawn log-uniform from")
    p.add_argument("--mixed-max", type=int, default=256, help="... to this")
    p.add_argument("--single-new-tokens", type=int, default=256, help="single-stream row (0: skip it)")
    p.add_argument("--compile-levels", default="", help="comma list of compile levels (1-3) added as contbatch rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", choices=["full", "quick", "none"], default="full",
                   help="each system's knobs: full grid, one alternative each, or defaults only")
    p.add_argument("--quick", action="store_true", help="smoke run: --sweep quick, shorter ceiling measurements")
    H.add_common_args(p)
    args = p.parse_args()
    if args.quick and args.sweep == "full":
        args.sweep = "quick"
    args.families = [s for s in args.systems.split(",") if s]
    args.sources = [s for s in args.sources_arg.split(",") if s]
    args.compile_levels = [int(v) for v in args.compile_levels.split(",") if v]
    args.workloads = [s for s in args.workloads.split(",") if s]
    if bad := set(args.families) - set(FAMILIES):
        p.error(f"unknown systems {sorted(bad)}")
    if bad := set(args.sources) - {"text", "chat"}:
        p.error(f"unknown prompt sources {sorted(bad)}")
    if bad := set(args.workloads) - {"fixed", "mixed"}:
        p.error(f"unknown workloads {sorted(bad)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    transformers.logging.set_verbosity_error()  # eos=-1 warns on every padded batch

    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    machine = H.machine_info()
    print(f"command: {H.command_line()}\nmachine: {H.machine_line(machine)}\n"
          f"load average before: {monitor.before[0]:.2f} (1 min)")
    if monitor.before[0] > args.noise_threshold:
        print(f"WARNING: 1-minute load average {monitor.before[0]:.2f} > {args.noise_threshold}: this run will be "
              "labelled noisy.")
    t0 = time.perf_counter()
    dtypes = {d: bench_dtype(d, args, monitor, lambda s: print(s, flush=True)) for d in args.dtypes.split(",") if d}
    load = monitor.stop()
    report = {"benchmark": "offline", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "noisy_rule": H.noisy_rule(args.noise_threshold),
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))},
              "elapsed_s": time.perf_counter() - t0, "dtypes": dtypes}
    md = markdown(report, args)
    print("\n" + H.load_line(load))
    print(f"elapsed {report['elapsed_s']:.0f} s")
    H.write_outputs(args, strip_private(report), md)
    if args.out is None and args.results_md is None:
        print("\n(markdown section, for reference)\n" + md)


if __name__ == "__main__":
    main()
