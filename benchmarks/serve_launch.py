"""`serve.py --launch`: the servers started by the benchmark itself, each peer swept first.

`start_all` starts each `--launch SYSTEM[:knob=v,...]` on its own port (`--base-port` + i),
with the same weights (`--peer-model`, set up by `make bench-peers`); with `--sweep quick|full`
each peer's knobs are swept first (`peers/serve_sweep.py`: each candidate started, measured by
one pass of this run's own workload, stopped) and the best is started for the timed rounds.
The TTFT workload's functions (`peers/ttft.py`) are re-exported for `serve.py`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import harness as H
from peers import knobs, paths, serve_sweep, servers, ttft


def add_arguments(p) -> None:
    p.add_argument("--launch", nargs="+", default=[], metavar="SYSTEM[:k=v,...]",
                   help=f"servers to start here: {', '.join(servers.SYSTEMS)}, each with knobs "
                        "(vllm: bind, preload, mbt, seqs; llamacpp: np, t, b, ub, quant; contbatch: mbt, block)")
    p.add_argument("--peer-model", default=paths.MODELS[0], choices=paths.MODELS,
                   help="the weights every launched server loads (made by `make bench-peers`)")
    p.add_argument("--dtype", default="float32", help="launched contbatch / vLLM dtype (llama.cpp: its quant)")
    p.add_argument("--base-port", type=int, default=8100, help="launched servers listen on this port and the next")
    p.add_argument("--sweep", choices=["none", "quick", "full"], default="none",
                   help="sweep each launched peer's knobs first (peers/knobs.py), then run its best")
    p.add_argument("--workload", choices=["throughput", "ttft-prefix"], default="throughput",
                   help="the load levels, or the shared-system-prompt TTFT workload (peers/ttft.py)")
    p.add_argument("--ttft-prefix-lens", default=",".join(map(str, ttft.PREFIX_LENS)),
                   help="ttft-prefix: system prompt lengths, tokens")
    p.add_argument("--ttft-lone", type=int, default=ttft.TtftPlan.lone, help="ttft-prefix: lone requests per length")
    p.add_argument("--ttft-concurrent", type=int, default=ttft.TtftPlan.concurrent,
                   help="ttft-prefix: concurrent requests per length")


def ttft_plan(args) -> ttft.TtftPlan:
    return ttft.TtftPlan(prefix_lens=tuple(H.comma_list(args.ttft_prefix_lens, int)), lone=args.ttft_lone,
                         concurrent=args.ttft_concurrent)


ttft_pass = ttft.run_pass
level_names = ttft.level_names


def describe_ttft(plan: ttft.TtftPlan) -> str:
    return (f"TTFT with shared system prompts of {', '.join(map(str, plan.prefix_lens))} tokens (each primed once, "
            f"then {plan.lone} lone requests and {plan.concurrent} concurrent ones, {plan.suffix_len}-token user "
            f"texts, {plan.output_len} new tokens)")


def score(levels: dict[str, dict], ttft_workload: bool) -> float | None:
    """A sweep candidate's figure: output tok/s over the pass (throughput), or 1000 / the mean
    TTFT p50 over the levels (TTFT: higher is better either way); None when a request failed."""
    if any(lv["failed"] for lv in levels.values()):
        return None
    if ttft_workload:
        return 1000.0 / statistics.fmean(lv["ttft"]["p50_ms"] for lv in levels.values())
    duration = sum(lv["duration_s"] for lv in levels.values())
    return sum(lv["total_output_tokens"] for lv in levels.values()) / duration if duration else None


def start_all(args, one_pass_at: Callable[[str, str], dict], log) -> tuple[dict, dict]:
    """(label -> running Server, label -> sweep tried list). Stops what it started on failure."""
    launched: dict[str, servers.Server] = {}
    sweeps: dict[str, list[dict]] = {}
    concurrency = args.ttft_concurrent if args.workload == "ttft-prefix" else max(args.max_concurrency or [1])
    try:
        for i, spec in enumerate(args.launch):
            system, setting = servers.parse_spec(spec)
            port = args.base_port + i
            if args.sweep != "none" and serve_sweep.stages(system, args.sweep, concurrency):
                log(f"-- sweep {system} from {knobs.label(setting)}")
                setting, tried = serve_sweep.sweep(
                    system, args.peer_model, args.dtype, setting, args.sweep, concurrency, port,
                    lambda srv: score(one_pass_at(srv.url, srv.name), args.workload == "ttft-prefix"), log)
                sweeps[system] = tried
            server = servers.launch(system, args.peer_model, args.dtype, setting, port)
            log(f"   started {server.label} at {server.url} in {server.startup_s:.0f} s")
            launched[server.label] = server
    except BaseException:
        for server in launched.values():
            server.stop()
        raise
    return launched, sweeps


def sweep_markdown(sweeps: dict[str, list[dict]]) -> list[str]:
    out = []
    for system, tried in sweeps.items():
        body = [[knobs.label(t["setting"]), "failed" if t["score"] is None else f"{t['score']:.2f}",
                 f"{t['startup_s']:.0f}" if "startup_s" in t else "-", t.get("error", "")] for t in tried]
        out.append(f"<details><summary>{system} sweep (one pass each)</summary>\n\n"
                   + H.md_table(["setting", "score", "start-up s", "error"], body, [False, True, True, False])
                   + "\n\n</details>\n")
    return out


class CeilingProbe:
    """The machine's matmul rate and weight-read bandwidth, measured on the model the servers
    load (`harness/ceilings.py`): the floors each server's figures are read against. Read before
    the rounds, between the servers' passes (`H.ceiling_probe` of its bandwidth, a system of the
    interleaved rounds) and after them: this machine's bandwidth drifted by up to 2x within minutes, so readings taken
    only before and after the rounds misread the passes between; the floors take the median of
    every reading (`floors`). The reference model stays loaded until `close`."""

    def __init__(self, reference_model: str, dtype: str = "float32") -> None:
        self.model, _ = H.load(reference_model, dtype)
        self.readings: list[dict] = []

    def measure(self) -> dict:
        model = self.model
        bw, nbytes, how = H.weight_read_bandwidth(model, repeats=3)
        self.readings.append({"matmul_gflops": H.matmul_rate(next(model.parameters()).dtype, n=2048, seconds=0.5),
                              "weight_read_gb_s": bw, "weight_bytes": nbytes, "weight_reader": how,
                              "non_embedding_params": H.non_embedding_params(model)})
        return self.readings[-1]

    def close(self) -> None:
        import gc

        self.model = None
        gc.collect()


def read_bytes(server: servers.Server) -> tuple[int, str] | None:
    """(bytes, what they are) of the weights one decode step of `server` reads, where they are
    not the reference model's at the run's dtype: a GGUF file's tensors where the server loads
    one (llama.cpp always; contbatch with `quant=Q8_0`, `Q4_0`, ...), the packed model's resident
    weights where contbatch quantizes at load (`quant=int8`, `int4`, ...). None: the reference's."""
    quant = str(server.setting.get("quant") or "")
    if server.system == "llamacpp":
        quant = quant or knobs.LLAMA_DEFAULTS["quant"]
    if not quant:
        return None
    if server.system == "contbatch" and quant.lower() in servers.QUANTIZE_AT_LOAD:
        from contbatch.setup.loading import load_model
        from contbatch.setup.quantize import summary_of

        model, _ = load_model(str(paths.model_dir(server.name)), quantization=quant.lower())
        return summary_of(model).resident_bytes, f"{quant} packed at load"
    from gguf import GGUFReader

    path = paths.gguf_path(server.name, quant)
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors), f"the {quant.upper()} GGUF's tensors"


def floors(ceilings: list[dict], level: dict, weight_bytes: int | None = None) -> tuple[float, float]:
    """(matmul floor in output tok/s for this level's tokens, weight-read floor of one stream in
    tok/s: `weight_bytes`, or the reference model's, at the read bandwidth), at the median of the
    ceilings measured in the run."""
    rate = statistics.median(c["matmul_gflops"] for c in ceilings) * 1e9
    bw = statistics.median(c["weight_read_gb_s"] for c in ceilings) * 1e9
    c0 = ceilings[0]
    tokens = level["total_input_tokens"] + level["total_output_tokens"]
    matmul = level["total_output_tokens"] / (2 * c0["non_embedding_params"] * tokens / rate) if tokens else math.nan
    return matmul, bw / (weight_bytes or c0["weight_bytes"])


def ceilings_line(ceilings: list[dict], read: dict[str, tuple[int, str] | None] | None = None) -> str:
    """The run's ceilings and how the floors are made; `read`: `read_bytes` of each server."""
    g = [c["matmul_gflops"] for c in ceilings]
    b = [c["weight_read_gb_s"] for c in ceilings]
    own = "; ".join(f"{name} {r[0] / 1e6:.0f} MB ({r[1]})" for name, r in (read or {}).items() if r)
    return (f"Ceilings measured in this run ({len(ceilings)} readings: before, between the servers' passes and "
            f"after them; the floors at their medians): matmul {min(g):.1f}-{max(g):.1f} "
            f"GFLOP/s, weight read {min(b):.1f}-{max(b):.1f} GB/s ({ceilings[0]['weight_bytes'] / 1e6:.0f} MB, "
            f"{ceilings[0]['weight_reader']}). Of matmul floor: output tok/s over 2 x non-embedding params x "
            f"(prompt + output tokens) at that rate; decode of weight-read floor: 1000 / TPOT p50 over the bytes of "
            f"weights a decode step reads / bandwidth (the one-stream bound)"
            + (f": {own}; the others the reference model's" if own else "") + ".\n")
