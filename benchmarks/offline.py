"""Offline throughput: contbatch vs transformers' continuous batching vs padded `generate` vs
vLLM's CPU engine (once `make bench-peers` has set it up), on CPU.

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
what a user pays; vLLM, run in its own process (`peers/`), pays its start-up once per setting,
and its wall is `generate` alone. `--model smollm2-135m | qwen2.5-0.5b-shape` loads the peers'
shared model folders (the same weights for every system). The parts: `offline_workloads.py` (prompts, lengths), `offline_systems.py`
(the three systems' runs), `offline_sweep.py` (each at its best), `offline_measure.py` (the
timed rounds, floors, single stream), `offline_report.py` (tables, markdown); load sampling,
the noisy rule, interleaving, statistics and output are the shared `harness/`.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import harness as H  # noqa: E402
from offline_measure import bench_scenario, bench_single, measure_ceilings  # noqa: E402
from offline_report import markdown, scenario_table, single_table  # noqa: E402
from offline_sweep import run_sweep  # noqa: E402
from offline_systems import FAMILIES, Config, peers_ready  # noqa: E402
from offline_workloads import Workload, make_new_tokens, make_prompts  # noqa: E402
from peers import paths as peer_paths, vllm_offline  # noqa: E402


def bench_dtype(dtype_name: str, args, monitor: H.LoadMonitor, log) -> dict:
    dtype = getattr(torch, dtype_name)
    t_start = time.perf_counter()
    model, tok = H.load(args.model, dtype)  # a peer model's name is its folder (parse_args)
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
            try:
                res = bench_scenario(model, tok, wl, args, best_by_kind[kind], flops, between, log)
            finally:
                vllm_offline.close_all()
            res.update(workload=wl.describe(), prompt_tokens=wl.prompt_tokens, generated_tokens=wl.generated_tokens,
                       sweep=sweeps, sweep_on=f"{kind}/{args.sources[0]}",
                       elapsed_s=time.perf_counter() - t0, reference=is_fp32)
            out["scenarios"][wl.name] = res
            log(scenario_table(res["rows"]))
    if args.single_new_tokens:
        log(f"\n-- {dtype_name} single stream: 1 request of {len(prompts[args.sources[0]][0])} prompt tokens, "
            f"{args.single_new_tokens} new tokens")
        try:
            out["single"] = bench_single(model, tok, prompts[args.sources[0]][0], args, ceilings, is_fp32, between, log,
                                         best_by_kind.get(args.workloads[0]))
        finally:
            vllm_offline.close_all()
        log(single_table(out["single"]))
    out["elapsed_s"] = time.perf_counter() - t_start
    model = None  # the next dtype's model is loaded into freed memory
    gc.collect()
    return out


def parse_args(argv=None):
    p = H.parser(__doc__, show_defaults=True)
    p.add_argument("--model", default=None, help="local HF folder or .gguf, or a peer model set up by `make bench-peers`: "
                   f"{', '.join(peer_paths.MODELS)} (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="fixed,mixed", help="comma list of: fixed, mixed")
    p.add_argument("--prompts", dest="sources_arg", default="text,chat", help="comma list of: text, chat")
    p.add_argument("--systems", default=None, help=f"comma list of: {', '.join(FAMILIES)} (default: all; vllm only "
                   "once `make bench-peers` has set it up)")
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
    args = H.parse(p, argv)
    if args.quick and args.sweep == "full":
        args.sweep = "quick"
    if args.systems is None:
        args.systems = ",".join(f for f in FAMILIES if f != "vllm" or peers_ready())
        if not peers_ready():
            print("systems: vllm left out (its venv is not set up: `make bench-peers`)")
    args.families = H.comma_list(args.systems, allowed=FAMILIES, p=p, what="systems")
    if "vllm" in args.families and not peers_ready():
        p.error("vllm asked for but not set up: run `make bench-peers` first")
    if args.model not in (None, "default"):
        args.model = str(peer_paths.resolve_model(args.model))
    args.sources = H.comma_list(args.sources_arg, allowed=("text", "chat"), p=p, what="prompt sources")
    args.compile_levels = H.comma_list(args.compile_levels, int)
    args.workloads = H.comma_list(args.workloads, allowed=("fixed", "mixed"), p=p, what="workloads")
    return args


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()  # eos=-1 warns on every padded batch

    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    machine = H.machine_info()
    print(f"command: {H.command_line()}\nmachine: {H.machine_line(machine)}\n"
          f"load average before: {monitor.before[0]:.2f} (1 min)")
    monitor.warn_if_loaded()
    t0 = time.perf_counter()
    dtypes = {d: bench_dtype(d, args, monitor, H.log) for d in args.dtypes.split(",") if d}
    load = monitor.stop()
    report = {"benchmark": "offline", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "noisy_rule": H.noisy_rule(args.noise_threshold),
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))},
              "elapsed_s": time.perf_counter() - t0, "dtypes": dtypes}
    md = markdown(report, args)
    print("\n" + H.load_line(load))
    print(f"elapsed {report['elapsed_s']:.0f} s")
    H.write_outputs(args, H.strip_private(report), md)
    if args.out is None and args.results_md is None:
        print("\n(markdown section, for reference)\n" + md)


if __name__ == "__main__":
    main()
