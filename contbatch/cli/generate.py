"""`contbatch generate`: prompts from a file (or built-in ones) through `generate_batch`, in
this process, as tensor-parallel ranks, or on Ray actors (`ray.py`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .lora import add_lora_arguments, chosen_adapter, lora_adapters, refuse_unsupported
from .options import DTYPES, add_device_arguments, add_ray_arguments, sampling_from_args
from .prompts import BUILTIN_PROMPTS, encode, read_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--input", help="text file (one prompt a line) or .jsonl with prompt/messages")
    p.add_argument("--output", help="write JSONL results here instead of printing")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--scheduler", choices=["fifo", "prefill_first"], default="fifo")
    p.add_argument("--quiet", action="store_true")
    add_device_arguments(p)
    add_lora_arguments(p, generate=True)
    add_ray_arguments(p)


def cmd_generate(args: argparse.Namespace) -> int:
    refuse_unsupported(args)
    chosen_adapter(args)  # a bad --adapter fails before the model loads
    if args.ray_replicas or args.ray_address:
        from .ray import cmd_generate_ray

        return cmd_generate_ray(args)
    import torch

    from ..setup.loading import load_model
    from .options import load_kwargs, resolve_device
    from .ranks import launch_ranks, run_as_rank

    status = launch_ranks(args)  # --tensor-parallel-size N: this process starts the N ranks and waits
    if status is not None:
        return status
    tp_plan = "auto" if args.tensor_parallel_size > 1 else None
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype),
                                  device=resolve_device(args.device), tp_plan=tp_plan, **load_kwargs(args))
    return run_as_rank(model, lambda: _generate(args, model, tokenizer))


def _generate(args: argparse.Namespace, model, tokenizer) -> int:
    from transformers import GenerationConfig

    from ..api import generate_batch
    from .options import config_from_args

    prompts = read_prompts(Path(args.input)) if args.input else BUILTIN_PROMPTS
    inputs = [encode(tokenizer, p, not args.no_chat_template) for p in prompts]
    eos = None if args.ignore_eos else model.generation_config.eos_token_id
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos)
    config = config_from_args(args)
    params = sampling_from_args(args)
    start = time.perf_counter()
    results = generate_batch(
        model, inputs, gen, config, progress_bar=not args.quiet, sampling_params=params, tokenizer=tokenizer,
        lora_adapters=lora_adapters(args), adapters=[chosen_adapter(args)] * len(inputs) if args.lora else None,
    )
    seconds = time.perf_counter() - start

    out = open(args.output, "w") if args.output else None
    for prompt, (rid, res) in zip(prompts, results.items()):
        text = res.text
        row = {
            "request_id": rid,
            "prompt": prompt,
            "text": text,
            "generated_tokens": res.generated_tokens,
            "status": res.status.value,
            "finish_reason": res.finish_reason,
            "error": res.error,
        }
        if out:
            out.write(json.dumps(row) + "\n")
        elif not args.quiet:
            print(f"--- {rid} [{res.finish_reason}] {prompt if isinstance(prompt, str) else prompt[-1]['content']}")
            print(text)
    if out:
        out.close()
    generated = sum(len(r.generated_tokens) for r in results.values())
    failed = sum(1 for r in results.values() if r.error)
    print(
        f"throughput: {len(results)} requests, {generated} tokens in {seconds:.2f}s "
        f"= {generated / max(seconds, 1e-9):.1f} tok/s" + (f" ({failed} failed)" if failed else "")
    )
    return 1 if failed else 0
