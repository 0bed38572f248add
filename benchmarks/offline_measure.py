"""The timed part of `offline.py`: one workload's systems interleaved, and the single stream.

`bench_scenario` runs each family's default and best configuration (plus compile-level rows),
one untimed warm-up each, then `--repeats` interleaved rounds, with the GEMM rate measured
again in every round as a pseudo-system (`ceiling probe`); it reports median tok/s, the ratio
to each peer's best, the fraction of the matmul floor and the token check. `bench_single` does
the same for one request against `model.generate` at batch 1, end to end and decoding alone,
against the weight-read floor (bandwidth measured again in every round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import harness as H
from offline_systems import ATTENTION, EXTERNAL, FAMILIES, PEERS, Config, runner
from offline_workloads import Workload


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
    the reference's tokens; an external engine's (vLLM) only needs the count, its token check
    is shown beside its speed (its kernels are not ours to hold to `generate`'s tokens)."""
    check = H.worst_check([H.check_tokens(s.tokens, wl.reference) for s in row.samples])
    counts_ok = all(s.output_tokens == wl.generated_tokens for s in row.samples)
    label = H.check_label(check)
    if not counts_ok:
        label += f"; COUNT {min(s.output_tokens for s in row.samples)}/{wl.generated_tokens}"
    exact = not check.get("checked") or check["mismatch"] == 0 or row.config.family in EXTERNAL
    return counts_ok and exact, label


def bench_scenario(model, tok, wl: Workload, args, best: dict[str, Config], flops_per_run: float, between,
                   log) -> dict:
    systems: dict[str, Callable[[], H.Sample]] = {}
    rows: dict[str, RowResult] = {}
    dtype = next(model.parameters()).dtype
    n = 1024 if args.sweep == "quick" else 2048  # as the ceiling measured at the start
    systems[H.CEILING] = H.ceiling_probe(lambda: H.matmul_rate(dtype, n=n, seconds=0.3), "GFLOP/s")
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
    gflops = H.Spread.of([s.tok_s for s in samples.pop(H.CEILING)])
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


FIRST_ONLY = " (first token only)"  # the same system on the same prompt, one new token: what decoding excludes


def bench_single(model, tok, prompt: list[int], args, ceilings: dict, is_fp32: bool, between, log,
                 best: dict[str, Config] | None = None) -> dict:
    """One request, end to end and decoding alone. The end-to-end rate counts the engine's
    start-up and the prompt's prefill; the decode rate is what the weight-read floor is about:
    (new tokens - 1) / (wall of the run - wall of the same system's one-token run in the same
    round), for every system alike. vLLM (when among the systems) runs at its best setting
    of the throughput sweep (`best`); its wall is `generate`'s alone, so its end-to-end rate
    leaves its start-up out, while the decode rate is like for like."""
    wl = Workload("fixed", "text", [prompt], [args.single_new_tokens])
    first = Workload("fixed", "text", [prompt], [1])
    if is_fp32:
        wl.reference = H.reference_tokens(model, wl.prompts, wl.max_new, tok.pad_token_id, log=log)
        first.reference = [wl.reference[0][:1]]
    configs = {"contbatch (default), 1 request": Config("contbatch", ())}
    for level in args.compile_levels:
        configs[f"contbatch compile level {level}, 1 request"] = Config("contbatch", (("level", level),))
    configs["model.generate, batch 1"] = Config("padded", (("batch", 1),))
    if "vllm" in args.families:
        configs["vLLM, 1 request"] = (best or {}).get("vllm") or Config("vllm", ())
    systems = {}
    for name, cfg in configs.items():
        systems[name] = runner(model, tok, wl, cfg)
        systems[name + FIRST_ONLY] = runner(model, tok, first, cfg)
    readers: list[str] = []

    def read() -> float:
        gb_s, _, how = H.weight_read_bandwidth(model, repeats=3)
        readers.append(how)
        return gb_s

    systems[H.CEILING] = H.ceiling_probe(read, "GB/s")
    samples = H.run_interleaved(systems, args.repeats, warmup=not args.no_warmup, between=between, log=log)
    bandwidth = H.Spread.of([s.tok_s for s in samples.pop(H.CEILING)])
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


def measure_ceilings(model, dtype, quick: bool) -> dict:
    gflops = H.in_worker(lambda: H.matmul_rate(dtype, n=1024 if quick else 2048, seconds=0.3 if quick else 1.5))
    bw, nbytes, reader = H.in_worker(lambda: H.weight_read_bandwidth(model, repeats=3 if quick else 10))
    return {"matmul_gflops": gflops, "matmul_shape": "1024^3" if quick else "2048^3", "weight_read_gb_s": bw,
            "weight_reader": reader,
            "weight_bytes": nbytes, "params": sum(p.numel() for p in model.parameters()),
            "non_embedding_params": H.non_embedding_params(model)}
