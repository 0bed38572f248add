"""Our C++ CPU kernels (`csrc/`), built once per machine into one library of `torch.ops.contbatch_cpu`.

What each op computes, and the contract of its arguments, is in `ops.py`, the only caller of
the library; `docs/cpu.md` says why each exists and what it measured.

The library is compiled with the machine's own compiler the first time it is needed
(`make setup` builds it ahead of time) into `$CONTBATCH_CACHE/ext/<hash>`, keyed by the
sources, the torch version, the CPU's instruction set and the compiler flags (`-march=native`
picks each kernel's AVX-512, AVX2 or portable path), so later starts only load it. Where
it cannot be built (no compiler) each user keeps its PyTorch path and says so at start-up.

The library is a cache entry (`cachefiles`): a manifest beside it records its size and sha256
once it is built, and a library that does not match (truncated, unfinished, built by a version
that kept no record) is built again rather than loaded: loading a truncated one kills the
process with SIGBUS, which nothing here could catch. Builds are serialised by an `flock` on
`ext/<hash>.lock`, which a killed builder releases; torch's own lock file in the build folder
(`lock`, which only its existence makes held) is left by a killed build and would stall every
later one, so a holder of our lock removes it: no live builder of ours can own it then.
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

from .. import cachefiles
from ..paths import cache_dir

logger = logging.getLogger("contbatch")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # part of the build key, not compiled alone
# No floating-point contraction: the rotary and norm kernels reproduce PyTorch's roundings
# (each product rounded, then the sum); explicit FMA intrinsics are unaffected.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
# Flags added after CFLAGS (part of the build key), e.g. `-mno-avx512f` to build the AVX2 code
# paths on an AVX-512 machine: how the tests check the kernels an AVX2-only CPU runs.
EXTRA_CFLAGS_ENV = "CONTBATCH_NATIVE_CFLAGS"
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


def cflags() -> list[str]:
    return [*CFLAGS, *os.environ.get(EXTRA_CFLAGS_ENV, "").split()]


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), torch.__version__.encode(), _cpu_flags().encode(),
                 " ".join(cflags()).encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def load() -> tuple[bool, str]:
    """(available, how): builds or loads the library once per process; never raises."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["how"] = _load()
            level = logging.INFO if _state["ok"] else logging.WARNING
            logger.log(level, "contbatch: C++ CPU kernels: %s", _state["how"])
        return bool(_state["ok"]), str(_state["how"])


def disable(reason: str) -> None:
    """Keep the library unloaded in this process: `load()` reports it unavailable with `reason`
    and every caller takes its PyTorch path. For a process that must build nothing (a benchmark
    on a fresh machine measuring host work with `cpu_kernels="off"`); the config's `"off"` alone
    covers the model's routers, not the sampler's argmax or the cache's writes. Once loaded, a
    library cannot be unloaded, so this raises if it already is."""
    with _lock:
        if _state.get("ok"):
            raise RuntimeError("contbatch's C++ CPU kernels are already loaded in this process")
        _state["ok"], _state["how"] = False, f"disabled ({reason})"
        logger.info("contbatch: C++ CPU kernels: %s", _state["how"])


def _load() -> tuple[bool, str]:
    if hasattr(torch.ops, "contbatch_cpu") and hasattr(torch.ops.contbatch_cpu, "small_linear"):
        return True, "already loaded"
    key = build_key()
    build_dir = cache_dir() / "ext" / key
    so = build_dir / f"contbatch_cpu_{key}.so"
    start = time.perf_counter()
    try:
        # A library that matches its manifest is never rewritten, so it can be loaded unlocked
        # (a read-only cache still loads it).
        if cachefiles.check_manifest(build_dir, build_key=key) is None:
            torch.ops.load_library(str(so))
            return True, f"loaded {so} in {time.perf_counter() - start:.2f} s"
        with cachefiles.locked(build_dir.with_name(f"{key}.lock"), "building contbatch's C++ kernels"):
            problem = cachefiles.check_manifest(build_dir, build_key=key)
            if problem is None:  # built by another process while this one waited
                torch.ops.load_library(str(so))
                return True, f"loaded {so} in {time.perf_counter() - start:.2f} s"
            if so.exists():
                logger.warning("contbatch: C++ kernel library not loaded (%s): building it again", problem)
            _build(key, build_dir, so)
        return True, f"built {so} in {time.perf_counter() - start:.1f} s"
    except Exception as exc:  # no compiler, no headers, a read-only cache: keep the PyTorch paths
        return False, f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"


def _build(key: str, build_dir: Path, so: Path) -> None:
    """Builds the library into `build_dir`, loads it, and records it. Called holding our lock:
    what a stopped build left (torch's lock file, a partial library, a stale manifest) is
    removed first, and the library is deleted rather than rewritten, so processes that mapped
    the old file keep it intact and ninja cannot take a damaged one for up to date."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` wheel puts it next to this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / cachefiles.MANIFEST).unlink(missing_ok=True)
    so.unlink(missing_ok=True)
    baton = build_dir / "lock"
    if baton.exists():
        logger.warning("contbatch: %s: left by a build that did not finish; removed", baton)
        baton.unlink(missing_ok=True)
    cpp_extension.load(
        name=f"contbatch_cpu_{key}", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
        extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
        is_python_module=False, verbose=False,
    )
    cachefiles.write_manifest(build_dir, [so.name], build_key=key)


if __name__ == "__main__":  # `python -m contbatch.cpu.native`: build ahead of time (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok, how = load()
    print(how)
