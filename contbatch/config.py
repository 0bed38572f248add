"""User-facing engine configuration, validated when built.

Most fields default to `None`, a sentinel resolved at start-up from the model, the machine
and the workload hints; `ContinuousBatchingManager.resolved_config` returns what is in force.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MIN_BLOCK_SIZE = 4
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MAX_BATCH_TOKENS = 8192
# On the CPU, big steps lose: one 8192-token forward of the default model took 1.3-2.3x as long
# as four 2048-token ones (activations far past the caches), and end to end 2048 ran
# 1.4-1.5x faster in benchmarks/offline.py. A GPU wants the larger steps.
DEFAULT_CPU_MAX_BATCH_TOKENS = 2048
MIN_MAX_BATCH_TOKENS = 256
FALLBACK_MAX_REQUESTS_PER_BATCH = 1024
DEFAULT_MAX_MEMORY_PERCENT = 0.9
SCHEDULER_TYPES = ("fifo", "prefill_first")
# "auto" picks flash-attn, else Triton on CUDA, and "torch" on the CPU (see attention/backend.py).
# "reference" runs the GPU batch layout with PyTorch attention: for testing on any device.
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash", "reference")
CPU_LINEAR_KERNELS = ("auto", "aten", "onednn", "native", "upcast")  # see engine/cpu_linear.py
DEFAULT_Q_PADDING_INTERVAL = 64
DEFAULT_KV_PADDING_INTERVAL = 256
DEFAULT_MAX_CACHED_GRAPHS = 32
# Varlen steps padded past this many tokens run eagerly: their compute hides the launch cost,
# and each of their many shapes would cost a capture (and graph-pool memory).
DEFAULT_CUDA_GRAPH_MAX_TOKENS = 1024
DEFAULT_SAFETY_MARGINS = {"fifo": 0.15, "prefill_first": 0.0}


@dataclass
class ContinuousBatchingConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    max_memory_percent: float | None = None
    # Share of available host RAM the KV cache may take when it lives on the CPU.
    max_cpu_memory_percent: float = 0.2
    # Workload hints: size the cache and block tables for the real requests.
    max_prompt_length: int | None = None
    max_generated_length: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    max_queue_size: int = 0
    # Prefix caching: share complete blocks across requests by content hash.
    allow_block_sharing: bool = True
    prefix_cache_eviction: str = "lru"  # "lru" (least recently released first) or "mru"
    # A new request whose next prompt block another request is computing right now waits a
    # step for it instead of computing it twice (a burst sharing a system prompt).
    hold_shared_prefixes: bool = True
    # CPU offload tier for KV-pressure victims, in GiB (0 disables: soft reset instead).
    cpu_offload_space: float = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    # GPU path. `None` means "on where it can run"; an explicit value that cannot be honoured
    # is logged as a warning and shows in `resolved_config` (and its notes).
    attention_backend: str = "auto"
    decode_fast_path: bool | None = None  # decode-only steps read K/V in place via block tables
    use_cuda_graph: bool | None = None
    use_async_batching: bool | None = None  # prepare step N+1 while step N computes
    q_padding_interval_size: int = DEFAULT_Q_PADDING_INTERVAL  # varlen graphs: query tokens bucket
    kv_padding_interval_size: int = DEFAULT_KV_PADDING_INTERVAL  # varlen graphs: KV length bucket
    max_cached_graphs: int = DEFAULT_MAX_CACHED_GRAPHS
    cuda_graph_max_tokens: int = DEFAULT_CUDA_GRAPH_MAX_TOKENS  # larger varlen steps run eagerly
    # torch.compile of the whole step: 0 none, 1 default + dynamic, 2 max-autotune-no-cudagraphs
    # + dynamic, 3 the same with dynamic=False. A transformers `CompileConfig` per path (decode-
    # only steps, every other step) overrides the level for that path.
    default_compile_level: int | None = None  # None: 0, by measurement (see engine/compile.py)
    decode_compile_config: object | None = None
    varlen_compile_config: object | None = None
    # CPU linear layers: "auto" times aten (MKL in float32), oneDNN, our few-row C++ kernel and (16-bit
    # weights) the float32 product on the model's weight shapes at start-up and routes each to the
    # fastest (see engine/cpu_linear.py).
    cpu_linear_kernel: str = "auto"
    # Layers routed to oneDNN keep a prepacked (blocked) copy of their weight while the manager
    # runs: 1.2-1.5x faster at decode batch sizes, bit-identical results, repacked when a weight
    # changes; only where the copies fit in a quarter of the available RAM (see engine/cpu_linear.py).
    cpu_linear_prepack: bool = True
    # CPU RMSNorm layers: "auto" runs each norm class whose own forward matches our fused C++ op
    # at start-up as one call inside engine steps (see engine/cpu_norm.py); "aten" never does.
    cpu_rms_norm_kernel: str = "auto"
    # CPU rotary embeddings: "auto" runs a modeling file's `apply_rotary_pos_emb` as one fused C++
    # call inside engine steps where it matched the original bit for bit at start-up
    # (see engine/cpu_rotary.py); "aten" never does.
    cpu_rotary_kernel: str = "auto"
    # CPU decoder layers: "auto" runs each Llama-family decoder layer (Llama, Mistral, Qwen2/3) as
    # one C++ call inside engine steps, where its norms, rotary, linears and attention already run
    # on our kernels, checked bit-identical to the layer's own forward on each kind of step's first
    # (see engine/cpu_layer.py), and from each kind of step's second the whole stack as one call
    # where the first showed the model's loop a plain chain; "layer" stops at one call per layer;
    # "aten" keeps every layer's own forward.
    cpu_layer_kernel: str = "auto"
    # CPU prefill attention (prompt chunks) on the torch backend: "auto" runs our C++ kernel, one
    # call per layer for every chunk of the step, reading K/V in place (attention/cpu_kernel.py);
    # "aten" runs SDPA one request at a time (the reference the kernel is tested against).
    cpu_prefill_kernel: str = "auto"
    # Every request returns its chosen tokens' log-probabilities (of the processed logits, as
    # `SamplingParams(logprobs=True)` does per request): RL rollouts need no re-scoring pass.
    return_logprobs: bool = False
    # Speculative decoding: a SpeculativeConfig (or a dict of its fields), e.g.
    # {"method": "ngram", "num_speculative_tokens": 4}; None: off.
    speculative_config: object | None = None

    def __post_init__(self) -> None:
        from .speculative.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        if self.block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"Block size must be at least {MIN_BLOCK_SIZE}, but got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_requests_per_batch is not None and self.max_requests_per_batch < 1:
            raise ValueError(f"max_requests_per_batch must be >= 1, got {self.max_requests_per_batch}")
        if self.max_blocks_per_request is not None and self.max_blocks_per_request < 1:
            raise ValueError(f"max_blocks_per_request must be >= 1, got {self.max_blocks_per_request}")
        for name in ("max_memory_percent", "max_cpu_memory_percent"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}")
        if self.safety_margin is not None and not 0.0 <= self.safety_margin <= 1.0:
            raise ValueError(f"Got safety_margin = {self.safety_margin} but expected a value in [0, 1]")
        for name in ("max_prompt_length", "max_generated_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prefix_cache_eviction not in ("lru", "mru"):
            raise ValueError(f"prefix_cache_eviction must be 'lru' or 'mru', got {self.prefix_cache_eviction!r}")
        if self.cpu_offload_space < 0:
            raise ValueError(f"cpu_offload_space must be >= 0 GiB, got {self.cpu_offload_space}")
        if not 0.0 < self.cpu_offload_space_safety_threshold <= 1.0:
            raise ValueError(
                f"cpu_offload_space_safety_threshold must be in (0, 1], got {self.cpu_offload_space_safety_threshold}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("q_padding_interval_size", "kv_padding_interval_size", "max_cached_graphs", "cuda_graph_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_compile_level not in (None, 0, 1, 2, 3):
            raise ValueError(f"default_compile_level must be 0, 1, 2 or 3, got {self.default_compile_level!r}")
        if self.cpu_rotary_kernel not in ("auto", "aten"):
            raise ValueError(f"cpu_rotary_kernel must be 'auto' or 'aten', got {self.cpu_rotary_kernel!r}")
        if self.cpu_prefill_kernel not in ("auto", "aten"):
            raise ValueError(f"cpu_prefill_kernel must be 'auto' or 'aten', got {self.cpu_prefill_kernel!r}")
        if self.cpu_layer_kernel not in ("auto", "layer", "aten"):
            raise ValueError(f"cpu_layer_kernel must be 'auto', 'layer' or 'aten', got {self.cpu_layer_kernel!r}")
        if self.cpu_rms_norm_kernel not in ("auto", "aten"):
            raise ValueError(f"cpu_rms_norm_kernel must be 'auto' or 'aten', got {self.cpu_rms_norm_kernel!r}")
        if self.cpu_linear_kernel not in CPU_LINEAR_KERNELS:
            raise ValueError(f"cpu_linear_kernel must be one of {CPU_LINEAR_KERNELS}, got {self.cpu_linear_kernel!r}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")


@dataclass(frozen=True)
class ResolvedConfig:
    """The values actually in force, after every sentinel is solved."""

    device: str
    dtype: str
    block_size: int
    num_blocks: int
    num_blocks_rule: str
    max_batch_tokens: int
    max_requests_per_batch: int
    max_blocks_per_request: int
    max_context: int
    scheduler_type: str
    safety_margin: float
    attention_backend: str
    decode_fast_path: bool
    max_queue_size: int
    kv_cache_bytes: int
    prefix_sharing: bool
    prefix_cache_eviction: str
    hold_shared_prefixes: bool
    cpu_offload_blocks: int
    cpu_offload_gib: float
    sliding_window_layers: int  # layers attending to a window rather than the whole sequence
    kv_layout: str = "heads-first"  # "heads-first" [H_kv, slots, D] or "token-major" [slots, H_kv, D]
    use_cuda_graph: bool = False
    use_async_batching: bool = False
    cpu_prefill_kernel: bool = False  # the torch backend's prefill chunks run our C++ kernel (else SDPA)
    q_padding_interval_size: int = DEFAULT_Q_PADDING_INTERVAL
    kv_padding_interval_size: int = DEFAULT_KV_PADDING_INTERVAL
    max_cached_graphs: int = DEFAULT_MAX_CACHED_GRAPHS
    cuda_graph_max_tokens: int = DEFAULT_CUDA_GRAPH_MAX_TOKENS  # larger varlen steps run eagerly
    compile_level: int = 0
    decode_compile: object | None = None  # CompileChoice, or None: eager
    varlen_compile: object | None = None
    cpu_linear: object | None = None  # LinearPlan: the kernel of each linear weight shape, per row regime
    cpu_rms_norm: object | None = None  # NormPlan: the RMSNorm classes run as one fused call
    cpu_rotary: object | None = None  # RotaryPlan: the modeling files whose rotary runs as one fused call
    cpu_layer: object | None = None  # LayerPlan: the decoder layers run as one C++ call in steps
    return_logprobs: bool = False
    speculative: object | None = None  # SpeculativeConfig in force, or None
    # Tensor parallelism: ranks in the group, this process's rank, the backend of the model's
    # collectives (None: one process), and the KV heads this rank's cache holds.
    tp_size: int = 1
    tp_rank: int = 0
    tp_backend: str | None = None
    kv_heads_per_rank: int = 0
    notes: tuple[str, ...] = ()  # why a requested feature is off, or reduced
    warnings: tuple[str, ...] = ()  # settings the user asked for that cannot run here

    def as_dict(self) -> dict:
        return asdict(self)
