"""User-facing engine configuration, validated when built.

Most fields default to `None`, a sentinel resolved at start-up from the model, the machine
and the workload hints; `ContinuousBatchingManager.resolved_config` returns what is in force.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .cpu import knobs

if TYPE_CHECKING:
    from .cpu.plan import CpuPlan

MIN_BLOCK_SIZE = 4
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MAX_BATCH_TOKENS = 8192
# On the CPU, big steps lose: an 8192-token forward is slower than four 2048-token ones
# (activations far past the caches), end to end too; and at 512 a burst of prompts reaches its
# first tokens sooner than at 2048 (a prompt's first token waits for fewer others' prompt
# tokens) at the same throughput (docs/cpu.md). A GPU wants the larger steps.
DEFAULT_CPU_MAX_BATCH_TOKENS = 512


def default_max_batch_tokens(device_type: str) -> int:
    """A step's token budget where `max_batch_tokens` is unset, for a model on that device type."""
    return DEFAULT_CPU_MAX_BATCH_TOKENS if device_type == "cpu" else DEFAULT_MAX_BATCH_TOKENS


FALLBACK_MAX_REQUESTS_PER_BATCH = 1024
DEFAULT_MAX_MEMORY_PERCENT = 0.9  # of a GPU's free memory, for the KV cache
DEFAULT_CPU_MAX_MEMORY_PERCENT = 0.2  # of the available RAM, on the CPU (shared with weights and activations)
SCHEDULER_TYPES = ("fifo", "prefill_first")
# "auto" picks flash-attn, else Triton on CUDA, and "torch" on the CPU (see attention/select.py).
# "reference" runs the GPU batch layout with PyTorch attention: for testing on any device.
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash", "reference")
DEFAULT_Q_PADDING_INTERVAL = 64
DEFAULT_KV_PADDING_INTERVAL = 256
DEFAULT_MAX_CACHED_GRAPHS = 32
# Varlen steps padded past this many tokens run eagerly: their compute hides the launch cost,
# and each of their many shapes would cost a capture (and graph-pool memory).
DEFAULT_CUDA_GRAPH_MAX_TOKENS = 1024
DEFAULT_SAFETY_MARGINS = {"fifo": 0.15, "prefill_first": 0.0}


def _accepts_deprecated_fields(cls: type) -> type:
    """Fields of earlier versions accepted as keywords for one release, with a warning: the CPU
    kernel fields (`cpu.knobs.DEPRECATED_FIELDS`), each mapped into `cpu_kernel_overrides`, and
    `max_cpu_memory_percent`, into `max_memory_percent`."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        if "max_cpu_memory_percent" in kwargs:  # merged into max_memory_percent, which now applies on the CPU too
            warnings.warn("ContinuousBatchingConfig(max_cpu_memory_percent=...) is deprecated and will be "
                          "removed in the next release: use max_memory_percent, the share of the memory of the "
                          "device the cache lives on", DeprecationWarning, stacklevel=2)
            value = kwargs.pop("max_cpu_memory_percent")
            if kwargs.get("max_memory_percent") is None:
                kwargs["max_memory_percent"] = value
        old = {name: kwargs.pop(name) for name in list(kwargs) if name in knobs.DEPRECATED_FIELDS}
        if old:
            kwargs["cpu_kernel_overrides"] = knobs.merge_deprecated(kwargs.get("cpu_kernel_overrides"), old)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_accepts_deprecated_fields
@dataclass
class ContinuousBatchingConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    # Share of the memory of the device the KV cache lives on that it may take (None: 0.9 of a
    # GPU's free memory; 0.2 of the available RAM on the CPU).
    max_memory_percent: float | None = None
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
    default_compile_level: int | None = None  # None: 0, by measurement (see runtime/compile.py)
    decode_compile_config: object | None = None
    varlen_compile_config: object | None = None
    # Our CPU kernels (cpu/, docs/cpu.md): "auto" runs each where it was measured faster, or
    # checked equal to the module it replaces, at start-up; "off" keeps PyTorch's own ops.
    cpu_kernels: str = "auto"
    # Per-kernel choices on top of `cpu_kernels`, for A/B work: keys "linear", "linear_prepack",
    # "norm", "rotary", "layer", "prefill" (cpu/knobs.py lists the values each takes).
    cpu_kernel_overrides: dict | None = None
    # Every request returns its chosen tokens' log-probabilities (of the processed logits, as
    # `SamplingParams(logprobs=True)` does per request): RL rollouts need no re-scoring pass.
    return_logprobs: bool = False
    # Speculative decoding: a SpeculativeConfig (or a dict of its fields), e.g.
    # {"method": "ngram", "num_speculative_tokens": 4}; None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # LoRA adapters (docs/lora.md): at most `max_loras` resident at once, each of rank at most
    # `max_lora_rank`; more may be loaded, parked in CPU memory and swapped in least recently used first.
    max_loras: int = 4
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
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
        if self.max_memory_percent is not None and not 0.0 < self.max_memory_percent <= 1.0:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}")
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
        self.cpu_kernel_overrides = knobs.check(self.cpu_kernels, self.cpu_kernel_overrides)
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


# -- speculative decoding: what to propose with (vLLM's `speculative_config` names) ------------
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # proposals per request per step (k)
    # n-gram prompt lookup: match the last n tokens (longest n first) against the request's
    # own prompt and output, and propose what followed the most recent match.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: a smaller causal LM with the target's tokenizer (a path, a hub id, or a
    # loaded module), run greedily with its own paged cache.
    model: object | None = None
    # Adaptive: a request whose recent acceptance rate (an exponential average over its
    # verification steps) falls below this stops proposing for a while, then tries again
    # (the pause doubles each time, up to `max_pause_steps`). 0 never pauses.
    min_acceptance_rate: float = 0.3
    max_pause_steps: int = 256
    # Proposals are handed out (oldest request first) only while the step's decoding requests
    # plus the tokens proposed so far stay within this many rows. Up to about that many rows a
    # step costs what one row costs (it reads every weight once); past it, rows cost compute,
    # and a rejected proposal costs more than it saves. None: 24 on the CPU (measured on the
    # default model, `benchmarks/speculative.py`), 256 on a GPU.
    max_step_rows: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative method 'draft_model' needs `model` (a path, hub id or loaded model)")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
        if self.max_step_rows is not None and self.max_step_rows < 2:
            raise ValueError(f"max_step_rows must be >= 2, got {self.max_step_rows}")
        if self.max_pause_steps < 1:
            raise ValueError(f"max_pause_steps must be >= 1, got {self.max_pause_steps}")

    @classmethod
    def coerce(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")

    def describe(self) -> str:
        what = (f"n-gram lookup (n {self.prompt_lookup_min}..{self.prompt_lookup_max})" if self.method == "ngram"
                else f"draft model {getattr(self.model, 'name_or_path', None) or self.model!r}")
        return (f"{what}, k={self.num_speculative_tokens}, pause below {self.min_acceptance_rate:.0%} acceptance, "
                f"proposals while a step has <= {self.max_step_rows} rows")


# -- what `torch.compile` runs a step path with ----------------------------------------------
@dataclass(frozen=True)
class CompileChoice:
    mode: str
    dynamic: bool | None
    backend: str = "inductor"
    fullgraph: bool = True
    options: dict = field(default_factory=dict)

    def describe(self) -> str:
        extra = f" options={self.options}" if self.options else ""
        return f"{self.backend}/{self.mode} dynamic={self.dynamic}{extra}"

    def kwargs(self) -> dict:
        kw = {"mode": self.mode, "dynamic": self.dynamic, "backend": self.backend, "fullgraph": self.fullgraph}
        if self.options:  # torch.compile takes either a mode or options, not both
            kw.pop("mode")
            kw["options"] = dict(self.options)
        return kw


@dataclass(frozen=True)
class QuantSummary:
    """What runs quantized (setup/quantize.py and setup/gguf_quant.py fill it in): plain JSON in
    `resolved_config.as_dict()`."""

    method: str  # "int8", "int4-g32", ... or "gguf"
    quantized_layers: int
    formats: tuple[tuple[str, int], ...]  # (format, layers), e.g. ("Q4_1", 210)
    float_layers: tuple[tuple[str, int], ...]  # (why left float, layers)
    packed_bytes: int  # resident bytes of the quantized layers' codes, scales and mins
    float32_bytes: int  # what the same weights take in float32
    embedding: str | None = None  # the packed embedding's format ("Q8_0", "int8, shared with the tied head")
    resident_bytes: int = 0  # every parameter and buffer of the model, each storage counted once
    tiled_layers: int = 0  # quantized layers in 16-output tiles, run by the integer (AVX-512 VNNI) kernels
    integer_kernels: bool = False  # whether the C++ library has those kernels here

    def describe(self) -> str:
        formats = ", ".join(f"{n} {f}" for f, n in self.formats) or "none"
        left = "".join(f"; {n} left float ({why})" for why, n in self.float_layers)
        embedding = f"packed ({self.embedding})" if self.embedding else "float"
        kernels = (f"{self.tiled_layers} in 16-output tiles for the integer kernels" if self.integer_kernels
                   else "no integer kernels here (AVX-512 VNNI): float kernels")
        return (f"quantization={self.method}: {self.quantized_layers} linear layers quantized ({formats}; {kernels}), "
                f"{self.packed_bytes / 2**20:.1f} MiB packed (float32: {self.float32_bytes / 2**20:.1f} MiB), "
                f"embedding {embedding}, weights resident {self.resident_bytes / 2**20:.1f} MiB{left}")


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
    allow_block_sharing: bool  # prefix caching in force
    prefix_cache_eviction: str
    hold_shared_prefixes: bool
    cpu_offload_blocks: int
    cpu_offload_gib: float
    sliding_window_layers: int  # layers attending to a window rather than the whole sequence
    kv_layout: str = "heads-first"  # "heads-first" [H_kv, slots, D] or "token-major" [slots, H_kv, D]
    use_cuda_graph: bool = False
    use_async_batching: bool = False
    q_padding_interval_size: int = DEFAULT_Q_PADDING_INTERVAL
    kv_padding_interval_size: int = DEFAULT_KV_PADDING_INTERVAL
    max_cached_graphs: int = DEFAULT_MAX_CACHED_GRAPHS
    cuda_graph_max_tokens: int = DEFAULT_CUDA_GRAPH_MAX_TOKENS  # larger varlen steps run eagerly
    default_compile_level: int = 0
    decode_compile: CompileChoice | None = None  # None: eager
    varlen_compile: CompileChoice | None = None
    cpu: CpuPlan | None = None  # the CPU kernels in force: linear, norm, rotary, layer and prefill choices
    quantization: QuantSummary | None = None  # quantized linear layers, or None: float
    return_logprobs: bool = False
    speculative: SpeculativeConfig | None = None  # in force, or None
    max_loras: int = 4  # LoRA adapters resident at once (docs/lora.md)
    max_lora_rank: int = 64
    recurrent_mixers: int = 0  # recurrent layers whose per-request state lives beside the KV cache
    kv_layers: str = ""  # each cache layer's KV shape, runs of alike layers (cache/layout.py's KVLayout.describe)
    kv_populate: str = ""  # CPU: how fresh cache memory is made resident (cache/resident.py); "" elsewhere
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
