"""The machine a benchmark ran on, as every report states it.

`machine_info()` gathers the CPU (model name, family/model, the vector extensions our kernels
use), the cores the process may run on, memory, and the torch / transformers / Python versions
with torch's thread counts; `machine_line()` says it in one line for tables and RESULTS.md.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx_ne_convert", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_kind() -> str:
    """Family, model and vector extensions: 'family 25 model 17, avx2 avx512f avx512_bf16'. The
    model name alone ('AMD EPYC') does not tell an AVX2-only part from an AVX-512 one."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    parts = []
    if "cpu family" in info:
        parts.append(f"family {info['cpu family']} model {info.get('model', '?')}")
    isa = [f for f in ISA_FLAGS if f in flags]
    if isa:
        parts.append(" ".join(isa))
    return ", ".join(parts)


def machine_info() -> dict:
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        info["mem_gib"] = round(int(mem["MemTotal"].split()[0]) / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    return info


def machine_line(m: dict) -> str:
    kind = f" ({m['cpu_kind']})" if m.get("cpu_kind") else ""
    return (f"{m['cpu']}{kind}, {m['cpu_count']} CPUs" + (f", {m['mem_gib']} GiB" if m.get("mem_gib") else "")
            + f"; torch {m['torch']} ({m['torch_threads']} threads)"
            + (f", transformers {m['transformers']}" if m.get("transformers") else "") + f", Python {m['python']}")
