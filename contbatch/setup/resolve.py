"""Turn the user's config, the model and the machine into the values in force."""

from __future__ import annotations

import dataclasses

import psutil
import torch

from ..attention.select import choose_backend
from ..cache.block_manager import blocks_for
from ..cache.paged_cache import KVLayout, solve_num_blocks
from ..cache.resident import describe_populate
from ..cpu.knobs import CpuKnobs
from ..cpu.plan import plan_cpu
from ..attention.recurrent import recurrent_mixers
from ..distributed.group import model_tp_size, shard_layout
from ..runtime.compile import resolve_compile
from .quantize import summary_of
from ..config import (
    DEFAULT_SAFETY_MARGINS,
    FALLBACK_MAX_REQUESTS_PER_BATCH,
    ContinuousBatchingConfig,
    ResolvedConfig,
    default_max_batch_tokens,
)

FALLBACK_CONTEXT = 2048
# Rows a step may reach with speculative proposals (SpeculativeConfig.max_step_rows): a CPU
# step stops being bound by reading the weights at a few dozen rows, a GPU's at hundreds.
CPU_SPEC_ROWS = 24
GPU_SPEC_ROWS = 256
FALLBACK_TABLE_TOKENS = 8192  # the reference engine's 32 x 256 fallback, as a floor


def model_context(model: torch.nn.Module) -> int:
    text = model.config.get_text_config()
    return int(getattr(text, "max_position_embeddings", None) or FALLBACK_CONTEXT)


def sliding_window_layers(model: torch.nn.Module) -> int:
    """Layers that attend to a window (Mistral-style everywhere, Gemma-style alternating)."""
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return sum(1 for t in layer_types if t == "sliding_attention")
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return text.num_hidden_layers
    return 0


def offload_blocks(cfg: ContinuousBatchingConfig, bytes_per_block: int) -> tuple[int, float, bool]:
    """Host blocks for the offload tier: the requested GiB, clamped to a share of free RAM;
    and whether it was clamped (rounding down to whole blocks is not a clamp)."""
    if cfg.cpu_offload_space <= 0:
        return 0, 0.0, False
    wanted = cfg.cpu_offload_space * 2**30
    cap = cfg.cpu_offload_space_safety_threshold * psutil.virtual_memory().available
    blocks = int(min(wanted, cap) // bytes_per_block)
    return blocks, blocks * bytes_per_block / 2**30, cap < wanted


def hinted_request_tokens(cfg: ContinuousBatchingConfig) -> int | None:
    if cfg.max_prompt_length is None and cfg.max_generated_length is None:
        return None
    return (cfg.max_prompt_length or 0) + (cfg.max_generated_length or 0)


def blocks_from_hint(max_prompt: int, max_generated: int, block_size: int) -> int:
    """ceil(max_seq / block_size) + 1, rounded up to an even number of blocks."""
    n = blocks_for(max_prompt + max_generated, block_size) + 1
    return n + (n % 2)


def resolve_config(cfg: ContinuousBatchingConfig, model: torch.nn.Module) -> tuple[ResolvedConfig, KVLayout]:
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    layout = shard_layout(KVLayout.from_model_config(model.config, dtype), model)  # this rank's KV heads
    spec = cfg.speculative_config
    recurrent = len(recurrent_mixers(model))
    if recurrent:
        check_recurrent(cfg, model, spec)
    if spec is not None and spec.max_step_rows is None:
        spec = dataclasses.replace(spec, max_step_rows=CPU_SPEC_ROWS if device.type == "cpu" else GPU_SPEC_ROWS)
    # A step's accepted proposals decide the next step's tokens and positions: it cannot be
    # planned before they are read, so speculation runs steps one after the other.
    use_async = False if spec is not None else cfg.use_async_batching
    knobs = CpuKnobs.from_config(cfg.cpu_kernels, cfg.cpu_kernel_overrides)
    backend = choose_backend(
        cfg.attention_backend, device.type, cfg.block_size, cfg.decode_fast_path,
        cfg.use_cuda_graph and not recurrent, use_async, knobs.prefill,
    )
    bs = backend.block_size
    max_context = model_context(model)
    per_request = hinted_request_tokens(cfg)
    per_request = min(per_request, max_context) if per_request else max_context

    max_batch_tokens = cfg.max_batch_tokens or default_max_batch_tokens(device.type)
    max_requests = min(cfg.max_requests_per_batch or FALLBACK_MAX_REQUESTS_PER_BATCH, max_batch_tokens)

    if cfg.num_blocks is not None:
        num_blocks, rule = cfg.num_blocks, "explicit"
    else:
        num_blocks, rule = solve_num_blocks(
            layout, bs, device, max_requests * blocks_for(per_request, bs) * bs, cfg.max_memory_percent,
        )
        # One request must always fit, or it could wait forever.
        floor = blocks_for(per_request, bs)
        if num_blocks < floor:
            num_blocks, rule = floor, rule + f"; raised to {floor} blocks so one full request fits"
    max_requests = min(max_requests, num_blocks)

    if cfg.max_blocks_per_request is not None:
        max_blocks = cfg.max_blocks_per_request
    elif hinted_request_tokens(cfg) is not None:
        max_blocks = blocks_from_hint(cfg.max_prompt_length or 0, cfg.max_generated_length or 0, bs)
    else:
        max_blocks = max(blocks_for(FALLBACK_TABLE_TOKENS, bs), blocks_for(max_context, bs))

    margin = cfg.safety_margin if cfg.safety_margin is not None else DEFAULT_SAFETY_MARGINS[cfg.scheduler_type]
    notes = list(backend.notes)
    spec_warnings = []
    if spec is not None:
        notes.append(f"speculative decoding: {spec.describe()}; async batching off (each step's accepted "
                     "tokens are read before the next step is planned)")
        if cfg.use_async_batching:
            spec_warnings.append("use_async_batching=True is off with speculative decoding: a step's accepted "
                                 "tokens must be known before the next step is planned")
    windowed = sliding_window_layers(model)
    if windowed:
        notes.append(
            f"{windowed} sliding-window layers keep their full KV, so prefix sharing and the batched decode "
            "path stay exact (no memory is saved on those layers)"
        )
    compile_level, compiled, compile_notes, compile_warnings = resolve_compile(
        cfg.default_compile_level, cfg.decode_compile_config, cfg.varlen_compile_config, device.type
    )
    notes += compile_notes
    sharing = cfg.allow_block_sharing
    if recurrent:
        notes.append(RECURRENT_NOTE.format(n=recurrent))
        if any(compiled.values()):
            compile_warnings = [*compile_warnings, "compiled steps are off: the model has recurrent layers"]
        if cfg.use_cuda_graph:
            compile_warnings = [*compile_warnings, "use_cuda_graph=True is off: the model has recurrent layers"]
        compiled = {"decode": None, "varlen": None}
        sharing = False
    host_blocks, host_gib, clamped = offload_blocks(cfg, layout.bytes_per_block(bs))
    if clamped:
        notes.append(f"cpu_offload_space clamped from {cfg.cpu_offload_space} to {host_gib:.2f} GiB of available RAM")
    cpu = plan_cpu(model, knobs, prefill=backend.prefill_kernel,
                   decode_kernel=backend.name == "torch" and backend.decode_fast_path,
                   eager_paths=[path for path in ("decode", "varlen") if compiled[path] is None])
    resolved = ResolvedConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        block_size=bs,
        num_blocks=num_blocks,
        num_blocks_rule=rule,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        max_blocks_per_request=max_blocks,
        max_context=max_context,
        scheduler_type=cfg.scheduler_type,
        safety_margin=margin,
        attention_backend=backend.name,
        decode_fast_path=backend.decode_fast_path,
        max_queue_size=cfg.max_queue_size,
        kv_cache_bytes=(num_blocks + 2) * layout.bytes_per_block(bs),
        kv_populate=describe_populate(layout.bytes_per_block(bs)) if device.type == "cpu" else "",
        allow_block_sharing=sharing,
        prefix_cache_eviction=cfg.prefix_cache_eviction,
        hold_shared_prefixes=sharing and cfg.hold_shared_prefixes,
        cpu_offload_blocks=host_blocks,
        cpu_offload_gib=round(host_gib, 3),
        sliding_window_layers=windowed,
        notes=tuple(notes),
        warnings=tuple(backend.warnings + compile_warnings + spec_warnings),
        kv_layout=backend.kv_layout,
        use_cuda_graph=backend.use_cuda_graph,
        use_async_batching=backend.use_async_batching,
        q_padding_interval_size=cfg.q_padding_interval_size,
        kv_padding_interval_size=cfg.kv_padding_interval_size,
        max_cached_graphs=cfg.max_cached_graphs,
        cuda_graph_max_tokens=cfg.cuda_graph_max_tokens,
        default_compile_level=compile_level,
        decode_compile=compiled["decode"],
        varlen_compile=compiled["varlen"],
        cpu=cpu,
        quantization=summary_of(model),
        return_logprobs=cfg.return_logprobs,
        speculative=spec,
        kv_heads_per_rank=layout.num_kv_heads,
        kv_layers=layout.describe(),
        max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank,
        recurrent_mixers=recurrent,
    )
    return resolved, layout


RECURRENT_NOTE = (
    "{n} recurrent layers keep a per-request state beside the KV cache (slots assigned at a request's first token, "
    "released when it ends, kept while it waits on the host tier, rebuilt by recompute after a soft reset); "
    "prefix sharing off (a recurrent state is not kept at block boundaries, so a cached prefix could not be "
    "resumed), steps eager (no compiled forwards, no CUDA graphs: the mixers run each prompt chunk apart)"
)


def check_recurrent(cfg: ContinuousBatchingConfig, model: torch.nn.Module, spec) -> None:
    """What a model with recurrent layers cannot run, refused with the reason."""
    if spec is not None:
        raise ValueError(
            "speculative decoding cannot run on a model with recurrent layers: a rejected proposal would leave "
            "its tokens in the recurrent state, which cannot be rolled back; use speculative_config=None"
        )
    if model_tp_size(model) > 1:
        raise ValueError("tensor parallelism is not supported for models with recurrent layers (their mixers' "
                         "states are not sharded); run the model on one process")


def describe(resolved: ResolvedConfig) -> str:
    gib = resolved.kv_cache_bytes / 2**30
    return (
        f"contbatch engine: device={resolved.device} dtype={resolved.dtype} "
        f"blocks={resolved.num_blocks}x{resolved.block_size} (+2 reserved, {gib:.2f} GiB; {resolved.num_blocks_rule}) "
        f"max_batch_tokens={resolved.max_batch_tokens} max_requests_per_batch={resolved.max_requests_per_batch} "
        f"max_blocks_per_request={resolved.max_blocks_per_request} "
        f"(addresses {resolved.max_blocks_per_request * resolved.block_size} tokens) "
        f"max_context={resolved.max_context} scheduler={resolved.scheduler_type} "
        f"safety_margin={resolved.safety_margin} attention={resolved.attention_backend} "
        f"decode_fast_path={resolved.decode_fast_path} "
        + f"cuda_graphs={resolved.use_cuda_graph} "
        f"async_batching={resolved.use_async_batching} kv_layout={resolved.kv_layout} "
        + (
            f"(graphs: decode buckets powers of two, varlen q/kv intervals {resolved.q_padding_interval_size}/"
            f"{resolved.kv_padding_interval_size} up to {resolved.cuda_graph_max_tokens} tokens, "
            f"LRU of {resolved.max_cached_graphs}) "
            if resolved.use_cuda_graph
            else ""
        )
        + f"compile: level {resolved.default_compile_level}, decode "
        f"{resolved.decode_compile.describe() if resolved.decode_compile else 'eager'}, varlen "
        f"{resolved.varlen_compile.describe() if resolved.varlen_compile else 'eager'} "
        + (f"{resolved.cpu.describe(prefill=resolved.attention_backend == 'torch')} " if resolved.cpu else "")
        + (f"{resolved.quantization.describe()} " if resolved.quantization else "")
        + f"kv_layers=[{resolved.kv_layers}] "
        + (f"kv_populate={resolved.kv_populate} " if resolved.kv_populate else "")
        + f"max_queue_size={resolved.max_queue_size or 'unlimited'} "
        f"allow_block_sharing={resolved.allow_block_sharing} ({resolved.prefix_cache_eviction}"
        f"{', shared prefixes held for in-flight twins' if resolved.hold_shared_prefixes else ''}) "
        f"cpu_offload={resolved.cpu_offload_gib} GiB ({resolved.cpu_offload_blocks} blocks) "
        f"speculative={resolved.speculative.describe() if resolved.speculative else 'off'} "
        f"lora: up to {resolved.max_loras} resident adapters of rank <= {resolved.max_lora_rank}"
        + (f" tensor_parallel: rank {resolved.tp_rank} of {resolved.tp_size} ({resolved.tp_backend}), "
           f"{resolved.kv_heads_per_rank} KV heads per rank" if resolved.tp_size > 1 else "")
        + "".join(f"; note: {n}" for n in resolved.notes)
        + "".join(f"; WARNING: {w}" for w in resolved.warnings)
    )
