"""Command-line options shared by `contbatch generate` and `contbatch serve`: device and GPU path."""

from __future__ import annotations

import argparse

from .config import ATTENTION_BACKENDS


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when present)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: flash-attn, else our Triton kernels on CUDA; torch on the CPU")
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--decode-fast-path", action=on_off, default=None, help="default: on where the backend has it")
    p.add_argument("--cuda-graph", action=on_off, default=None, help="default: on with triton/flash on CUDA")
    p.add_argument("--async-batching", action=on_off, default=None, help="default: on when CUDA graphs are")
    p.add_argument("--compile-level", type=int, choices=[0, 1, 2, 3], default=None,
                   help="torch.compile the step: 0 none, 1 default+dynamic, 2 max-autotune+dynamic, 3 max-autotune "
                        "static shapes (default: the engine's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N processes (started here, one per rank; gloo on the CPU, NCCL on "
                        "CUDA); N must divide the model's KV heads")
    p.add_argument("--cpu-linear-kernel", choices=["auto", "aten", "onednn"], default="auto",
                   help="float32 linear layers on the CPU: auto times MKL (aten) against oneDNN on the model's "
                        "shapes at start-up and takes the faster per shape")


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def gpu_config(args: argparse.Namespace) -> dict:
    """ContinuousBatchingConfig fields from the options above."""
    return dict(
        attention_backend=args.attention_backend,
        decode_fast_path=args.decode_fast_path,
        use_cuda_graph=args.cuda_graph,
        use_async_batching=args.async_batching,
        cpu_linear_kernel=args.cpu_linear_kernel,
        **({} if args.compile_level is None else {"default_compile_level": args.compile_level}),
    )
