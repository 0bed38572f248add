"""LoRA flags shared by `contbatch serve` and `contbatch generate`: `--lora NAME=PATH`
(repeatable; PEFT adapter directories loaded at start), `--max-loras`, `--max-lora-rank`
(the resident budget, docs/lora.md) and, for `generate`, `--adapter NAME` (which one its
prompts use)."""

from __future__ import annotations

import argparse


def lora_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def add_lora_arguments(p: argparse.ArgumentParser, generate: bool = False) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", type=lora_pair,
                   help="a PEFT LoRA adapter directory served under NAME (repeatable)")
    p.add_argument("--max-loras", type=int, default=None, help="adapters resident at once (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default 64)")
    if generate:
        p.add_argument("--adapter", default=None, metavar="NAME",
                       help="the --lora adapter every prompt uses (default: the only one given, else none)")


def lora_adapters(args: argparse.Namespace) -> dict[str, str]:
    """{name: path} of the --lora flags; a name given twice is an error."""
    pairs = getattr(args, "lora", None) or []
    names = [n for n, _ in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"--lora names must be unique: {', '.join(dupes)} given twice")
    return dict(pairs)


def chosen_adapter(args: argparse.Namespace) -> str | None:
    """`generate`'s adapter for every prompt: --adapter, or the only --lora given."""
    adapters = lora_adapters(args)
    if args.adapter is not None:
        if args.adapter not in adapters:
            names = ", ".join(adapters) or "none"
            raise SystemExit(f"--adapter {args.adapter!r} is not one of the --lora names ({names})")
        return args.adapter
    return next(iter(adapters)) if len(adapters) == 1 else None


def refuse_unsupported(args: argparse.Namespace) -> None:
    """--lora with Ray replicas or tensor parallelism: refused at start, with the reason."""
    if not getattr(args, "lora", None):
        return
    if getattr(args, "ray_replicas", 0) or getattr(args, "ray_address", None):
        raise SystemExit("--lora is not supported with Ray replicas yet: run without --ray-replicas/--ray-address")
    if getattr(args, "tensor_parallel_size", 1) > 1:
        raise SystemExit("--lora is not supported under tensor parallelism (the adapters would have to be sharded "
                         "as their layers are): run with --tensor-parallel-size 1")
