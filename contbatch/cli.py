"""`contbatch` command line: `contbatch generate` runs prompts through `generate_batch`;
`contbatch serve` runs the OpenAI-compatible server; `contbatch bench serve` loads one."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .cli_options import add_device_arguments, add_ray_arguments

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for writing clear code.",
    "What is continuous batching in LLM inference?",
    "Translate 'good morning' into Spanish and German.",
    "Name the planets of the solar system in order.",
    "Write a Python function that reverses a string.",
]

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _read_prompts(path: Path) -> list[str | list[dict]]:
    """One prompt a line, or JSONL with `prompt` (text) or `messages` (chat) fields."""
    prompts: list[str | list[dict]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            row = json.loads(line)
            prompts.append(row["messages"] if "messages" in row else row["prompt"])
        else:
            prompts.append(line)
    return prompts


def _encode(tokenizer, prompt, chat: bool) -> list[int]:
    if isinstance(prompt, list):
        messages = prompt
    elif chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return tokenizer.encode(prompt)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.ray_replicas or args.ray_address:
        from .ray.cli import cmd_generate_ray

        return cmd_generate_ray(args)
    import torch

    from . import load_model
    from .cli_options import resolve_device
    from .distributed.launch import launch_ranks, run_as_rank

    status = launch_ranks(args)  # --tensor-parallel-size N: this process starts the N ranks and waits
    if status is not None:
        return status
    tp_plan = "auto" if args.tensor_parallel_size > 1 else None
    model, tokenizer = load_model(args.model, dtype=getattr(torch, DTYPES[args.dtype]),
                                  device=resolve_device(args.device), tp_plan=tp_plan)
    return run_as_rank(model, lambda: _generate(args, model, tokenizer))


def _generate(args: argparse.Namespace, model, tokenizer) -> int:
    from transformers import GenerationConfig

    from . import ContinuousBatchingConfig, SamplingParams, generate_batch
    from .cli_options import gpu_config

    prompts = _read_prompts(Path(args.input)) if args.input else BUILTIN_PROMPTS
    inputs = [_encode(tokenizer, p, not args.no_chat_template) for p in prompts]
    eos = None if args.ignore_eos else model.generation_config.eos_token_id
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos)
    config = ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        scheduler_type=args.scheduler,
        **gpu_config(args),
    )
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    results = generate_batch(
        model, inputs, gen, config, progress_bar=not args.quiet, sampling_params=params, tokenizer=tokenizer
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contbatch", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="batch-generate for prompts from a file (or built-in ones)")
    gen.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M)")
    gen.add_argument("--input", help="text file (one prompt a line) or .jsonl with prompt/messages")
    gen.add_argument("--output", help="write JSONL results here instead of printing")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat-template", action="store_true")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--block-size", type=int, default=256)
    gen.add_argument("--num-blocks", type=int, default=None)
    gen.add_argument("--max-batch-tokens", type=int, default=None)
    gen.add_argument("--scheduler", choices=["fifo", "prefill_first"], default="fifo")
    gen.add_argument("--quiet", action="store_true")
    add_device_arguments(gen)
    add_ray_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    from .server.serve import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded model on 127.0.0.1:8000)")
    add_serve_arguments(serve)
    add_ray_arguments(serve, serve=True)
    serve.set_defaults(func=_cmd_serve)

    from .bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test any OpenAI-compatible server")
    add_bench_arguments(bench_serve)
    bench_serve.set_defaults(func=_cmd_bench_serve)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.ray_replicas or args.ray_address:
        from .ray.cli import cmd_serve_ray

        return cmd_serve_ray(args)
    from .server.serve import cmd_serve

    return cmd_serve(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from .bench.cli import cmd_bench_serve

    return cmd_bench_serve(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each tensor-parallel rank runs again
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
