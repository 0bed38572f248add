"""Tiny random-weight models of every causal-LM architecture of the pinned transformers.

Each architecture's default config, shrunk to the same generic sizes (hidden 64, 2 layers, 4
heads, 2 KV heads, head dim 16, vocab 512, 4 experts of which 2 are active, windows of 8
tokens), with two changes of kind that keep what matters for serving:
- every layer kind of the default `layer_types` is kept (a hybrid keeps its attention and its
  recurrent layers; sliding and full attention both appear), so a refusal is tested on the
  layer kind that causes it and the reference `generate` still has attention layers to run;
- `is_decoder=True`, which the BERT-family causal-LM heads need to be causal decoders at all
  (transformers warns without it); the engine refuses the bidirectional default.
Latent-attention (MLA) configs keep every head a KV head and their rotary head dim, as the
architecture has it. Weights use initializer_range 0.2 (as tests/conftest.py does): greedy
argmax then has real margins, so float32 rounding differences between kernels cannot flip a
token. The generation config has no EOS: every request runs its full length.

A few default configs cannot be built by transformers itself, or not at these sizes; the
`FIXES` below repair them (each says why). What still cannot be built raises `Unbuildable`
with the reason. Used by `model_coverage.py` and `tests/test_model_coverage.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

GENERIC: list[tuple[tuple[str, ...], object]] = [  # names configs use (aliases resolve via attribute_map)
    (("hidden_size", "d_model", "n_embd", "embed_dim"), 64),
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers"), 2),
    (("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads"), 4),
    (("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff"), 128),
    (("vocab_size",), 512),
    (("max_position_embeddings", "n_positions", "max_target_positions", "max_source_positions"), 256),
    (("initializer_range", "init_std"), 0.2),
    (("head_dim",), 16),
    (("is_decoder",), True),
    (("bos_token_id", "decoder_start_token_id"), 1),
    (("eos_token_id",), 2),
    (("pad_token_id",), 0),
]
# Only where the default sets them: a None here means "this model does not have one".
WHERE_SET = {
    "num_key_value_heads": 2, "sliding_window": 8, "attention_chunk_size": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "mamba_chunk_size": 16,  # the scan's chunk: short prompts are padded to it
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
}
# Repairs, per architecture: defaults transformers cannot build (or not at these sizes).
FIXES: dict[str, dict] = {
    "blt": {"encoder_hash_byte_group_vocab": 1002},  # the default builds six 500k-row hash tables
    "codegen": {"rotary_dim": 8},  # partial rotary: the default 64 is wider than a 16-dim head
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "mamba2": {"num_heads": 8, "chunk_size": 16},  # hidden * expand == num_heads * head_dim
    "nemotron_h": {"chunk_size": 16},
    "zaya": {"num_experts_per_tok": 1},  # the only value it supports
    "xmod": {"default_language": "en_XX"},
    "hunyuan_v1_dense": {"head_dim": 16},  # the default has none and the layers need one
    "hunyuan_v1_moe": {"head_dim": 16},
    "ministral": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Hybrids whose default places no attention layer among two: one of each, as their models have.
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "dots3_note_text": {"num_key_value_heads": 4},  # validated equal to the query heads
    "dots3_note": {"num_key_value_heads": 4},
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},  # must sum to hidden, fill positions
    # Hybrids whose shared transformer block must appear twice (its weights are tied across uses).
    "zamba": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2},
    "zamba2": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2, "chunk_size": 16},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gemma3n_text": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.0] * 4},
}
SUB_FIXES: dict[str, dict[str, dict]] = {
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
}


class Unbuildable(Exception):
    """This architecture cannot be built as a tiny model; the message says why."""


def _fields(cls) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set()


def _default_value(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # per-layer attributes of heterogeneous configs refuse a global read
        return "per-layer"


def _overrides(cls, default) -> dict:
    """Generic sizes for one config class (and, recursively, its sub-configs)."""
    names, alias = _fields(cls), getattr(cls, "attribute_map", {}) or {}
    out: dict = {}

    def put(name: str, value) -> None:
        target = alias.get(name, name)
        if target in names and target not in out:
            out[target] = value

    for keys, value in GENERIC:
        for key in keys:
            put(key, value)
    for key, value in WHERE_SET.items():
        current = _default_value(default, alias.get(key, key))
        if current is not None and current is not False and not (key == "sliding_window" and current == 0):
            put(key, value)
    if "kv_lora_rank" in out:  # latent attention: every head is a KV head; head_dim names the rotary part
        kv_heads = alias.get("num_key_value_heads", "num_key_value_heads")
        if kv_heads in names:
            out[kv_heads] = 4
        if "head_dim" in out:
            out["head_dim"] = WHERE_SET["qk_rope_head_dim"]
    for name in getattr(cls, "sub_configs", {}) or {}:
        sub = _default_value(default, name)
        if sub is not None and hasattr(sub, "to_dict") and sub is not default:
            out[name] = _overrides(type(sub), sub)
    return out


def _text_path(default) -> str | None:
    """Which sub-config holds the text decoder (None: the config itself)."""
    try:
        text = default.get_text_config(decoder=True)
    except Exception:
        return None
    for name in getattr(type(default), "sub_configs", {}) or {}:
        if _default_value(default, name) is text:
            return name
    return None


def _layer_kinds(kwargs: dict, text_default) -> None:
    """Keep every layer kind of the default `layer_types`, in order of first appearance."""
    types = _default_value(text_default, "layer_types")
    if "layer_types" not in _fields(type(text_default)):  # derived from other fields: left to the config
        return
    if not isinstance(types, (list, tuple)) or not types or "layer_types" in kwargs:
        return
    kinds = list(dict.fromkeys(types))
    layers = max(2, len(kinds))
    kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in kwargs:
            kwargs[key] = layers


def tiny_config(arch: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    default = cls()
    kwargs = _overrides(cls, default)
    path = _text_path(default)
    text_kwargs = kwargs.setdefault(path, {}) if path else kwargs
    text_default = _default_value(default, path) if path else default
    _layer_kinds(text_kwargs, text_default)
    text_kwargs.update(FIXES.get(arch, {}))
    for name, fix in SUB_FIXES.get(arch, {}).items():
        kwargs.setdefault(name, {}).update(fix)
    try:
        return cls(**kwargs)
    except Exception:  # layer_types derived from other fields (a read-only property): the config's own
        if "layer_types" in FIXES.get(arch, {}) or text_kwargs.pop("layer_types", None) is None:
            raise
        return cls(**kwargs)


def build_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny float32 model of `arch`, in eval mode, with a plain generation config (no
    processors: the comparison is of the model's forward, not of sampling defaults)."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING, GenerationConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(arch)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as exc:
            try:
                with torch.device("meta"):
                    AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch]())
            except Exception as default_exc:
                raise Unbuildable(f"transformers cannot build it from its default config ({_why(default_exc)})") from None
            raise Unbuildable(f"no tiny config of it builds ({_why(exc)})") from None
    model.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0)  # no EOS: every request runs to the end
    return model.eval()


def _why(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:200]}"


def causal_lm_architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
