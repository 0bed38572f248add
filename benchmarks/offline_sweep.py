"""Each system at its best: the coordinate sweep of its own knobs (`offline.py --sweep`).

For each family, stages of knob settings are tried on top of the best found so far, one timed
run per candidate after one untimed warm-up of the default; the fastest token-exact candidate
wins (at bfloat16 there is no reference: the fastest).
"""

from __future__ import annotations

import harness as H
from offline_systems import EXTERNAL, Config, runner
from offline_workloads import Workload
from peers import knobs, vllm_offline


def sweep_stages(family: str, wl: Workload, mode: str) -> list[list[dict]]:
    """Coordinate sweep: each stage is a list of knob settings tried on top of the best found so
    far. Values equal to the default are left out so the default is not run twice."""
    n = len(wl.prompts)
    if mode == "none":
        return []
    if family == "vllm":
        return knobs.vllm_stages(mode)
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
    token-exact candidate wins (at bf16 there is no reference: the fastest). An external
    engine (vLLM) is never token-exact by construction: its candidates are held to the token
    count only, and compared with each other."""
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
            exact = not check.get("checked") or check["mismatch"] == 0 or family in EXTERNAL
            ok = exact and s.output_tokens == wl.generated_tokens
            tried[cfg] = {"config": cfg.label, "tok_s": s.tok_s, "wall_s": s.wall_s, "check": H.check_label(check),
                          "ok": ok, **{k: v for k, v in s.extra.items() if k != "resolved"}}
            log(f"   sweep    {cfg.label:<28} {s.wall_s:8.2f} s  {s.tok_s:8.1f} tok/s  {H.check_label(check)}")
            vllm_offline.close_all()  # one vLLM engine's memory at a time
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
