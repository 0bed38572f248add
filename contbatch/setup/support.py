"""Which models the engine can serve, decided once, before a manager attaches.

A model the engine cannot run exactly must be refused at start with a `ValueError` that says
why and what to use instead, never fail request by request or return tokens `generate` would
not produce. Two kinds of evidence, cheapest first:

- the config and the classes: layer types the engine cannot hold (indexed or compressed
  attention; recurrent layers unless their mixers take their state through transformers'
  recurrent cache API, which `attention/recurrent.py` serves), stateful mixers of any other
  kind, cross-attention, a model class that does not route attention through transformers'
  `AttentionInterface`, a forward that numbers positions itself;
- for recurrent models, a prompt computed whole and in two pieces (`resumable.py`): the engine
  chunks prompts and resumes each recurrent layer from the state it kept;
- one probe forward of three tokens, shaped like an engine step, through a recording attention
  function: each layer must attend once, with the K/V shapes the cache will be laid out
  for, causally, with the engine's mask untouched (no bias of the model's own), and with
  the sliding window its config promises. The probe computes plain causal attention, so the
  model's forward runs as it would in a step; nothing is cached and the model is restored.

Layers may differ in KV heads and head dims, and keys in head dim from values (latent
attention): the layout reads each layer's shape from the config (`cache/layout.py`) and the
probe checks each call against its own layer's. Chunked local attention (Llama 4) carries no
chunk in its calls: `layer_checks.py` checks the config's chunk against transformers' own mask.
Attention sinks (`s_aux`, gpt-oss) run on every backend but flash-attn. Layers that reuse an
earlier layer's K/V (Gemma 3n's KV sharing) hand their attention the shared K/V of the step's
tokens: each keeps its own copy in the cache, which costs memory and stays exact.
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention.select import choose_backend
from ..attention.paged import ENGINE_MASK, is_attached
from ..attention.recurrent import attention_free as is_attention_free
from ..attention.recurrent import forward_source, is_recurrent_mixer, recurrent_mixers
from .resumable import resume_gap
from ..cache.paged_cache import KVLayout
from ..distributed.group import shard_layout
from ..config import ContinuousBatchingConfig, default_max_batch_tokens
from .layer_checks import call_shape_mismatch, chunk_mismatch, temperature_tuning_mismatch

PROBE_ATTENTION = "contbatch_probe"
PROBE_TOKENS = 3
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's kernels
INSTEAD = "use `model.generate` (plain transformers) for this model instead"

# transformers' cache layer types (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING) the engine runs,
# and what the others are, for the message.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "dummy"}
# Layer types whose recurrent state the engine keeps beside the KV cache (cache/recurrent_state.py),
# served when the model's mixers take it through transformers' recurrent cache API.
RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
LAYER_TYPE_WORDS = {
    "linear_attention": "linear-attention / state-space (recurrent) layers",
    "conv": "convolution layers with a rolling state",
    "hybrid": "hybrid layers (attention plus a recurrent state)",
    "hybrid_sliding": "hybrid layers (sliding attention plus a recurrent state)",
    "indexed_attention": "indexed (sparse top-k) attention",
    "chunked_attention": "chunked local attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed attention",
}
# Sequence mixers that carry state from token to token outside attention (by class name).
STATEFUL_MIXER = re.compile(r"Mamba|Rwkv|xLSTM|mLSTM|sLSTM|GatedDeltaNet|LinearAttention|ShortConv|Rglru|SSM\b")
NOT_A_MIXER = re.compile(r"Norm$|RMSNorm|Gated$|Model$|ForCausalLM$|PreTrainedModel$")


# Probe results of models checked before, with the model's fingerprint when probed: a model
# attached to a running manager cannot be probed again (the probe swaps its attention
# implementation) while another manager is made, and a model unchanged since its last probe is
# not probed again (a forward of the whole model: ~0.1 s of every `generate_batch` call's
# start-up on the default model, in bfloat16).
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(model: torch.nn.Module) -> tuple:
    """What the probe's verdict depends on: the config, the attention implementation, the
    weights' dtype and device, and each module's identity, class, forward and hooks: far
    cheaper than a probe's forward."""
    try:
        config = model.config.to_json_string(use_diff=False)
    except Exception:  # a config that does not serialise: never taken for unchanged, probed each time
        config = object()
    first = next(model.parameters(), None)
    return (config, model.config._attn_implementation,
            None if first is None else (first.dtype, first.device),
            tuple((id(m), type(m), type(m).forward, m.__dict__.get("forward"), len(m._forward_hooks),
                   len(m._forward_pre_hooks)) for m in model.modules()))


class UnsupportedModel(Exception):
    """One reason the engine cannot run a model; `check_model_support` words the ValueError."""


@dataclass
class AttentionCall:
    """What one attention call of the probe forward received."""

    layer_idx: int | None
    kv_heads: int
    key_dim: int
    value_dim: int
    is_causal: bool
    mask_untouched: bool
    sliding_window: int | None
    kwargs: set[str] = field(default_factory=set)


def check_model_support(model: torch.nn.Module, config: ContinuousBatchingConfig | None = None) -> None:
    """Raise `ValueError` if the engine cannot serve `model` exactly with `config` (its
    attention backend decides whether attention sinks can run)."""
    try:
        _check(model, config or ContinuousBatchingConfig())
    except UnsupportedModel as exc:
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(
            f"contbatch cannot serve model type {model_type!r} ({type(model).__name__}): {exc}; {INSTEAD}"
        ) from None


def _check(model: torch.nn.Module, config: ContinuousBatchingConfig) -> None:
    text = _text_config(model)
    recurrent = bool(recurrent_mixers(model))
    _check_config(text, recurrent)
    attention_free = recurrent and is_attention_free(model)  # e.g. Mamba: no attention, no positions
    _check_classes(model, text, attention_free)
    if not attention_free:
        _check_heads(text)
    try:
        layout = shard_layout(KVLayout.from_model_config(model.config, torch.float32), model)  # per TP rank
    except ValueError as exc:  # a layer shape the config cannot give, or heads TP cannot split
        raise UnsupportedModel(str(exc)) from None
    _check_layer_kinds(model, text, layout, config)
    if recurrent and not is_attached(model):
        why = resume_gap(model)
        if why:
            raise UnsupportedModel(why)
    if is_attached(model):  # attached to a running manager: not probed again
        calls = _probed.get(model, (None, None))[1]
        if calls is None:
            return
    else:
        key = _fingerprint(model)
        seen, calls = _probed.get(model, (None, None))
        if seen != key or calls is None:
            calls = probe_attention_calls(model, attention_free)
            _probed[model] = (key, calls)
    if calls or not recurrent:  # a model of recurrent layers only makes no attention call
        _check_calls(calls, text, layout)
    if any("s_aux" in call.kwargs for call in calls) and _backend(model, config) == "flash":
        raise UnsupportedModel(
            "it uses attention sinks (s_aux), which the flash-attn backend does not implement (use "
            "attention_backend='triton' or 'torch')"
        )


def _check_layer_kinds(model: torch.nn.Module, text, layout: KVLayout, config: ContinuousBatchingConfig) -> None:
    """Chunked local attention (layer_checks.py): the config's chunk is the one transformers
    masks with, any query temperature is exact, and the backend can chunk."""
    reason = chunk_mismatch(text, _layer_types(text), layout) or temperature_tuning_mismatch(
        text, layout, config.max_batch_tokens or default_max_batch_tokens(next(model.parameters()).device.type))
    if reason:
        raise UnsupportedModel(reason)
    if any(s.chunk for s in layout.layers) and _backend(model, config) == "flash":
        raise UnsupportedModel("it has chunked local attention layers, which flash-attn's windows cannot express "
                               "(use attention_backend='triton' or 'torch')")
    if layout.head_dim > FLASH_MAX_HEAD_DIM and _backend(model, config) == "flash":
        raise UnsupportedModel(f"a layer's K/V are {layout.head_dim} wide, more than flash-attn's largest head dim "
                               f"({FLASH_MAX_HEAD_DIM}; use attention_backend='triton' or 'torch')")


def _backend(model: torch.nn.Module, config: ContinuousBatchingConfig) -> str:
    """The attention backend the manager will resolve to (the same choice, made the same way)."""
    device = next(model.parameters()).device
    return choose_backend(config.attention_backend, device.type, config.block_size, False, False, False).name


def _text_config(model: torch.nn.Module):
    try:
        return model.config.get_text_config(decoder=True)
    except Exception as exc:  # e.g. several candidate text configs
        raise UnsupportedModel(f"its text decoder config cannot be found ({exc})") from None


def _check_config(text, recurrent: bool = False) -> None:
    """`recurrent`: the model's recurrent mixers take their state through transformers'
    recurrent cache API, so the engine runs its recurrent layer types beside the KV cache."""
    if getattr(text, "add_cross_attention", False):
        raise UnsupportedModel("it has cross-attention layers (config.add_cross_attention), which need encoder states")
    layer_types = _layer_types(text)
    supported = SUPPORTED_LAYER_TYPES | (RECURRENT_LAYER_TYPES if recurrent else set())
    unsupported = [t for t in dict.fromkeys(layer_types) if t not in supported]
    if unsupported:
        words = ", ".join(f"{LAYER_TYPE_WORDS.get(t, 'an unknown layer kind')} ({t!r})" for t in unsupported)
        raise UnsupportedModel(f"it has {words} in config.layer_types, which the paged KV cache cannot hold")
    modes = list(getattr(text, "kv_sharing_modes", None) or [])
    if "reuse" in modes and "store" not in modes:
        raise UnsupportedModel("its layers attend to K/V computed by another model (config.kv_sharing_modes: an "
                               "assistant of a target model), which the engine does not run")


def _check_heads(text) -> None:
    """Per-layer shapes (a heterogeneous config, latent attention) are the layout's to read
    (cache/layout.py); here only: the model has attention heads at all."""
    try:
        heads = text.num_attention_heads
    except Exception:  # no global value (a recurrent or non-standard config)
        heads = None
    if not heads:
        raise UnsupportedModel("its text config names no attention heads (a recurrent or non-standard model)")


def _layer_types(text) -> list[str]:
    """Layer types as transformers' caches see them (inferred when the config has none)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        return list(get_layer_types_and_kwargs(text)[0])
    except Exception:
        return list(getattr(text, "layer_types", None) or [])


def _check_classes(model: torch.nn.Module, text, attention_free: bool = False) -> None:
    from transformers import PreTrainedModel

    served = [name for name, m in model.named_modules() if is_recurrent_mixer(m)]
    mixers = sorted({type(m).__name__ for name, m in model.named_modules()
                     if STATEFUL_MIXER.search(type(m).__name__) and not isinstance(m, PreTrainedModel)
                     and not NOT_A_MIXER.search(type(m).__name__) and not _attends(m)
                     and not any(_related(name, other) for other in served)})
    if mixers:
        raise UnsupportedModel(f"it has recurrent / state-space sequence mixers ({', '.join(mixers[:3])})")
    if not attention_free and not _takes_custom_attention(model):
        raise UnsupportedModel(
            "its attention does not go through transformers' AttentionInterface, so no custom attention "
            "implementation (paged attention) can be set"
        )
    if not attention_free and not _takes(model, "position_ids"):
        raise UnsupportedModel(
            "its forward takes no position_ids: it numbers positions itself, which a step that packs several "
            "requests into one row cannot honour"
        )


def _attends(module: torch.nn.Module) -> bool:
    """An attention layer (it calls transformers' attention functions), whatever its name."""
    source = forward_source(type(module))
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _related(a: str, b: str) -> bool:
    """One module name is the other or inside it (a mixer's own norm, or the block around it)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _takes_custom_attention(model: torch.nn.Module) -> bool:
    """The model, or for a composite model its text decoder, routes attention through the
    AttentionInterface (transformers reads each modeling file's source to tell)."""
    if type(model)._can_set_attn_implementation():
        return True
    try:
        decoder = model.get_decoder()
    except Exception:
        return False
    return decoder is not model and hasattr(type(decoder), "_can_set_attn_implementation") and \
        type(decoder)._can_set_attn_implementation()


def _takes(model: torch.nn.Module, name: str) -> bool:
    """`name` reaches the model: a parameter of its forward, or passed on through `**kwargs` to a
    decoder whose forward names it."""
    params = inspect.signature(model.forward).parameters
    if name in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    try:
        decoder = model.get_decoder()
    except Exception:
        return False
    return isinstance(decoder, torch.nn.Module) and name in inspect.signature(decoder.forward).parameters


def _check_calls(calls: list[AttentionCall], text, layout: KVLayout) -> None:
    if not calls:
        raise UnsupportedModel("its layers never call the attention function")
    seen: dict[int, int] = {}
    for call in calls:
        idx = call.layer_idx
        if idx is None or not 0 <= idx < layout.num_layers // layout.calls_per_layer:
            raise UnsupportedModel(f"an attention layer has no usable layer_idx ({idx!r})")
        seen[idx] = seen.get(idx, 0) + 1
        if seen[idx] > layout.calls_per_layer:
            raise UnsupportedModel(
                f"layer {idx} calls attention {seen[idx]} times per forward (a recurrent or looped model), and each "
                "call would overwrite the layer's cached K/V"
            )
        mismatch = call_shape_mismatch(idx, idx * layout.calls_per_layer + seen[idx] - 1, call.kv_heads,
                                       call.key_dim, call.value_dim, layout)
        if mismatch:
            raise UnsupportedModel(mismatch)
        if not call.is_causal:
            raise UnsupportedModel(
                "its self-attention is bidirectional (is_causal=False; for BERT-like models set "
                "config.is_decoder=True to make them causal decoders)"
            )
        if not call.mask_untouched:
            raise UnsupportedModel(
                "it computes its own attention mask or bias inside the layer (e.g. a dynamic mask), which paged "
                "attention does not apply"
            )
    layer_types = _layer_types(text)
    for call in calls:
        if call.layer_idx < len(layer_types) and layer_types[call.layer_idx] == "sliding_attention":
            if call.sliding_window is None:
                raise UnsupportedModel(
                    f"layer {call.layer_idx} is a sliding-window layer in its config, but its attention call "
                    "carries no sliding_window (the model applies the window through its own mask)"
                )


def probe_attention_calls(model: torch.nn.Module, attention_free: bool = False) -> list[AttentionCall]:
    """One forward of `PROBE_TOKENS` tokens, shaped like an engine step, through a recording
    attention function; the model's attention implementation is restored afterwards. An
    attention-free model (`attention_free`) keeps its own: the forward checks the rest."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls: list[AttentionCall] = []

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
        calls.append(AttentionCall(
            layer_idx=getattr(module, "layer_idx", None), kv_heads=key.shape[1], key_dim=key.shape[-1],
            value_dim=value.shape[-1], is_causal=getattr(module, "is_causal", True) is not False,
            mask_untouched=attention_mask is None or attention_mask is ENGINE_MASK, sliding_window=sliding_window,
            kwargs={k for k, v in kwargs.items() if v is not None},
        ))
        groups = max(1, query.shape[1] // key.shape[1])
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        causal = query.shape[2] == k.shape[2]
        out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype), is_causal=causal,
                                             scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(PROBE_ATTENTION, record)
    AttentionMaskInterface.register(PROBE_ATTENTION, sdpa_mask)
    original = model.config._attn_implementation
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % max(1, vocab - 3) + 3
    try:
        if not attention_free:
            model.set_attn_implementation(PROBE_ATTENTION)
        with torch.inference_mode():
            out = model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=device)[None],
                        attention_mask=None if attention_free else ENGINE_MASK, logits_to_keep=torch.tensor([PROBE_TOKENS - 1], device=device),
                        use_cache=False, step_metadata=None)  # the engine's call, without a step
    except UnsupportedModel:
        raise
    except Exception as exc:
        raise UnsupportedModel(f"a probe forward shaped like an engine step failed ({type(exc).__name__}: "
                               f"{str(exc)[:200]})") from None
    finally:
        if not attention_free:
            model.set_attn_implementation(original)
    logits = getattr(out, "logits", None)
    if logits is None or logits.shape[-2] != 1:
        raise UnsupportedModel("its forward does not honour logits_to_keep (the engine samples selected rows only)")
    return calls

