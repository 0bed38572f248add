"""Our C++ decode attention for the CPU (`csrc/paged_decode_cpu.cpp`), built once per machine.

The torch backend's decode rows used to gather each request's keys and values into a fresh
tensor per layer (`index_select`), then attend with batched matmuls: on a 64-request batch
the gather alone was ~7% of the engine's time and the matmuls another ~5%. The kernel reads
K/V in place through the block tables instead, one task per request and KV head.

It is compiled with the machine's own compiler the first time it is needed (`make setup`
builds it ahead of time) into `$CONTBATCH_CACHE/ext/<hash>`, keyed by the source, the torch
version and the CPU's instruction set, so later starts only load it. Where it cannot be built
(no compiler) the backend keeps the gather path and says so at start-up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("contbatch")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def load() -> tuple[bool, str]:
    """(available, how): builds or loads the kernel once per process; never raises."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["how"] = _load()
            level = logging.INFO if _state["ok"] else logging.WARNING
            logger.log(level, "contbatch: CPU decode attention kernel: %s", _state["how"])
        return bool(_state["ok"]), str(_state["how"])


def _load() -> tuple[bool, str]:
    if hasattr(torch.ops, "contbatch_cpu") and hasattr(torch.ops.contbatch_cpu, "paged_decode"):
        return True, "already loaded"
    from ..models import cache_dir

    key = build_key()
    build_dir = cache_dir() / "ext" / key
    so = build_dir / f"contbatch_cpu_{key}.so"
    start = time.perf_counter()
    try:
        if so.exists():
            torch.ops.load_library(str(so))
            return True, f"loaded {so} in {time.perf_counter() - start:.2f} s"
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the `ninja` wheel puts it next to this interpreter
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=f"contbatch_cpu_{key}", sources=[str(SOURCE)], build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False,
        )
        return True, f"built {so} in {time.perf_counter() - start:.1f} s"
    except Exception as exc:  # no compiler, no headers, a read-only cache: keep the gather path
        return False, f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); " \
                      "decode rows gather K/V instead"


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, sinks: torch.Tensor | None, block_size: int, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
    """query [rows, H, D] contiguous; key/value `[H_kv, slots, D]` views of one layer's cache;
    block_table [rows, W] and kv_lens [rows] int32. Returns [rows, H, D]."""
    empty = query.new_empty(0, dtype=torch.float32)
    return torch.ops.contbatch_cpu.paged_decode(
        query, key, value, block_table, kv_lens, empty if sinks is None else sinks.float(), block_size, scale,
        window or 0, softcap or 0.0)


if __name__ == "__main__":  # `python -m contbatch.attention.cpu_kernel`: build ahead of time (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok, how = load()
    print(how)
