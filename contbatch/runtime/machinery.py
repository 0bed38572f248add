"""The parts an engine step runs on: a paged cache, an attention backend, bucketing and a
runner, built one way for the target model's engine (`EngineCore`) and for a draft model
(`speculative/draft.py`), so that the two never drift apart.

The engine's own machinery (`primary=True`) also gets what only it uses: prefix sharing,
CUDA graphs, compiled forwards and a second buffer slot for async batching. A draft model's
steps are plain: one slot, eager, nothing shared between requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionBackend
from ..attention.select import load_backend
from ..attention.recurrent import recurrent_mixers
from ..cache.paged_cache import KVLayout, PagedAttentionCache
from ..cache.recurrent_state import RecurrentStateCache
from ..config import ResolvedConfig
from ..paths import cache_dir
from .buckets import Bucketing
from .compile import allow_recompiles, compiled_forward, use_compile_cache
from .graphs import GraphCache, capture_cuda_graph
from .step_runner import StepRunner


@dataclass
class StepMachinery:
    cache: PagedAttentionCache
    backend: AttentionBackend
    bucketing: Bucketing
    runner: StepRunner


def build_machinery(model: torch.nn.Module, resolved: ResolvedConfig, layout: KVLayout, *,
                    primary: bool) -> StepMachinery:
    r = resolved
    cache = PagedAttentionCache(layout, r.num_blocks, r.block_size, r.device,
                                r.allow_block_sharing if primary else False,
                                r.prefix_cache_eviction if primary else "lru", token_major=r.kv_layout == "token-major")
    if primary and recurrent_mixers(model):
        cache.recurrent = RecurrentStateCache(r.device, r.max_requests_per_batch)
    backend = load_backend(r.attention_backend, r.decode_fast_path, r.block_size, bool(r.cpu and r.cpu.prefill))
    bucketing = Bucketing(
        r.max_requests_per_batch, r.q_padding_interval_size, r.kv_padding_interval_size,
        backend.max_varlen_tiles, backend.kv_keyed, fast_decode=backend.fast_decode,
        **({"graph_max_tokens": r.cuda_graph_max_tokens} if primary else {}),
    )
    graphs, compiled = None, None
    if primary:
        if r.use_cuda_graph:
            graphs = GraphCache(r.max_cached_graphs, capture_cuda_graph, torch.cuda.graph_pool_handle())
        routing = r.cpu.linear.routes if r.cpu and r.cpu.linear else ()
        compiled = {path: compiled_forward(model, choice, routing) if choice else None
                    for path, choice in (("decode", r.decode_compile), ("varlen", r.varlen_compile))}
        if any(compiled.values()):
            use_compile_cache(str(cache_dir() / "inductor"))
            allow_recompiles(bucketing.count(r.max_batch_tokens) + 8)
    runner = StepRunner(model, cache, backend, bucketing, r.max_batch_tokens, r.max_blocks_per_request,
                        num_slots=2 if primary and r.use_async_batching else 1, graphs=graphs, compiled=compiled)
    return StepMachinery(cache, backend, bucketing, runner)
