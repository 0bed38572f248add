"""Where the peers and the models they share live (the standard library and contbatch_launcher's
library search only: a leaf).

Everything is under one work folder: `$CONTBATCH_PEERS` if set, else `benchmarks/peers/.work`
(git-ignored). Nothing here creates anything; `setup_peers.py` writes, the benchmarks read.
"""

from __future__ import annotations

import os
from pathlib import Path

from contbatch_launcher import find_tcmalloc

PEERS_ENV = "CONTBATCH_PEERS"
HERE = Path(__file__).resolve().parent
QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # the GGUF files made for each model
MODELS = ("smollm2-135m", "qwen2.5-0.5b-shape")  # model folders every system loads


def work_dir() -> Path:
    """`$CONTBATCH_PEERS`, else `benchmarks/peers/.work` (read on every call)."""
    return Path(os.environ.get(PEERS_ENV) or HERE / ".work")


def venv_python() -> Path:
    """The peers' virtualenv (vLLM CPU, intel-openmp, gguf): never the project's own."""
    return work_dir() / "venv" / "bin" / "python"


def llama_bin(name: str) -> Path:
    """A llama.cpp program (`llama-server`, `llama-quantize`) of the native build."""
    return work_dir() / "llama-build" / "bin" / name


def llama_source() -> Path | None:
    """The llama.cpp source vendored in the unpacked llama-cpp-python sdist, if unpacked."""
    found = sorted((work_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


def model_dir(name: str) -> Path:
    """A safetensors HF folder that every system loads (see `models.py`)."""
    if name not in MODELS:
        raise ValueError(f"unknown peer model {name!r}; one of {', '.join(MODELS)}")
    return work_dir() / "models" / name


def gguf_path(name: str, quant: str) -> Path:
    """The GGUF file of a model folder at a quant type (one of `QUANTS`)."""
    quant = quant.upper()
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; one of {', '.join(QUANTS)}")
    return work_dir() / "models" / f"{name}.{quant}.gguf"


def resolve_model(spec: str | None) -> Path | None:
    """A `--model` value: a peer model's name becomes its folder; anything else is a path
    (None stays None: the embedded default model)."""
    if spec in MODELS:
        return model_dir(spec)
    return None if spec in (None, "default") else Path(spec)


def setup_record() -> Path:
    """The JSON file `setup_peers.py` writes: what was resolved (versions, libraries, paths)."""
    return work_dir() / "setup.json"


def tcmalloc() -> Path | None:
    """The system's tcmalloc (Debian `libgoogle-perftools4` / `libtcmalloc-minimal4`), if any:
    the library the `contbatch` command preloads, found by the same search."""
    found = find_tcmalloc()
    return None if found is None else Path(found)


def iomp() -> Path | None:
    """Intel OpenMP from the `intel-openmp` package in the peers' virtualenv, if installed."""
    lib = work_dir() / "venv" / "lib" / "libiomp5.so"
    return lib if lib.is_file() else None


def preloads() -> list[Path]:
    """What vLLM's CPU docs ask to preload (tcmalloc, Intel OpenMP), those that are there."""
    return [p for p in (tcmalloc(), iomp()) if p is not None]
