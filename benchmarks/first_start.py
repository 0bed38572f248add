"""The first start on a new model against the next ones: what the linear timing probe costs a job.

contbatch times the candidate kernels of each new linear shape once per machine
(cpu/probe.py) and keeps the timings in `$CONTBATCH_CACHE/linear_probe`. Here each model
(`--models`: peer models of benchmarks/peers, `make bench-peers`, or `default`) runs one offline
job (`--prompts` prompts of 16-256 random tokens x `--new-tokens`, `generate_batch`, float32)
in a fresh process twice per round against a fresh cache folder (the native library linked
in, so only the probe is missing): the first start probes, the second reads the timings. The
probe's share is (first - second) / first of the job's time; the target is under 10%.

    python benchmarks/first_start.py [--models default,qwen2.5-0.5b-shape] [--prompts 64]
        [--new-tokens 64] [--repeats 3] [--results-md benchmarks/RESULTS.md]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import harness as H

CHILD = r"""
import random, sys, time
sys.path.insert(0, sys.argv[1])
from transformers import GenerationConfig
from contbatch import generate_batch, load_model
from harness.children import emit
path, prompts, new = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
model, _ = load_model(None if path == "default" else path)
loaded = time.perf_counter() - start
rng = random.Random(0)
inputs = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(16, 257))] for _ in range(prompts)]
config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
start = time.perf_counter()
out = generate_batch(model, inputs, config, progress_bar=False)
job = time.perf_counter() - start
tokens = sum(len(r.generated_tokens) for r in out.values())
emit({"load_s": loaded, "job_s": job, "tok_s": tokens / job})
"""


def fresh_cache(parent: Path) -> Path:
    """A cache folder holding only the built native library (a link to the real one's)."""
    from contbatch.paths import cache_dir

    folder = Path(tempfile.mkdtemp(prefix="cache-", dir=parent))
    if (cache_dir() / "ext").is_dir():
        os.symlink(cache_dir() / "ext", folder / "ext")
    return folder


def model_path(name: str) -> str:
    """The child's model argument: a peer model's folder, a path, or "default" (the embedded one)."""
    from peers import paths

    return str(paths.resolve_model(name) or "default")


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--models", default="default,qwen2.5-0.5b-shape")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    H.add_common_args(p, repeats=3)
    args = H.parse(p)
    models = H.comma_list(args.models)
    here = str(Path(__file__).resolve().parent)
    samples: dict[str, dict[str, list[dict]]] = {m: {"first": [], "next": []} for m in models}
    H.wait_for_quiet(args.noise_threshold)
    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    machine = H.machine_info()
    parent = Path(tempfile.mkdtemp(prefix="first-start-"))
    try:
        for round_, name in H.rounds(models, args.repeats):
            cache = fresh_cache(parent)
            for start in ("first", "next"):
                r = H.run_child(CHILD, [here, model_path(name), args.prompts, args.new_tokens],
                                tree=str(Path(here).parent), env={"CONTBATCH_CACHE": str(cache)})
                samples[name][start].append(r)
                print(f"round {round_} {name} {start} start: job {r['job_s']:.1f} s, {r['tok_s']:.1f} tok/s", flush=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    load = monitor.stop()
    rows = []
    for name in models:
        first, later = samples[name]["first"], samples[name]["next"]
        share = [(a["job_s"] - b["job_s"]) / a["job_s"] * 100 for a, b in zip(first, later)]
        rows.append([name, H.Spread.of([r["job_s"] for r in first]).fmt(), H.Spread.of([r["job_s"] for r in later]).fmt(),
                     H.Spread.of([r["tok_s"] for r in first]).fmt(), H.Spread.of([r["tok_s"] for r in later]).fmt(),
                     H.Spread.of(share).fmt() + "%"])
    table = H.md_table(["model", "first start: job s", "next start: job s", "first: tok/s", "next: tok/s",
                        "probe share of the first job"], rows, [False, True, True, True, True, True])
    print(H.load_line(load) + "\n" + table)
    md = H.report_header("first start on a new model (`benchmarks/first_start.py`)", machine, load,
                         args.noise_threshold)
    md += [f"Each model: {args.prompts} prompts of 16-256 random tokens x {args.new_tokens} new, `generate_batch`, "
           f"float32, in a fresh process against a fresh cache folder (first start: the linear probe runs), then "
           f"again against the same folder (next start); {args.repeats} rounds, median [min, max].\n", table]
    report = {"benchmark": "first_start", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "noisy_rule": H.noisy_rule(args.noise_threshold), "samples": samples}
    H.write_outputs(args, report, "\n".join(md))
    print(json.dumps(samples))


if __name__ == "__main__":
    main()
