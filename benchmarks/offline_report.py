"""The tables and the RESULTS.md section of `offline.py`."""

from __future__ import annotations

import harness as H
from offline_systems import ATTENTION, FAMILY_TITLE, PEERS


def scenario_table(rows: list[dict]) -> str:
    """One row per system configuration; a ratio column per peer family that ran."""
    peers = [p for p in PEERS if any(r["family"] == p for r in rows)]
    body = []
    for r in rows:
        speed = r["_spread"].fmt() if r["posted"] else f"not posted ({r['_spread'].median:.1f})"
        body.append([r["system"], r["role"], speed, r["check"],
                     f"{r['floor_fraction']:.0%}" if r["posted"] and r["floor_fraction"] else "-",
                     *(H.fmt_ratio(r["_vs"][p]) for p in peers), r["notes"]])
    return H.md_table(["system", "config", "output tok/s median [min, max]", "tokens vs reference", "of matmul floor",
                       *(f"vs {FAMILY_TITLE[p]} best" for p in peers), "notes"], body,
                      [False, False, True, False, True, *(True for _ in peers), False])


def sweep_table(sweeps: dict[str, list[dict]]) -> str:
    body = [[r["config"], f"{r['tok_s']:.1f}", r["check"], "yes" if r["ok"] else "no"]
            for fam in sweeps for r in sweeps[fam]]
    return H.md_table(["candidate", "tok/s (1 run)", "tokens", "eligible"], body, [False, True, False, False])


def single_table(single: dict) -> str:
    body = [[r["system"], r["_spread"].fmt() if r["posted"] else f"not posted ({r['_spread'].median:.1f})", r["check"],
             f"{r['weight_read_floor_fraction']:.0%}", f"{r['matmul_floor_fraction']:.0%}", H.fmt_ratio(r["_vs"]),
             r["_decode"].fmt() if r["posted"] else "-", f"{r['decode_weight_read_floor_fraction']:.0%}",
             H.fmt_ratio(r["_decode_vs"])]
            for r in single["rows"]]
    return H.md_table(["system", "tok/s median [min, max]", "tokens vs reference", "of weight-read floor",
                       "of matmul floor", "vs generate batch 1", "decoding alone: tok/s", "of weight-read floor",
                       "vs generate"], body, [False, True, False, True, True, True, True, True, True])


def markdown(report: dict, args) -> str:
    lines = H.report_header("offline throughput (`benchmarks/offline.py`)", report["machine"], report["load"],
                            args.noise_threshold)
    lines.append(f"{args.repeats} timed runs per system, interleaved (first system rotated each round), after one "
                 f"untimed warm-up each; sweep `{args.sweep}`; figures are median [min, max]. Ratios: ratio of "
                 f"medians [worst/best .. best/worst]. A system whose float32 tokens differ from `model.generate` on "
                 f"each prompt alone is not posted. Matmul floor = 2 x non-embedding params x (prompt + generated "
                 f"tokens) / matmul rate; weight-read floor (one stream) = weight bytes / read bandwidth.\n")
    lines.append("Attention paths: " + "; ".join(f"**{FAMILY_TITLE[f]}**: {ATTENTION[f]}" for f in args.families) + ".\n")
    if "vllm" in args.families:
        lines.append("vLLM runs `LLM.generate` in its own process (its own venv, same weights); its wall is `generate` "
                     "alone (start-up paid once per setting, as a `vllm.LLM` user pays it), while the in-process "
                     "systems' walls include their engine start-up. Its tokens are checked and shown, not required "
                     "to match.\n")
    for dname, d in report["dtypes"].items():
        c = d["ceilings"]
        lines.append(f"#### {dname}\n")
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
