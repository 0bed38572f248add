"""Command-line options shared by `contbatch generate` and `contbatch serve`: device and GPU path,
CPU kernels, speculative decoding, running on Ray (`--ray-replicas`, `--ray-address`;
docs/ray.md), and the one function that turns them into a `ContinuousBatchingConfig`
(`config_from_args`), which every command and every Ray replica or actor uses."""

from __future__ import annotations

import argparse
import logging

from ..config import ATTENTION_BACKENDS, ContinuousBatchingConfig
from ..cpu import knobs

logger = logging.getLogger("contbatch")

DTYPES = ("float32", "bfloat16", "float16")

# Flags of earlier versions, hidden, each mapped to its override with a warning.
DEPRECATED_FLAGS = {"--cpu-linear-kernel": "linear", "--cpu-linear-prepack": "linear_prepack",
                    "--cpu-rms-norm-kernel": "norm", "--cpu-rotary-kernel": "rotary",
                    "--cpu-layer-kernel": "layer", "--cpu-prefill-kernel": "prefill"}


def _word(value: object) -> str:
    return str(value).lower()


def _override(text: str) -> tuple[str, object]:
    """KEY=VALUE of --cpu-kernel-override, checked against cpu/knobs.py."""
    key, sep, value = text.partition("=")
    allowed = knobs.OVERRIDES.get(key.strip())
    if not sep or allowed is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY one of {', '.join(knobs.OVERRIDES)}")
    by_word = {_word(v): v for v in allowed}
    if value.strip().lower() not in by_word:
        raise argparse.ArgumentTypeError(f"{text!r}: {key.strip()} takes {', '.join(by_word)}")
    return key.strip(), by_word[value.strip().lower()]


def cpu_kernel_overrides(args: argparse.Namespace) -> dict | None:
    """The overrides of --cpu-kernel-override, after those of the deprecated flags."""
    overrides = {}
    for flag, key in DEPRECATED_FLAGS.items():
        value = getattr(args, f"deprecated_{key}", None)
        if value is not None:
            value = knobs.DEPRECATED_VALUES.get((key, value), value)
            logger.warning("contbatch: %s is deprecated and will be removed in the next release; use "
                           "--cpu-kernel-override %s=%s", flag, key, _word(value))
            overrides[key] = value
    overrides.update(getattr(args, "cpu_kernel_override", None) or [])
    return overrides or None


def load_kwargs(args: argparse.Namespace) -> dict:
    """`load_model`'s quantization arguments from --quantization / --dequantize."""
    return {"quantization": getattr(args, "quantization", None), "dequantize": getattr(args, "dequantize", False)}


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
    p.add_argument("--cpu-kernels", choices=knobs.CPU_KERNELS, default="auto",
                   help="our CPU kernels (docs/cpu.md): auto runs each where it measured faster, or matched the "
                        "module it replaces, at start-up; off keeps PyTorch's own ops")
    p.add_argument("--quantization", choices=("int8", "int4", "int4-g32", "int4-g128", "gguf"), default=None,
                   help="weight-only quantized linear layers on the CPU (docs/cpu.md): int8/int4 quantize at load; "
                        "gguf serves a .gguf file (or the default model's own) at its quantization. Default: float, "
                        "except a .gguf --model, served at its quantization")
    p.add_argument("--dequantize", action="store_true",
                   help="a .gguf --model: dequantize every weight to float (the float path) instead")
    p.add_argument("--cpu-kernel-override", action="append", default=[], metavar="KEY=VALUE", type=_override,
                   help="one CPU kernel's choice on top of --cpu-kernels, for A/B runs (repeatable): "
                        + "; ".join(f"{key}={'|'.join(map(_word, values))}" for key, values in knobs.OVERRIDES.items()))
    for flag, key in DEPRECATED_FLAGS.items():  # earlier versions' flags, one release more
        if key == "linear_prepack":
            p.add_argument(flag, dest=f"deprecated_{key}", action=on_off, default=None, help=argparse.SUPPRESS)
        else:
            old = [v for (k, v) in knobs.DEPRECATED_VALUES if k == key]
            p.add_argument(flag, dest=f"deprecated_{key}", choices=[*knobs.OVERRIDES[key], *old], default=None,
                           help=argparse.SUPPRESS)
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
        cpu_kernels=args.cpu_kernels,
        cpu_kernel_overrides=cpu_kernel_overrides(args),
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


def config_from_args(args: argparse.Namespace, max_prompt_length: int | None = None,
                     max_generated_length: int | None = None) -> ContinuousBatchingConfig:
    """The engine config the flags ask for (flags a command lacks keep the config's defaults);
    the workload hints size the CPU cache and block tables (`serve`: `--max-model-len`)."""
    given = {
        "block_size": args.block_size, "num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens,
        "scheduler_type": args.scheduler, "safety_margin": getattr(args, "safety_margin", None),
        "cpu_offload_space": getattr(args, "cpu_offload_space", None),
        "max_queue_size": getattr(args, "max_queue_size", None),
        "max_prompt_length": max_prompt_length, "max_generated_length": max_generated_length,
        "max_loras": getattr(args, "max_loras", None), "max_lora_rank": getattr(args, "max_lora_rank", None),
    }
    return ContinuousBatchingConfig(**{k: v for k, v in given.items() if v is not None}, **gpu_config(args))


def sampling_from_args(args: argparse.Namespace):
    """`contbatch generate`'s sampling flags as `SamplingParams`."""
    from ..sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
