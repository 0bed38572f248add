"""Load-test an OpenAI-compatible server (the same as `contbatch bench serve`), or compare several.

One server (everything after the script name goes to `contbatch bench serve`):

    contbatch serve &                       # or vLLM, or `transformers serve`
    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --request-rate 1 2 4 inf

Several servers, already running, compared under the shared harness (`harness/`):

    python benchmarks/serve.py --compare contbatch=http://127.0.0.1:8000/v1 \\
        tf-serve=http://127.0.0.1:8001/v1 --num-prompts 64 --max-concurrency 1 16 --repeats 3

Or started here, each on its own port with the same weights (`make bench-peers` sets the peers up),
each peer's knobs swept first (`--sweep`, `peers/knobs.py`), then compared as below:

    python benchmarks/serve.py --launch contbatch vllm:bind=all,preload=true llamacpp:np=32,quant=F32 \
        --peer-model smollm2-135m --max-concurrency 32 --repeats 3 --sweep full

`--workload ttft-prefix` replaces the throughput levels by the shared-system-prompt TTFT
workload (`peers/ttft.py`: system prompts of 30, 100, 300 and 1000 tokens; a lone request and
32 concurrent, TTFT p50 and p99). One request decoding is `--max-concurrency 1` (TPOT p50).

With `--compare` or `--launch`, each server is a system: one untimed warm-up pass (every load level), then
`--repeats` interleaved rounds, the first server rotated each round (with `--dataset random`, every
load level of every pass draws fresh prompts, so that no server's prefix cache answers a prompt
it saw in an earlier pass); output tok/s and TTFT /
TPOT p50 are reported as median [min, max] per load level, with ratios against each other
server. The servers' processes (found by their listening port, or `--pids`) count as the
benchmark's own threads in the load sampling. Before timing, greedy non-streamed completions of
the first `--check-prompts` prompts are compared with `model.generate` on each prompt alone
(`--reference-model`, float32, EOS honoured as the servers do); a server whose text differs
says MISMATCH and its figures are not posted. See `contbatch/bench/` for what is measured.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402
import serve_launch  # noqa: E402
from peers import paths as peer_paths  # noqa: E402


def pids_listening_on(port: int) -> list[int]:
    """Processes with a TCP socket listening on `port` (from /proc; only those we may read)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = fd.readlink().as_posix() if hasattr(fd, "readlink") else ""
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    pids.append(int(proc.name))
                    break
        except OSError:
            continue
    return pids


def check_servers(servers: dict, model_names: dict, requests, args) -> dict[str, dict]:
    """Greedy non-streamed completions of the first prompts, against model.generate alone."""
    import httpx
    import torch
    from transformers import GenerationConfig

    reqs = requests[:args.check_prompts]
    if not reqs:
        return {n: {"checked": False} for n in servers}
    model, tok = H.load(args.reference_model)
    refs = []
    with torch.inference_mode():
        for r in reqs:
            ids = tok(r.prompt, return_tensors="pt")
            out = model.generate(**ids, generation_config=GenerationConfig(max_new_tokens=r.output_len, do_sample=False))
            refs.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    del model
    checks = {}
    for name, url in servers.items():
        bad = []
        for i, (r, ref) in enumerate(zip(reqs, refs)):
            body = {"model": model_names[name], "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0}
            try:
                resp = httpx.post(url.rstrip("/") + "/completions", json=body, timeout=args.timeout)
                text = resp.json()["choices"][0]["text"]
            except Exception as exc:  # noqa: BLE001 - any failure is a mismatch, said as such
                text = f"<error {exc}>"
            if text != ref:
                bad.append(i)
        checks[name] = {"checked": True, "mismatch": len(bad), "n": len(reqs), "first": bad[0] if bad else None}
        print(f"   check {name}: {H.check_label(checks[name])}", flush=True)
    return checks


def compare(argv: list[str]) -> int:
    from contbatch.bench.cli import _discover_model, _rates, _tokenizer, add_arguments
    from contbatch.bench.client import Endpoint
    from contbatch.bench.datasets import random_dataset, shared_prefix_dataset
    from contbatch.bench.report import level_stats
    from contbatch.bench.runner import Load, run_level

    p = H.parser(__doc__, prog="benchmarks/serve.py --compare")
    add_arguments(p)
    p.add_argument("--compare", nargs="+", default=[], metavar="NAME=URL", help="running servers to compare (/v1 URLs)")
    serve_launch.add_arguments(p)
    p.add_argument("--pids", nargs="*", default=[], metavar="NAME=PID",
                   help="server processes, when not found by their port (their CPU counts as ours)")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts checked against model.generate (0: none)")
    p.add_argument("--reference-model", default="default", help="'default' (embedded model) or a local folder")
    H.add_common_args(p, quick="smoke run: 1 repeat unless --repeats is given")
    args = H.parse(p, argv)
    if not args.compare and not args.launch:
        p.error("give --compare NAME=URL ... and/or --launch SYSTEM[:knobs] ...")
    servers = dict(s.split("=", 1) for s in args.compare)
    names = {n: args.model or _discover_model(u, args.api_key) for n, u in servers.items()}
    if args.launch:
        args.tokenizer = args.tokenizer or str(peer_paths.model_dir(args.peer_model))
        if args.reference_model == "default":
            args.reference_model = str(peer_paths.model_dir(args.peer_model))
    tokenizer = _tokenizer(args.tokenizer)
    if args.dataset == "random":
        requests = random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    else:
        requests = shared_prefix_dataset(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len,
                                         args.suffix_len, args.output_len, args.seed)
    loads = [Load(r, c) for r in _rates(args.request_rate) for c in (args.max_concurrency or [None])]
    plan = serve_launch.ttft_plan(args) if args.workload == "ttft-prefix" else None
    passes = iter(range(1, 1 << 30))

    def one_pass_at(url: str, name: str) -> dict:
        ep = Endpoint(url, name, args.endpoint == "chat", args.api_key, args.ignore_eos, args.temperature)
        if plan is not None:  # fresh texts each pass: only the system prompts are shared
            return serve_launch.ttft_pass(ep, tokenizer, plan, args.seed + next(passes), args.timeout)
        out = {}
        for load in loads:
            level_requests = requests
            if args.dataset == "random":  # fresh prompts for every level of every pass: no server answers from its cache
                level_requests = random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                                args.range_ratio, args.seed + next(passes))
            results, duration = asyncio.run(run_level(ep, level_requests, load, args.seed, args.timeout,
                                                      progress=False))
            out[load.label()] = level_stats(load, results, duration)
        return out

    launched, sweeps = serve_launch.start_all(args, one_pass_at, log=lambda s: print(s, flush=True))
    try:
        return _compare_timed(args, servers, names, launched, sweeps, requests, loads, plan, one_pass_at)
    finally:
        for server in launched.values():
            server.stop()


def _compare_timed(args, servers, names, launched, sweeps, requests, loads, plan, one_pass_at) -> int:
    """Check, then time the servers interleaved, and report (the launched ones are running)."""
    for label, server in launched.items():
        servers[label], names[label] = server.url, server.name
    pids = [int(x.split("=", 1)[1]) for x in args.pids]
    for url in servers.values():
        pids += pids_listening_on(urlparse(url).port or 80)
    if launched:  # their start-up was ours: let it leave the load average first
        H.wait_for_quiet(args.noise_threshold, log=lambda s: print(s, flush=True))
    monitor = H.LoadMonitor(threshold=args.noise_threshold, pids=sorted(set(pids))).start()
    machine = H.machine_info()
    print(f"command: {H.command_line()}\nmachine: {H.machine_line(machine)}\nserver pids (own load): {sorted(set(pids))}\n"
          f"load average before: {monitor.before[0]:.2f}", flush=True)
    monitor.warn_if_loaded()
    checks = check_servers(servers, names, requests, args)
    probe = serve_launch.CeilingProbe(args.reference_model, args.dtype)
    probe.measure()
    read = {label: serve_launch.read_bytes(srv) for label, srv in launched.items()}

    def system(name: str):
        def run() -> H.Sample:
            t = time.perf_counter()
            levels = one_pass_at(servers[name], names[name])
            toks = sum(lv["total_output_tokens"] for lv in levels.values())
            return H.Sample(time.perf_counter() - t, toks, None, {"levels": levels})
        return run

    systems = {n: system(n) for n in servers}
    systems[H.CEILING] = H.ceiling_probe(lambda: probe.measure()["weight_read_gb_s"], "GB/s")
    samples = H.run_interleaved(systems, args.repeats, warmup=not args.no_warmup, worker=False,
                                log=lambda s: print(s, flush=True))
    samples.pop(H.CEILING)
    probe.measure()
    ceilings = probe.readings
    probe.close()
    load = monitor.stop()
    print("\n" + H.load_line(load))

    def spread(name: str, level: str, key: str, pct: str = "p50_ms") -> H.Spread | None:
        vals = []
        for s in samples[name]:
            lv = s.extra["levels"][level]
            v = lv[key] if key == "output_throughput" else lv[key][pct]
            if v is None or lv["failed"]:
                return None
            vals.append(v)
        return H.Spread.of(vals)

    # Other engines (launched vLLM / llama.cpp) are posted with their text check shown: their
    # kernels (and llama.cpp's quant types) are not ours to hold to `generate`'s text; nor is a
    # quantized contbatch, nor one in bfloat16 (the float32 model is the reference here; the test
    # suite holds contbatch to `generate` on its dequantized weights, and in float32).
    external = {label for label, srv in launched.items()
                if srv.system != "contbatch" or srv.setting.get("quant") or args.dtype != "float32"}
    exact = {n: checks[n].get("mismatch", 0) == 0 or n in external for n in servers}
    body, rows = [], []
    levels = serve_launch.level_names(plan) if plan is not None else [ld.label() for ld in loads]
    for level in levels:
        for name in servers:
            ok = exact[name]
            tput = spread(name, level, "output_throughput")
            cells = [name, level, H.check_label(checks[name])]
            cells.append(tput.fmt() if tput and ok else ("not posted" if not ok else "failed requests"))
            for key, pct in (("ttft", "p50_ms"), ("ttft", "p99_ms"), ("tpot", "p50_ms")):
                sp = spread(name, level, key, pct)
                cells.append(sp.fmt(".0f") if sp and ok else "-")
            own = read.get(name)
            mm_floor, wr_floor = serve_launch.floors(ceilings, samples[name][0].extra["levels"][level],
                                                     own[0] if own else None)
            tpot = spread(name, level, "tpot")
            cells.append(f"{tput.median / mm_floor:.0%}" if tput and ok else "-")
            cells.append(f"{1000 / tpot.median / wr_floor:.0%}" if tpot and ok else "-")
            for other in servers:
                if other == name:
                    continue
                o = spread(other, level, "output_throughput")
                o_ok = exact[other]
                cells.append(f"vs {other}: " + (H.fmt_ratio(H.ratio(tput, o)) if tput and o and ok and o_ok else "-"))
            body.append(cells)
            ttft = spread(name, level, "ttft")
            rows.append({"server": name, "level": level, "check": checks[name],
                         "output_tok_s": tput.as_dict() if tput else None, "ttft_p50_ms": ttft.as_dict() if ttft else None})
    headers = ["server", "load", "text vs reference", "output tok/s median [min, max]", "TTFT p50 ms", "TTFT p99 ms",
               "TPOT p50 ms", "of matmul floor", "decode of weight-read floor", "ratios (output tok/s)"]
    body = [row[:9] + ["; ".join(row[9:])] for row in body]
    table = H.md_table(headers, body, [False, False, False, True, True, True, True, True, True, False])
    print(table)
    md = H.report_header("online serving comparison (`benchmarks/serve.py --compare`)", machine, load,
                         args.noise_threshold)
    workload = (serve_launch.describe_ttft(plan) if plan is not None else
                f"{args.num_prompts} prompts ({args.dataset}, input {args.input_len}, output {args.output_len})")
    md += ["Servers: " + ", ".join(f"{n} at {u} (model `{names[n]}`)" for n, u in servers.items()) + ". "
           f"{workload}, {args.endpoint}, streaming, temperature {args.temperature}; {args.repeats} timed passes per "
           f"server, interleaved, after one untimed warm-up pass each.\n", table]
    md += [serve_launch.ceilings_line(ceilings, read)] + serve_launch.sweep_markdown(sweeps)
    report = {"benchmark": "serve-compare", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "servers": servers, "checks": checks, "rows": rows, "sweeps": sweeps,
              "ceilings": ceilings, "weight_bytes_read": {n: r[0] for n, r in read.items() if r},
              "launched": {n: {"system": s.system, "setting": s.setting, "startup_s": s.startup_s, "log": str(s.log)}
                           for n, s in launched.items()},
              "runs": {n: [s.extra["levels"] for s in ss] for n, ss in samples.items()}}
    H.write_outputs(args, report, "\n".join(md))
    return 0


def main() -> int:
    if {"--compare", "--launch"} & set(sys.argv[1:]):
        return compare(sys.argv[1:])
    from contbatch.bench.cli import main as bench_main

    return bench_main()


if __name__ == "__main__":
    sys.exit(main())
