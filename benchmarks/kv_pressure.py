"""Prefix caching and KV pressure, end to end on the default model.

(a) Many requests sharing one long system prompt, prefix cache on vs off: throughput and mean
    time to first token. (b) Long generations in a small cache: CPU offload vs soft reset vs
    ample memory: throughput and the number of offloads, restores and soft resets.

Each case of a part is a system: one untimed warm-up each, then `--repeats` interleaved rounds
(`harness.run_interleaved`), median [min, max]; the load average is sampled throughout and a
noisy run is not appended to `--results-md` without `--force-results`. At float32 every case's
tokens are compared with greedy `model.generate` on each prompt alone (computed once per part);
a case whose tokens differ is not posted.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import contbatch  # noqa: E402
import harness as H  # noqa: E402


def run(model, prompts, new_tokens: int, config: contbatch.ContinuousBatchingConfig) -> H.Sample:
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    with contbatch.continuous_batching(model, gen, config) as manager:
        ids = manager.add_requests(prompts)
        outs = [manager.get_result(rid) for rid in ids]
        stats = manager.stats()
    wall = time.perf_counter() - start
    tokens = [list(o.generated_tokens) for o in outs]
    ttft = sum(o.first_token_at - o.queued_at for o in outs) / len(outs)
    return H.Sample(wall, sum(map(len, tokens)), tokens, {
        "mean_ttft_s": ttft,
        **{k: stats[k] for k in ("prefix_cache_hits", "prefix_cache_queries", "offloads", "restores", "soft_resets")}})


def part(title: str, model, prompts, new_tokens: int, cases: dict, baseline: str, args, columns, log) -> dict:
    """Run the cases of one part interleaved, check tokens, and build its table."""
    log(f"\n{title}")
    ref = None
    if args.dtype == "float32" and not args.no_reference:
        ref = H.reference_tokens(model, prompts, [new_tokens] * len(prompts), log=log)
    systems = {name: (lambda cfg=cfg: run(model, prompts, new_tokens, cfg)) for name, cfg in cases.items()}
    samples = H.run_interleaved(systems, args.repeats, warmup=not args.no_warmup, log=log)
    spreads = {n: H.Spread.of([s.tok_s for s in ss]) for n, ss in samples.items()}
    rows, body = [], []
    expected = len(prompts) * new_tokens
    for name, ss in samples.items():
        check = H.worst_check([H.check_tokens(s.tokens, ref) for s in ss])
        label = H.check_label(check)
        counts_ok = all(s.output_tokens == expected for s in ss)
        if not counts_ok:
            label += f"; COUNT {min(s.output_tokens for s in ss)}/{expected}"
        ok = counts_ok and (not check.get("checked") or check["mismatch"] == 0)
        same_as_first = all(s.tokens == ss[0].tokens for s in ss)
        base_ok = baseline in spreads
        vs = H.ratio(spreads[name], spreads[baseline]) if ok and base_ok else None
        ttft = H.Spread.of([s.extra["mean_ttft_s"] for s in ss])
        last = ss[-1].extra
        row = {"case": name, "posted": ok, "check": label, "repeatable": same_as_first,
               "tok_s": spreads[name].as_dict(), "mean_ttft_s": ttft.as_dict(),
               "vs_baseline": vs.as_dict() if vs else None, **{k: last[k] for k in last if k != "mean_ttft_s"}}
        rows.append(row)
        hit = last["prefix_cache_hits"] / max(1, last["prefix_cache_queries"])
        cells = {"hit rate": f"{hit:.1%}", "offloads": last["offloads"], "restores": last["restores"],
                 "soft resets": last["soft_resets"], "mean TTFT s": ttft.fmt(".2f")}
        body.append([name, spreads[name].fmt() if ok else f"not posted ({spreads[name].median:.1f})",
                     H.fmt_ratio(vs), *[cells[c] for c in columns], label])
    table = H.md_table(["case", "output tok/s median [min, max]", f"vs {baseline}", *columns, "tokens vs reference"],
                       body, [False, True, True, *[True] * len(columns), False])
    log(table)
    outs = [ss[0].tokens for ss in samples.values()]
    log(f"identical outputs across cases: {all(o == outs[0] for o in outs)}")
    return {"title": title, "rows": rows, "table": table, "identical_across_cases": all(o == outs[0] for o in outs)}


def main() -> None:
    parser = H.parser(__doc__, show_defaults=True)
    parser.add_argument("--shared-requests", type=int, default=200)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--shared-new-tokens", type=int, default=16)
    parser.add_argument("--pressure-requests", type=int, default=16)
    parser.add_argument("--pressure-new-tokens", type=int, default=256)
    parser.add_argument("--pressure-blocks", type=int, default=48, help="cache for (b), in blocks of 16 tokens")
    parser.add_argument("--only", default="a,b")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-reference", action="store_true", help="skip the token check against model.generate")
    H.add_common_args(parser, repeats=3, quick="smoke run: 1 repeat unless --repeats is given")
    args = H.parse(parser)
    transformers.logging.set_verbosity_error()
    log = H.log

    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    machine = H.machine_info()
    log(f"command: {H.command_line()}\nmachine: {H.machine_line(machine)}\nload average before: {monitor.before[0]:.2f}")
    monitor.warn_if_loaded()
    model, _ = H.load(None, args.dtype)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    parts = {}

    if "a" in args.only:
        system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
        prompts = [system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]
                   for _ in range(args.shared_requests)]
        cases = {f"prefix cache {'on' if s else 'off'}": contbatch.ContinuousBatchingConfig(block_size=16, allow_block_sharing=s)
                 for s in (False, True)}
        parts["a"] = part(f"(a) {len(prompts)} requests sharing a {args.system_tokens}-token system prompt (+8..32 own "
                          f"tokens), {args.shared_new_tokens} new tokens each, block_size 16",
                          model, prompts, args.shared_new_tokens, cases, "prefix cache off", args,
                          ["mean TTFT s", "hit rate"], log)

    if "b" in args.only:
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 96))] for _ in range(args.pressure_requests)]
        extra = {
            "ample": dict(num_blocks=None),
            f"{args.pressure_blocks} blocks, soft reset": dict(num_blocks=args.pressure_blocks),
            f"{args.pressure_blocks} blocks, CPU offload": dict(num_blocks=args.pressure_blocks, cpu_offload_space=1.0),
        }
        cases = {name: contbatch.ContinuousBatchingConfig(block_size=16, safety_margin=0.0, allow_block_sharing=False, **kw)
                 for name, kw in extra.items()}
        parts["b"] = part(f"(b) {len(prompts)} requests of 32..96 prompt tokens, {args.pressure_new_tokens} new tokens "
                          f"each, block_size 16, safety margin 0", model, prompts, args.pressure_new_tokens, cases,
                          f"{args.pressure_blocks} blocks, soft reset", args, ["offloads", "restores", "soft resets"], log)

    load = monitor.stop()
    log("\n" + H.load_line(load))
    md = H.report_header(f"prefix caching and KV pressure (`benchmarks/kv_pressure.py`, {args.dtype})", machine, load,
                         args.noise_threshold)
    md.append(f"{args.repeats} timed runs per case, interleaved, after one untimed warm-up each; median [min, max].\n")
    for pt in parts.values():
        md += [pt["title"] + ":\n", pt["table"], "",
               f"Identical outputs across cases: {pt['identical_across_cases']}.\n"]
    report = {"benchmark": "kv_pressure", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "noisy_rule": H.noisy_rule(args.noise_threshold),
              "parts": {k: {kk: vv for kk, vv in v.items() if kk != "table"} for k, v in parts.items()}}
    markdown = "\n".join(md)
    H.write_outputs(args, report, markdown)
    if args.out is None and args.results_md is None:
        log("\n(markdown section, for reference)\n" + markdown)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
