"""`contbatch bench serve --base-url URL`: the load generator's command line.

Each combination of `--request-rate` and `--max-concurrency` is one load level, run in turn
with the same seeded prompts and arrival schedule; the report has every level, and the plot
shows latency against load.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", default=None, help="model name to send (default: the first from GET /models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="local HF tokenizer folder for building prompts (default: the embedded model's)")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens asked for")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by +- this share")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens after it")
    p.add_argument("--request-rate", nargs="+", default=["inf"],
                   help="requests/s, Poisson arrivals ('inf': all at once); several values = several levels")
    p.add_argument("--max-concurrency", nargs="+", type=int, default=None,
                   help="cap on requests in flight; several values = several levels")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension) for exact lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--output-json", default="bench-serve.json")
    p.add_argument("--plot", default="bench-serve.png")
    p.add_argument("--no-progress", action="store_true")


def _rates(values: list[str]) -> list[float]:
    out = []
    for v in values:
        rate = math.inf if v.lower() in ("inf", "infinity") else float(v)
        if rate <= 0:
            raise ValueError(f"--request-rate must be > 0 or 'inf', got {v}")
        out.append(rate)
    return out


def _tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path is None:
        from ..setup.loading import default_model_dir

        path = str(default_model_dir())
    return AutoTokenizer.from_pretrained(path)


def _discover_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the report
    from .client import Endpoint
    from .datasets import random_dataset, shared_prefix_dataset
    from .report import format_level, level_stats, plot, write_json
    from .runner import Load, run_level

    rates = _rates(args.request_rate)
    concurrencies = args.max_concurrency or [None]
    if any(c is not None and c < 1 for c in concurrencies):
        raise ValueError("--max-concurrency values must be >= 1")
    model = args.model or _discover_model(args.base_url, args.api_key)
    tokenizer = _tokenizer(args.tokenizer)
    if args.dataset == "random":
        requests = random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                  args.seed)
    else:
        requests = shared_prefix_dataset(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len,
                                         args.suffix_len, args.output_len, args.seed)
    endpoint = Endpoint(args.base_url, model, args.endpoint == "chat", args.api_key, args.ignore_eos,
                        args.temperature)
    config = {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}
    config.update(model=model, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    levels = []
    for rate in rates:
        for conc in concurrencies:
            load = Load(rate, conc)
            results, duration = asyncio.run(
                run_level(endpoint, requests, load, args.seed, args.timeout, progress=not args.no_progress)
            )
            stats = level_stats(load, results, duration)
            levels.append(stats)
            print(format_level(stats), flush=True)
    write_json(Path(args.output_json), config, levels)
    if args.plot:
        plot(Path(args.plot), levels, f"{model} at {args.base_url} ({args.dataset}, {args.endpoint})")
    print(f"wrote {args.output_json}" + (f" and {args.plot}" if args.plot else ""))
    return 1 if any(lv["failed"] for lv in levels) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="contbatch bench serve", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_bench_serve(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["add_arguments", "cmd_bench_serve", "main"]
