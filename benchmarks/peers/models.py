"""The model folders every system of the peer benchmarks loads, and their GGUF files.

Every system reads the same weights: a safetensors HF folder per model (vLLM and contbatch load
it, transformers' rows too), converted to GGUF for llama.cpp by llama.cpp's own
`convert_hf_to_gguf.py` (F32, F16, BF16, Q8_0) and `llama-quantize` (Q4_0, from the F32 file).

- `smollm2-135m`: the default model exactly as contbatch loads it: the embedded GGUF is Q4_1,
  contbatch dequantizes it once into a float32 safetensors folder (`default_model_dir()`); that
  folder's files are copied (its cache manifest left out).
- `qwen2.5-0.5b-shape`: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
  intermediate 4864, vocab 151936, tied embeddings, rope theta 1e6) with seeded random weights,
  and the default model's tokenizer (49152 ids; no model hub). Its class is Llama's (Qwen2 is
  that plus q/k/v biases, a negligible share of the work): a Qwen2 config makes transformers,
  vLLM and llama.cpp's converter load the tokenizer files as Qwen2's tokenizer class, which
  splits text differently from the default model's, so each system would see other token ids. Why the embedding rows past the tokenizer's ids
  are zero: their logits are then exactly 0 while the largest of 49152 random logits is
  positive, so greedy decoding never picks an id that no tokenizer could print, yet every
  system still computes the full 151936-row LM head (the cost this shape is about). EOS is
  ignored by the benchmarks, so the random weights' text does not matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from peers import paths

QWEN_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors") + TOKENIZER_FILES


def _fresh(out: Path) -> Path:
    """A temporary sibling folder to write into, renamed to `out` once complete."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def complete(folder: Path) -> bool:
    """A model folder is complete when its config, weights and tokenizer are all there."""
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def make_default(out: Path) -> Path:
    """Copy the default model's float folder (what `contbatch.load_model()` reads)."""
    from contbatch.setup.loading import default_model_dir

    src = default_model_dir()
    tmp = _fresh(out)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    if not complete(tmp):
        raise RuntimeError(f"{src} lacks config.json, model.safetensors or tokenizer.json")
    return _finish(tmp, out)


def make_qwen_shape(out: Path, seed: int = 0) -> Path:
    """Qwen2.5-0.5B's shape with random weights (float32, seeded) and the default tokenizer."""
    import torch
    import transformers

    from contbatch.setup.loading import default_model_dir

    tok_dir = default_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    config = transformers.LlamaConfig(**QWEN_SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[len(tok):] = 0.0
    tmp = _fresh(out)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, tmp / name)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
    if not complete(tmp):
        raise RuntimeError(f"writing {out} left it incomplete")
    return _finish(tmp, out)


MAKERS = {"smollm2-135m": make_default, "qwen2.5-0.5b-shape": make_qwen_shape}


def convert_command(name: str, quant: str) -> list[str]:
    """The command that writes `gguf_path(name, quant)`: llama.cpp's converter at the float
    types and Q8_0, `llama-quantize` from the F32 file for Q4_0."""
    out = paths.gguf_path(name, quant)
    if quant == "Q4_0":
        return [str(paths.llama_bin("llama-quantize")), str(paths.gguf_path(name, "F32")), str(out), "Q4_0"]
    src = paths.llama_source()
    if src is None:
        raise RuntimeError("llama.cpp source not unpacked (run the llama.cpp steps of setup_peers.py first)")
    return [str(paths.venv_python()), str(src / "convert_hf_to_gguf.py"), str(paths.model_dir(name)),
            "--outtype", quant.lower(), "--outfile", str(out)]
