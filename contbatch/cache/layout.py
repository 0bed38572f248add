"""What each cache layer holds: the KV layout, resolved once from the model's config.

A cache layer is one attention call of one model layer per forward. Each has its own shape
(`LayerKV`): how many KV heads, the head dim of its keys and of its values, and what its
attention does besides: the chunk its queries attend within (chunked local attention), the
position temperature of its queries (Llama 4's no-rope layers). Layers differ where the model says so:
- multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...: `config.kv_lora_rank`): the
  attention function receives K/V already decompressed from the latent, one KV head per query
  head, keys of `qk_nope_head_dim + qk_rope_head_dim` and values of `v_head_dim`;
- per-layer configs (`config.is_heterogeneous`, Gemma 4): each layer's own heads and head dim;
- models that widen their sliding-window layers (`SLIDING_KV_HEADS_FACTOR`: MiMo-V2-Flash);
- layers that hold no KV at all (`NO_KV_LAYER_TYPES`: a hybrid's recurrent layers): zero
  heads, which allocate nothing and cost nothing per block.

The cache stores keys and values of a layer at one width, `LayerKV.width` (the larger dim):
the attention function pads the narrower of the two with zeros (`attention/paged.py`), which
leaves `softmax(q k^T) v` unchanged (zero key columns add nothing to a score, zero value
columns are sliced off the output), so every backend and kernel sees equal head dims. That
costs the padded columns' memory (`bytes_per_block` counts them) and keeps every path exact.
The start-up probe (`setup/support.py`) checks every layer's recorded K/V against this layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

# Models whose attention function receives K/V already repeated to every query head, so the
# cache holds as many KV heads as query heads (JetMoE's mixture of attention heads repeats
# its K/V once per active expert).
KV_HEADS_ARE_QUERY_HEADS = {"jetmoe"}
# Models whose layers call attention more than once per forward, on the same keys and different
# values (DiffLlama's differential attention: two softmaxes, one per half of V): each call
# keeps its own K/V in the cache, as one more cache layer.
ATTENTION_CALLS_PER_LAYER = {"diffllama": 2}
# Models whose sliding-window layers have this many times the config's KV heads.
SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}
# transformers' layer types whose layers keep no K/V (a recurrent state instead, held elsewhere).
NO_KV_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "moe_mamba"})
CHUNKED_LAYER_TYPE = "chunked_attention"


@dataclass(frozen=True)
class LayerKV:
    """One cache layer: `kv_heads` heads of keys (`key_dim`) and values (`value_dim`), stored at
    `width`; `chunk`: queries see only keys of their own aligned chunk of that many positions
    (None: no chunking); `temperature`: (floor_scale, attn_scale) of a layer whose queries are
    scaled by their position (Llama 4's no-rope layers, `attention/temperature.py`), else None.
    Zero heads: the layer holds no KV."""

    kv_heads: int
    key_dim: int
    value_dim: int
    chunk: int | None = None
    temperature: tuple[int, float] | None = None

    def __post_init__(self) -> None:
        if self.kv_heads < 0 or self.key_dim < 1 or self.value_dim < 1:
            raise ValueError(f"a cache layer needs kv_heads >= 0 and head dims >= 1, got {self}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"an attention chunk must be at least 1 position, got {self.chunk}")

    @property
    def width(self) -> int:
        return max(self.key_dim, self.value_dim)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the model's KV: what one block costs. `num_layers` counts cache layers: the
    model's layers times `calls_per_layer` (attention calls of each layer per forward).
    `layers` gives each cache layer its shape; left empty, every layer is `num_kv_heads` heads
    of `head_dim`. `num_kv_heads` and `head_dim` are then the largest of any layer (what the
    resolved config reports)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    calls_per_layer: int = 1
    layers: tuple[LayerKV, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", (LayerKV(self.num_kv_heads, self.head_dim, self.head_dim),)
                               * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise ValueError(f"a layout of {self.num_layers} cache layers was given {len(self.layers)} layer shapes")

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    @functools.cached_property
    def uniform(self) -> bool:
        """Every layer the same shape, no chunking: what fused multi-layer kernels need."""
        return len(set(self.layers)) == 1 and self.layers[0].chunk is None

    def describe(self) -> str:
        """Each run of alike cache layers: which layers, heads, key/value dims, any chunk."""
        runs: list[tuple[int, int, LayerKV]] = []
        for i, s in enumerate(self.layers):
            if runs and runs[-1][2] == s and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i, s)
            else:
                runs.append((i, i, s))
        parts = []
        for lo, hi, s in runs:
            what = (f"{s.kv_heads} KV heads of {s.key_dim}" if s.key_dim == s.value_dim else
                    f"{s.kv_heads} KV heads, keys {s.key_dim} / values {s.value_dim} stored at {s.width}")
            what = "no KV" if not s.kv_heads else what + (f", chunks of {s.chunk}" if s.chunk else "") + (
                f", queries tempered by position (floor_scale {s.temperature[0]})" if s.temperature else "")
            parts.append(f"{lo if lo == hi else f'{lo}-{hi}'}: {what}")
        return "; ".join(parts)

    def bytes_per_block(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * sum(s.kv_heads * s.width for s in self.layers) * block_size * itemsize

    def shard(self, tp: int) -> "KVLayout":
        """The layout one of `tp` tensor-parallel ranks holds: its share of every layer's heads."""
        if tp == 1:
            return self
        odd = sorted({s.kv_heads for s in self.layers if s.kv_heads % tp})
        if odd:
            raise ValueError(f"tensor parallelism of {tp} cannot split layers of {odd} KV heads evenly")
        layers = tuple(replace(s, kv_heads=s.kv_heads // tp) for s in self.layers)
        return replace(self, num_kv_heads=self.num_kv_heads // tp, layers=layers)

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> "KVLayout":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        calls = ATTENTION_CALLS_PER_LAYER.get(getattr(text, "model_type", None), 1)
        shapes = [s for s in layer_shapes(text) for _ in range(calls)]
        return cls(len(shapes), max(s.kv_heads for s in shapes), max(s.width for s in shapes), dtype, calls,
                   tuple(shapes))


def layer_shapes(text) -> list[LayerKV]:
    """Each model layer's KV shape from its text config (module docstring)."""
    model_type = getattr(text, "model_type", None)
    layer_types = list(_attr(text, "layer_types") or [])
    chunk = _attr(text, "attention_chunk_size")
    shapes = []
    for i in range(text.num_hidden_layers):
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        if kind in NO_KV_LAYER_TYPES:
            if not getattr(text, "num_attention_heads", None):  # an attention-free model (Mamba)
                shapes.append(LayerKV(0, 1, 1))
                continue
            base = _uniform_shape(text, model_type)
            shapes.append(LayerKV(0, base.key_dim, base.value_dim))
            continue
        if getattr(text, "is_heterogeneous", False):
            own = text.per_layer_config[i]
            heads = own.num_key_value_heads or own.num_attention_heads
            shape = LayerKV(heads, own.head_dim, getattr(own, "v_head_dim", None) or own.head_dim)
        else:
            shape = _uniform_shape(text, model_type)
        if kind == "sliding_attention" and model_type in SLIDING_KV_HEADS_FACTOR:
            shape = replace(shape, kv_heads=shape.kv_heads * SLIDING_KV_HEADS_FACTOR[model_type])
        if kind == CHUNKED_LAYER_TYPE:
            if not chunk:
                raise ValueError(f"layer {i} is a chunked-attention layer, but the config sets no attention_chunk_size")
            shape = replace(shape, chunk=int(chunk))
        if _attr(text, "attn_temperature_tuning") and not _rope_layer(text, i):
            shape = replace(shape, temperature=(int(text.floor_scale), float(text.attn_scale)))
        shapes.append(shape)
    return shapes


def _uniform_shape(text, model_type: str | None) -> LayerKV:
    heads = text.num_attention_heads
    if getattr(text, "kv_lora_rank", None):  # latent attention: decompressed per query head
        key_dim = _attr(text, "qk_head_dim") or text.qk_nope_head_dim + text.qk_rope_head_dim
        return LayerKV(heads, key_dim, _attr(text, "v_head_dim") or key_dim)
    kv_heads = _attr(text, "num_key_value_heads") or heads
    if model_type in KV_HEADS_ARE_QUERY_HEADS:
        kv_heads = heads
    head_dim = _attr(text, "head_dim") or text.hidden_size // heads
    return LayerKV(kv_heads, head_dim, _attr(text, "v_head_dim") or head_dim)


def _rope_layer(text, i: int) -> bool:
    """Llama 4's `no_rope_layers[i]`: truthy where the layer applies rotary embeddings."""
    flags = _attr(text, "no_rope_layers")
    return True if flags is None or i >= len(flags) else bool(flags[i])


def _attr(text, name: str):
    """A config attribute, None where the config has none (or only per layer)."""
    try:
        return getattr(text, name, None)
    except Exception:  # heterogeneous configs refuse global access to per-layer attributes
        return None
