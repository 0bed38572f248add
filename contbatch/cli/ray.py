"""`contbatch serve --ray-replicas N` and `contbatch generate --ray-replicas N`.

The flags of the single-process commands keep their meaning; the engine config each replica
or actor builds is the one `contbatch serve` / `contbatch generate` would build here. The
driver only tokenizes (generate) or deploys (serve): models load in the actors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import ray

from ..ray.spec import EngineSpec
from .options import config_from_args, sampling_from_args
from .prompts import BUILTIN_PROMPTS, encode, read_prompts

logger = logging.getLogger("contbatch.ray")


def _init(args: argparse.Namespace) -> None:
    """Join `--ray-address` (e.g. 'auto' after `ray start --head`), else start a local cluster
    (stopped with every one of its processes by `ray.shutdown()` at the end)."""
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning")
    logger.info("contbatch.ray: cluster resources %s", json.dumps(ray.cluster_resources()))


def _device(args: argparse.Namespace) -> str:
    """The actors' device: the driver may have no GPU where the workers do."""
    if args.device != "auto":
        return args.device
    return "cuda" if args.ray_num_gpus > 0 else "cpu"


def _refuse_quantization(args: argparse.Namespace) -> None:
    """Ray replicas and actors load the model themselves, float: quantized loading is not passed on."""
    if getattr(args, "quantization", None) or getattr(args, "dequantize", False):
        raise SystemExit("--quantization / --dequantize are not supported with Ray replicas or actors yet")


def cmd_serve_ray(args: argparse.Namespace) -> int:
    _refuse_quantization(args)
    from ray import serve

    from ..ray.serve import ServeOptions, drain_front, run_serve
    from ..ray.shutdown import run_until_signalled
    from .serve import ATTN_IMPLEMENTATIONS, server_settings

    settings = server_settings(args)
    # As `contbatch serve` builds it (serve.py), for each replica.
    config = config_from_args(args, max_prompt_length=args.max_model_len)
    spec = EngineSpec(model=args.model, dtype=args.dtype, device=_device(args), config=config)
    options = ServeOptions(
        num_replicas=max(1, args.ray_replicas), min_replicas=args.ray_min_replicas,
        max_replicas=args.ray_max_replicas, target_ongoing_requests=args.ray_target_ongoing_requests,
        max_ongoing_requests=args.ray_max_ongoing_requests, num_cpus=args.ray_num_cpus,
        num_gpus=args.ray_num_gpus, prefix_routing=args.ray_routing == "prefix", host=args.host, port=args.port,
    )
    _init(args)
    banner = {"model": settings.model_root, "url": f"http://{args.host}:{args.port}/v1",
              "api_key_required": bool(settings.api_keys), "attn_implementation": ATTN_IMPLEMENTATIONS[args.attn_implementation],
              "ray": dataclasses.asdict(options), "engine_config": dataclasses.asdict(config)}
    print("contbatch serve (Ray): resolved configuration\n" + json.dumps(banner, indent=2, default=str), flush=True)

    def start() -> None:
        run_serve(spec, settings, options)
        print(f"contbatch serve (Ray): ready at http://{args.host}:{args.port}/v1 (SIGTERM or Ctrl-C drains and "
              "stops it)", flush=True)

    def drain() -> None:
        # The front first (Serve's own shutdown would cut the proxies' connections at once),
        # then Serve.
        ended = drain_front(settings.drain_timeout_s, options.app_name)
        if ended:
            logger.warning("contbatch.ray: %d request(s) still in flight after %.0f s ended with an error",
                           ended, settings.drain_timeout_s)
        serve.shutdown()

    # Then the Ray runtime this process started, with every process of it (joined with
    # --ray-address, this process only disconnects: the cluster stays).
    return run_until_signalled(start, drain=drain, teardown=ray.shutdown)


def cmd_generate_ray(args: argparse.Namespace) -> int:
    _refuse_quantization(args)
    import ray.data
    from transformers import AutoTokenizer

    from ..ray.data import generate
    from ..setup.loading import default_model_dir, load_model

    _init(args)
    prompts = read_prompts(Path(args.input)) if args.input else BUILTIN_PROMPTS
    if args.model and str(args.model).endswith(".gguf"):
        tokenizer = load_model(args.model)[1]
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(args.model or default_model_dir()))
    inputs = [encode(tokenizer, p, not args.no_chat_template) for p in prompts]
    # The workload hints generate_batch would fill in: the CPU cache is sized for them.
    config = config_from_args(args, max_prompt_length=max(len(x) for x in inputs),
                              max_generated_length=args.max_new_tokens)
    params = sampling_from_args(args)
    spec = EngineSpec(model=args.model, dtype=args.dtype, device=_device(args), config=config)
    replicas = max(1, args.ray_replicas)
    batch = max(1, -(-len(inputs) // replicas))  # one batch per actor: each engine batches it whole
    ds = ray.data.from_items([{"index": i, "token_ids": x} for i, x in enumerate(inputs)])
    start = time.perf_counter()
    rows = generate(ds, spec=spec, sampling_params=params, concurrency=replicas, batch_size=batch,
                    num_cpus=args.ray_num_cpus, num_gpus=args.ray_num_gpus).take_all()
    seconds = time.perf_counter() - start
    rows.sort(key=lambda r: r["index"])  # order is preserved; this makes it explicit
    out = open(args.output, "w") if args.output else None
    for prompt, row in zip(prompts, rows):
        record = {"request_id": f"req_{row['index']}", "prompt": prompt, "text": row["generated_text"],
                  "generated_tokens": list(map(int, row["generated_token_ids"])), "status": row["status"],
                  "finish_reason": row["finish_reason"], "error": row["error"]}
        if out:
            out.write(json.dumps(record) + "\n")
        elif not args.quiet:
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            print(f"--- {record['request_id']} [{record['finish_reason']}] {shown}")
            print(record["text"])
    if out:
        out.close()
    generated = sum(len(r["generated_token_ids"]) for r in rows)
    failed = sum(1 for r in rows if r["error"])
    print(f"throughput: {len(rows)} requests, {generated} tokens in {seconds:.2f}s on {replicas} Ray actors "
          f"= {generated / max(seconds, 1e-9):.1f} tok/s" + (f" ({failed} failed)" if failed else ""))
    ray.shutdown()
    return 1 if failed else 0
