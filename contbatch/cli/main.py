"""`contbatch` command line: `contbatch generate` runs prompts through `generate_batch`;
`contbatch serve` runs the OpenAI-compatible server; `contbatch bench serve` loads one."""

from __future__ import annotations

import argparse
import logging
import sys

from .options import add_ray_arguments


def build_parser() -> argparse.ArgumentParser:
    from ..bench.cli import add_arguments as add_bench_arguments
    from .generate import add_arguments as add_generate_arguments
    from .generate import cmd_generate
    from .serve import add_arguments as add_serve_arguments

    parser = argparse.ArgumentParser(prog="contbatch", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="batch-generate for prompts from a file (or built-in ones)")
    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded model on 127.0.0.1:8000)")
    add_serve_arguments(serve)
    add_ray_arguments(serve, serve=True)
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test any OpenAI-compatible server")
    add_bench_arguments(bench_serve)
    bench_serve.set_defaults(func=_cmd_bench_serve)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.ray_replicas or args.ray_address:
        from .ray import cmd_serve_ray

        return cmd_serve_ray(args)
    from .serve import cmd_serve

    return cmd_serve(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..bench.cli import cmd_bench_serve

    return cmd_bench_serve(args)


def allocator() -> str:
    """Which malloc this process runs on: tcmalloc where the `contbatch` command preloaded it
    (contbatch_launcher), else the C library's."""
    try:
        with open("/proc/self/maps") as maps:
            if "tcmalloc" in maps.read():
                return "tcmalloc (preloaded; CONTBATCH_MALLOC=system keeps glibc's)"
    except OSError:
        pass
    return "glibc malloc"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each tensor-parallel rank runs again
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("contbatch").info("contbatch: memory allocator %s", allocator())
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
