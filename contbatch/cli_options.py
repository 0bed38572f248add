"""Command-line options shared by `contbatch generate` and `contbatch serve`: device and GPU path,
and running on Ray (`--ray-replicas`, `--ray-address`; contbatch.ray, docs/ray.md)."""

from __future__ import annotations

import argparse

from .config import ATTENTION_BACKENDS, CPU_LINEAR_KERNELS


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
    p.add_argument("--cpu-linear-kernel", choices=CPU_LINEAR_KERNELS, default="auto",
                   help="linear layers on the CPU: auto times aten (MKL in float32), oneDNN, our few-row C++ "
                        "kernel and (bfloat16, float16) a float32 product on the model's shapes at start-up and "
                        "takes the fastest per shape and row count")
    p.add_argument("--cpu-linear-prepack", action=on_off, default=True,
                   help="layers on oneDNN keep a prepacked copy of their weight (1.2-1.5x faster at decode batch "
                        "sizes, same results) where the copies fit in a quarter of the available RAM")
    p.add_argument("--cpu-rms-norm-kernel", choices=["auto", "aten"], default="auto",
                   help="RMSNorm on the CPU: auto runs each norm class that matches our fused C++ op at start-up "
                        "as one call per norm; aten keeps PyTorch's ops")
    p.add_argument("--cpu-rotary-kernel", choices=["auto", "aten"], default="auto",
                   help="rotary embeddings on the CPU: auto runs the model's apply_rotary_pos_emb as one fused call "
                        "where it matched the original bit for bit at start-up; aten keeps PyTorch's ops")
    p.add_argument("--cpu-layer-kernel", choices=["auto", "layer", "aten"], default="auto",
                   help="decoder layers on the CPU: layer runs each Llama-family layer as one C++ call in steps "
                        "on our attention (checked bit-identical to its own forward at run time); auto also runs "
                        "the whole stack as one call once a step showed the model's loop a plain chain; aten keeps "
                        "each layer's own forward")
    p.add_argument("--cpu-prefill-kernel", choices=["auto", "aten"], default="auto",
                   help="prefill attention on the CPU: auto runs our C++ kernel (every prompt chunk of a step in one "
                        "call per layer, K/V read in place); aten runs SDPA one request at a time")
    p.add_argument("--speculative-method", choices=["ngram", "draft_model"], default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft_model (--speculative-model); default off")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="proposals per request per step")
    p.add_argument("--speculative-model", default=None, help="draft model (local HF folder or .gguf), same tokenizer")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest tail matched")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest tail matched")


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
        cpu_linear_prepack=args.cpu_linear_prepack,
        cpu_rms_norm_kernel=args.cpu_rms_norm_kernel,
        cpu_rotary_kernel=args.cpu_rotary_kernel,
        cpu_layer_kernel=args.cpu_layer_kernel,
        cpu_prefill_kernel=args.cpu_prefill_kernel,
        **({} if args.compile_level is None else {"default_compile_level": args.compile_level}),
        speculative_config=speculative_config(args),
    )


def speculative_config(args: argparse.Namespace) -> dict | None:
    if getattr(args, "speculative_method", None) is None:
        return None
    return {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
            "model": args.speculative_model, "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}


def add_ray_arguments(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """Run on Ray instead of in this process (needs the `ray` extra)."""
    p.add_argument("--ray-replicas", type=int, default=0,
                   help="run N engines on Ray (Serve replicas for serve, Ray Data actors for generate); 0: no Ray")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto': the one `ray start` runs here; default: start a local one)")
    p.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs per replica/actor (fractional allowed)")
    p.add_argument("--ray-num-gpus", type=float, default=0.0, help="GPUs per replica/actor")
    if not serve:
        return
    p.add_argument("--ray-min-replicas", type=int, default=None, help="autoscale between min and max replicas")
    p.add_argument("--ray-max-replicas", type=int, default=None)
    p.add_argument("--ray-target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling target: requests in flight per replica")
    p.add_argument("--ray-max-ongoing-requests", type=int, default=64,
                   help="requests in flight per replica at most; Serve queues the rest")
    p.add_argument("--ray-routing", choices=["prefix", "pow2"], default="prefix",
                   help="prefix: by the prompt's first block, load as tie-break; pow2: Serve's default")
