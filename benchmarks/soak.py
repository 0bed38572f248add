"""Soak test of `contbatch serve`: a bounded, seeded, mixed load with faults injected, then a verdict.

The server runs in this process (the app of `contbatch.server.app.build_app` under uvicorn in a
background thread, on 127.0.0.1 and a free port) so that the engine can be inspected once the
load is over. A small KV cache and a small `max_queue_size` make KV pressure (soft resets,
offloads) and 429s part of the load. Concurrent asyncio clients (httpx) and raw-socket clients
send, at random with a fixed seed: streaming and non-streaming chat and completions, n > 1,
logprobs with top_p/top_k, stop strings, seeds, several prompts at once, cancels (a stream closed
early, a non-streaming request abandoned), killed connections (a raw socket closed mid-body or
mid-stream, some with a TCP reset), slow readers, malformed bodies and over-long prompts. Faults
are injected at random engine steps through `contbatch.faults` (forward, sampler, detokenizer,
and after a result handler ran).

At the end it checks, prints a JSON summary and exits 1 if any check fails:
- nothing lost: every request got a complete response or an OpenAI-shaped error (a stream ends
  with `data: [DONE]`, after an error event if it failed), and sent = every outcome counted;
- no bad response: no 500 (or error event) except those caused by an injected fault, no 4xx where
  a request was valid (429 queue_full aside), a 4xx for every malformed or over-long body;
- faults accounted for: requests failed by a fault name a site that fired, and sites that fired
  often failed some request;
- the engine idle and clean: no request running or waiting, every KV block free (cached prefix
  blocks count as free), no stream queue, pending result or sample group left in the manager's
  result store, no live entry in the server's AsyncEngine, no offloaded KV, gate in-flight 0;
- the engine alive: its thread still runs, and a greedy chat and a greedy streamed completion
  sent at the end (faults uninstalled) return the text they returned at the start;
- RSS growth after warm-up under `--rss-growth-mib`.

    .venv/bin/python benchmarks/soak.py                       # 10 minutes on the default model
    .venv/bin/python benchmarks/soak.py --duration 120 --results-md benchmarks/RESULTS.md
    .venv/bin/python benchmarks/soak.py --short               # ~30 s, tiny random model (CI)

The parts: `soak_requests.py` (what is sent), `soak_clients.py` (the httpx and raw-socket
clients), `soak_checks.py` and `soak_outcomes.py` (what came back, and the ledger),
`soak_server.py` (the server in this process and what is inspected afterwards); this file runs
the load and gives the verdict.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import transformers  # noqa: E402

import harness as H  # noqa: E402
from contbatch import faults  # noqa: E402
from soak_clients import Load  # noqa: E402
from soak_server import LogTally, baseline, idle_state, is_idle, rss_mib, start_server  # noqa: E402


@dataclass
class Profile:
    """Defaults of one mode; every field can be overridden by its flag."""

    model: str
    duration: float
    clients: int
    raw_clients: int
    block_size: int
    num_blocks: int
    offload_blocks: int
    max_queue_size: int
    max_model_len: int
    max_tokens: int
    request_timeout: float
    warmup: float
    rss_growth_mib: float


PROFILES = {
    "full": Profile(model="default", duration=600, clients=8, raw_clients=2, block_size=16, num_blocks=24,
                    offload_blocks=6, max_queue_size=6, max_model_len=384, max_tokens=64, request_timeout=180,
                    warmup=30, rss_growth_mib=256),
    "short": Profile(model="tiny", duration=15, clients=6, raw_clients=2, block_size=16, num_blocks=16,
                     offload_blocks=4, max_queue_size=6, max_model_len=256, max_tokens=48, request_timeout=30,
                     warmup=5, rss_growth_mib=128),
}
SHOWN = ("device", "dtype", "block_size", "num_blocks", "max_queue_size", "cpu_offload_blocks", "attention_backend",
         "max_batch_tokens")  # the engine settings printed at the start


async def run(args) -> dict:
    tally = LogTally()
    for name in ("contbatch", "uvicorn"):
        lg = logging.getLogger(name)
        lg.addHandler(tally)
        lg.propagate = False
    t_start = time.time()
    url, manager, app, server, thread, tok = start_server(args)
    print(f"soak: server on {url}, model {args.model}, engine "
          f"{json.dumps({k: v for k, v in manager.resolved_config.as_dict().items() if k in SHOWN})}", flush=True)
    load = Load(args, url, tok, app.state.limits.max_model_len)
    checks: dict[str, dict] = {}
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "results_md"}}
    injector = None
    rss = {"start": round(rss_mib(), 1)}
    try:
        first = await baseline(url)
        report["baseline"] = first
        if args.faults:
            injector = faults.install(dict(zip(faults.SITES, args.fault_rates)), seed=args.seed)

        samples: list[tuple[float, float]] = []
        died_at: list[float] = []

        async def monitor(t0: float) -> None:
            warm_taken = False
            while not load.stop.is_set():
                now = time.monotonic()
                samples.append((round(now - t0, 1), round(rss_mib(), 1)))
                if not warm_taken and now - t0 >= args.warmup:
                    gc.collect()
                    rss["after_warmup"] = round(rss_mib(), 1)
                    warm_taken = True
                if not manager.is_running():
                    died_at.append(round(now - t0, 1))
                    load.stop.set()  # no point loading a dead engine; the checks say why
                    return
                await asyncio.sleep(0.25)

        t0 = time.monotonic()
        load.deadline = t0 + args.duration
        mon = asyncio.create_task(monitor(t0))
        workers = [asyncio.create_task(load.http_worker(i)) for i in range(args.clients)]
        workers += [asyncio.create_task(load.raw_worker(i)) for i in range(args.raw_clients)]
        pending = set(workers)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if died_at and time.monotonic() - t0 > died_at[0] + args.dead_grace:
                for task in pending:  # what the dead engine never answered is lost
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        for task in workers:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()
        load_s = time.monotonic() - t0
        load.stop.set()
        await mon
        counts = dict(injector.counts) if injector else dict.fromkeys(faults.SITES, 0)
        faults.uninstall()

        # Idle: wait for the engine to settle (killed connections are noticed a little later).
        t_idle = time.monotonic()
        state = idle_state(manager, app)
        wait = args.idle_timeout if manager.is_running() else min(args.idle_timeout, 3.0)  # dead: won't change
        while not is_idle(state) and time.monotonic() - t_idle < wait:
            await asyncio.sleep(0.2)
            state = idle_state(manager, app)
        idle_wait = time.monotonic() - t_idle
        alive = manager.is_running()
        last = await baseline(url) if alive else {"chat": None, "completion_stream": None}
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            health = (await client.get("/health")).status_code
        gc.collect()
        rss["end"] = round(rss_mib(), 1)
        rss["peak"] = max([s[1] for s in samples] + [rss["end"]])
        rss.setdefault("after_warmup", samples[-1][1] if samples else rss["start"])
        rss["growth_after_warmup"] = round(rss["end"] - rss["after_warmup"], 1)
        stats = manager.stats()
        led = load.ledger

        # -- checks ------------------------------------------------------------------------
        def check(name: str, ok: bool, detail) -> None:
            checks[name] = {"ok": bool(ok), "detail": detail}

        sent = sum(led.sent.values())
        accounted = sum(led.verdicts.values())
        check("every_request_accounted", sent == accounted and led.verdicts["lost"] == 0,
              f"sent {sent} = ok {led.verdicts['ok']} + clean errors {led.verdicts['clean_error']} + fault errors "
              f"{led.verdicts['fault_error']} + aborted by the client {led.verdicts['aborted']} + bad "
              f"{led.verdicts['bad']} + lost {led.verdicts['lost']} (accounted {accounted})")
        bad_500 = sum(v for k, v in led.problem_counts.items() if "/500/" in k)
        check("no_bad_responses", led.verdicts["bad"] == 0,
              f"{led.verdicts['bad']} bad responses ({bad_500} of them 500s not caused by an injected fault)")
        fired = {s: counts.get(s, 0) for s in faults.SITES}
        failing_sites = ("forward", "sampler", "detokenizer")
        unexplained = {s: n for s, n in led.fault_errors.items() if s not in failing_sites or not fired.get(s)}
        silent = [s for s in failing_sites if fired[s] >= args.fault_min_visible and not led.fault_errors[s]]
        # A step's fault fails the requests of that step (at most one per client); a
        # detokenizer fault fails the one request it hit.
        cap = {"forward": args.clients + args.raw_clients, "sampler": args.clients + args.raw_clients,
               "detokenizer": 1}
        too_many = {s: n for s, n in led.fault_errors.items() if s in cap and n > fired[s] * cap[s]}
        check("fault_errors_match_injections", not unexplained and not silent and not too_many,
              {"injected": fired, "requests_failed_by_fault": dict(led.fault_errors),
               "errors_without_a_fault_at_their_site": unexplained,
               "more_failed_requests_than_the_faults_could_reach": too_many,
               f"sites_fired_{args.fault_min_visible}+_times_without_any_failed_request": silent})
        check("engine_alive", alive and not died_at and health == 200,
              {"engine_thread_running": alive, "died_at_s": died_at[0] if died_at else None, "health": health})
        check("engine_idle_and_clean", is_idle(state), {**state, "waited_s": round(idle_wait, 1)})
        check("same_greedy_text_at_end", first == last and None not in first.values(),
              {"start": first, "end": last})
        check("rss_growth_bounded", rss["growth_after_warmup"] <= args.rss_growth_mib,
              f"{rss['growth_after_warmup']} MiB after warm-up (bound {args.rss_growth_mib} MiB)")
        report["coverage"] = {
            "queue_full_429": led.statuses.get("429", 0), "kv_soft_resets": stats["soft_resets"],
            "kv_offloads": stats["offloads"], "kv_restores": stats["restores"],
            "faults_injected": sum(fired.values()), "aborted_by_client": led.verdicts["aborted"],
        }
        report["coverage_gaps"] = [k for k, v in report["coverage"].items() if not v]
        report.update({
            "passed": all(c["ok"] for c in checks.values()),
            "load_seconds": round(load_s, 1), "wall_seconds": round(time.time() - t_start, 1),
            "sent": sent, "verdicts": dict(led.verdicts), "status_codes": dict(sorted(led.statuses.items())),
            "per_kind": {k: {"sent": led.sent[k], **dict(led.kinds[k])} for k in sorted(led.sent)},
            "faults_injected": fired, "requests_failed_by_fault": dict(led.fault_errors),
            "engine": {k: stats[k] for k in ("steps", "soft_resets", "offloads", "restores", "prefix_cache_hit_rate",
                                             "free_blocks", "cached_blocks", "running", "waiting")},
            "rss_mib": rss, "rss_samples": samples[:: max(1, len(samples) // 20)],
            "checks": checks, "problems": dict(led.problem_counts), "problem_examples": led.examples,
            "server_log": dict(tally.counts), "server_log_examples": tally.examples,
        })
        return report
    finally:
        faults.uninstall()
        server.should_exit = True
        thread.join(30)


def markdown_section(report: dict) -> str:
    c = report["config"]
    out = H.report_header(f"soak of `contbatch serve`, {'PASSED' if report['passed'] else 'FAILED'}",
                          report.get("machine"), None)
    out += [f"Model {c['model']}, {report['load_seconds']} s of load, {c['clients']} httpx + {c['raw_clients']} "
            f"raw-socket clients, {c['num_blocks']} blocks of {c['block_size']}, max_queue_size {c['max_queue_size']}, "
            f"fault rates {dict(zip(faults.SITES, c['fault_rates'])) if c['faults'] else 'off'}.\n"]
    rows = []
    for name, ch in report["checks"].items():
        detail = ch["detail"] if isinstance(ch["detail"], str) else json.dumps(ch["detail"])
        rows.append([name, "yes" if ch["ok"] else "**no**", detail.replace("|", "/")[:400]])
    out += [H.md_table(["check", "ok", "detail"], rows, [False, False, False]), "",
            f"Sent {report['sent']}: {json.dumps(report['verdicts'])}; status codes "
            f"{json.dumps(report['status_codes'])}; faults injected {json.dumps(report['faults_injected'])}; "
            f"engine {json.dumps(report['engine'])}; RSS MiB {json.dumps(report['rss_mib'])}.", ""]
    return "\n".join(out)


def parse_args(argv: list[str]):
    p = H.parser(__doc__)
    p.add_argument("--short", action="store_true", help="the CI mode: tiny random model, ~15 s of load")
    p.add_argument("--model", help="default (SmolLM2-135M), tiny (random 2-layer Llama, default tokenizer), "
                                   "or a local HF folder / .gguf")
    p.add_argument("--duration", type=float, help="seconds of load (default 600; --short: 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, help="concurrent httpx clients")
    p.add_argument("--raw-clients", type=int, help="concurrent raw-socket clients")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="small, so that KV pressure happens")
    p.add_argument("--offload-blocks", type=int, help="host blocks for offloaded KV (0: soft resets only)")
    p.add_argument("--max-queue-size", type=int, help="small, so that 429s happen")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-tokens", type=int, help="largest max_tokens of a generation request")
    p.add_argument("--max-body-bytes", type=int, default=65536)
    p.add_argument("--request-timeout", type=float, help="a request without a complete answer by then is lost")
    p.add_argument("--warmup", type=float, help="seconds of load before the RSS reference is taken")
    p.add_argument("--rss-growth-mib", type=float, help="allowed RSS growth from the end of warm-up to the end")
    p.add_argument("--idle-timeout", type=float, default=30, help="seconds to wait for the engine to go idle")
    p.add_argument("--dead-grace", type=float, default=5,
                   help="if the engine thread dies, seconds its requests in flight still get before they are lost")
    for site in faults.SITES:
        p.add_argument(f"--fault-{site}", type=float, default=0.01, help=f"fault rate at {site} (default 0.01)")
    p.add_argument("--no-faults", dest="faults", action="store_false")
    p.add_argument("--fault-min-visible", type=int, default=3,
                   help="a site that fired this often must have failed at least one request")
    p.add_argument("--json", type=Path, help="write the summary here too")
    p.add_argument("--results-md", type=Path, help="record a dated markdown section here (e.g. benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    profile = PROFILES["short" if args.short else "full"]
    for key, value in vars(profile).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.fault_rates = [getattr(args, f"fault_{s}") for s in faults.SITES]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    report = asyncio.run(run(args))
    report["machine"] = H.machine_info()
    print(json.dumps({k: v for k, v in report.items() if k not in ("checks",)}, indent=1, default=str))
    print("\nsoak verdict:")
    for name, ch in report["checks"].items():
        detail = ch["detail"] if isinstance(ch["detail"], str) else json.dumps(ch["detail"], default=str)
        print(f"  [{'PASS' if ch['ok'] else 'FAIL'}] {name}: {detail}")
    if report["coverage_gaps"]:
        print(f"  note: this run never exercised {report['coverage_gaps']}")
    print(f"soak: {'PASSED' if report['passed'] else 'FAILED'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.results_md:
        H.record_run(args.results_md, markdown_section(report))
        print(f"recorded in {args.results_md}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
