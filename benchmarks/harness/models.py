"""The models and texts benchmarks run on.

- `load(model, dtype)`: the embedded default model (SmolLM2-135M-Instruct) or a local folder /
  .gguf, with its tokenizer, in eval mode.
- `default_tokenizer()`: the default model's tokenizer alone (for random-weight models that
  must speak real text).
- `random_llama(...)`: a random-weight Llama built from a config (the structure a benchmark
  needs without the default model's cost: a tiny server model, a 64-unit model whose kernels
  take no time, a 2-KV-head model for tensor parallelism).
- `source_text()`: one long, fixed English text that ships with Python, to cut prompts from.
"""

from __future__ import annotations

LLAMA_DEFAULTS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def dtype_of(name: str):
    """A torch dtype by name ('float32', 'bfloat16', ...)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"unknown dtype {name!r}")
    return dtype


def load(model: str | None = None, dtype: str | object | None = None, **kwargs):
    """(model, tokenizer): `model` None or 'default' is the embedded default model."""
    import contbatch

    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    if dtype is not None:
        kwargs["dtype"] = dtype
    return contbatch.load_model(None if model in (None, "default") else model, **kwargs)


def default_tokenizer():
    import transformers

    from contbatch.setup.loading import default_model_dir

    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


def random_llama(seed: int = 0, dtype=None, tokenizer=None, **config):
    """A random-weight Llama in eval mode: `LLAMA_DEFAULTS` overridden by `config`; with a
    tokenizer, its vocabulary and special tokens (and tied embeddings unless said otherwise)."""
    import torch
    import transformers

    kwargs = dict(LLAMA_DEFAULTS)
    if tokenizer is not None:
        kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=True)
    kwargs.update(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**kwargs),
                                                          dtype=dtype or torch.float32)
    return model.eval()


def source_text() -> str:
    """One long, fixed English text that ships with Python: the pydoc topics (~465k characters)."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
