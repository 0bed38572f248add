"""`contbatch serve`: load the model, build the engine and the app, run uvicorn until a signal.

Light at import (the CLI builds its parser from here): everything heavy is imported in
`cmd_serve`. Shutdown is `draining.DrainingServer`'s: 503 for new requests, in-flight ones
drained up to `--drain-timeout`, exit 0; a second signal fails what is left with 503, exit 1.
"""

from __future__ import annotations

import argparse
import json
import os

from ..server.settings import ServerSettings  # plain dataclasses: light
from .lora import add_lora_arguments, lora_adapters, refuse_unsupported
from .options import DTYPES, add_device_arguments, config_from_args, load_kwargs, resolve_device

ATTN_IMPLEMENTATIONS = {"contbatch_paged": "contbatch_paged", "paged": "contbatch_paged"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (repeatable); "
                        "default: $CONTBATCH_API_KEY if set")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model`; the first is reported (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--attn-implementation", choices=sorted(ATTN_IMPLEMENTATIONS), default="contbatch_paged",
                   help="the engine's attention kernel; contbatch has one, paged ('paged' is an alias)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (engine default 256)")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--scheduler", choices=["fifo", "prefill_first"], default="fifo")
    add_device_arguments(p)
    add_lora_arguments(p)
    p.add_argument("--safety-margin", type=float, default=None)
    p.add_argument("--cpu-offload-space", type=float, default=0.0, help="GiB of host memory for preempted KV")
    p.add_argument("--max-queue-size", type=int, default=0,
                   help="unfinished requests the engine holds at most; more get 429 (0 = unlimited)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context per request (prompt + completion); also sizes the KV cache on CPU")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: max(1 MiB, 64 bytes x max_model_len), "
                        "at most 16 MiB)")
    p.add_argument("--header-timeout", type=float, default=None,
                   help="seconds a client has to send a request's line and headers; then 408 and the "
                        "connection is closed (default 10)")
    p.add_argument("--body-timeout", type=float, default=None,
                   help="seconds a client has to send a request's body once its headers are in; then 408 "
                        "(default 30)")
    p.add_argument("--worker-threads", type=int, default=None,
                   help="threads that parse, template and tokenize requests off the event loop (default 2)")
    p.add_argument("--max-queued-jobs", type=int, default=None,
                   help="requests waiting for a worker thread at most; more get 503 (default 64)")
    p.add_argument("--escape-special-tokens", action="store_true",
                   help="tokenize chat message content as plain text, so special tokens typed by clients "
                        "(e.g. <|im_end|>) cannot forge turns (default off, as in vLLM; see docs/security.md)")
    p.add_argument("--weights-dir", default=None,
                   help="folder whose .safetensors files POST /update_weights_from_disk may load (default: the "
                        "route answers 403); see docs/security.md")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral"], default="auto",
                   help="how the model writes tool calls (default: read from the chat template, else hermes); "
                        "see docs/tools.md")
    p.add_argument("--responses-store-size", type=int, default=None,
                   help="responses kept in memory for previous_response_id and GET /v1/responses/{id}, least "
                        "recently used out first (default 1024; 0 keeps none)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to let requests in flight finish after SIGTERM/SIGINT (default 30)")
    p.add_argument("--uvicorn-log-level", default="info")


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP policies the flags ask for; flags left out keep ServerSettings' defaults."""
    from ..setup.loading import DEFAULT_MODEL_NAME

    keys = tuple(args.api_key or ([os.environ["CONTBATCH_API_KEY"]] if os.environ.get("CONTBATCH_API_KEY") else []))
    names = tuple(args.served_model_name or [args.model if args.model else DEFAULT_MODEL_NAME])
    given = {
        "max_body_bytes": args.max_body_bytes, "drain_timeout_s": args.drain_timeout,
        "header_timeout_s": args.header_timeout, "body_timeout_s": args.body_timeout,
        "worker_threads": args.worker_threads, "max_queued_jobs": args.max_queued_jobs,
        "responses_store_size": args.responses_store_size,
    }
    return ServerSettings(served_model_names=names, model_root=str(args.model or DEFAULT_MODEL_NAME),
                          api_keys=keys, max_model_len=args.max_model_len,
                          escape_special_tokens=args.escape_special_tokens, weights_dir=args.weights_dir,
                          tool_call_parser=args.tool_call_parser,
                          **{k: v for k, v in given.items() if v is not None})


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from ..setup.loading import load_model
    from .ranks import launch_ranks, run_as_rank

    refuse_unsupported(args)
    lora_adapters(args)  # duplicate names fail before the model loads
    settings = server_settings(args)
    # A context limit is a workload hint: the CPU cache and block tables are sized for it.
    config = config_from_args(args, max_prompt_length=args.max_model_len)

    status = launch_ranks(args)  # --tensor-parallel-size N: this process starts the N ranks and waits
    if status is not None:
        return status
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=resolve_device(args.device),
                                  tp_plan="auto" if args.tensor_parallel_size > 1 else None, **load_kwargs(args))
    return run_as_rank(model, lambda: _serve(args, settings, config, model, tokenizer))  # workers: rank 0's steps


def _serve(args, settings, config, model, tokenizer) -> int:
    from ..engine.manager import ContinuousBatchingManager
    from ..engine.threads import release_openmp_pool
    from ..server.app import build_app
    from ..server.connections import uvicorn_config
    from ..server.draining import DrainingServer

    manager = ContinuousBatchingManager(model, None, config, tokenizer=tokenizer)
    for name, path in lora_adapters(args).items():  # a bad adapter stops the start, with its reason
        manager.load_adapter(name, path)
    app = build_app(manager, tokenizer, settings)
    banner = {
        "model": settings.model_root, "served_model_names": list(settings.served_model_names),
        "url": f"http://{args.host}:{args.port}/v1", "api_key_required": bool(settings.api_keys),
        "max_model_len": app.state.limits.max_model_len, "max_body_bytes": app.state.max_body_bytes,
        "escape_special_tokens": settings.escape_special_tokens,
        "tool_call_parser": app.state.tool_call_parser,
        "attn_implementation": ATTN_IMPLEMENTATIONS[args.attn_implementation],
        "engine": manager.resolved_config.as_dict(),
    }
    print("contbatch serve: resolved configuration\n" + json.dumps(banner, indent=2), flush=True)
    root = f"http://{args.host}:{args.port}"
    print(f"contbatch serve: chat playground at {root}/ , engine dashboard at {root}/dashboard", flush=True)

    uv_config = uvicorn_config(
        app, settings.header_timeout_s, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        lifespan="on", timeout_graceful_shutdown=5, access_log=args.uvicorn_log_level == "debug",
    )
    server = DrainingServer(uv_config, app.state.server_state, settings.drain_timeout_s, manager)
    # The engine starts on a worker thread (the app's lifespan); the main thread loaded the
    # model, so its OpenMP pool goes now: the engine thread's must be the only one.
    release_openmp_pool()
    try:
        server.run()
    finally:  # whatever ended the loop, no engine thread runs into interpreter teardown
        manager.stop(hard_stop=True, timeout=30)
    return server.exit_status
