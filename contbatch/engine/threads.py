"""One OpenMP pool for the forward: the engine thread's.

Every thread that runs parallel torch ops gets its own OpenMP worker pool, and the pools
outlive their work. The user's thread has usually run torch ops before it starts an engine
(loading the model), so the engine thread becomes a second pool on the same cores. libgomp
then counts more managed threads than CPUs and stops spinning between parallel regions: every
op of the forward pays a futex sleep and wake-up, and a forward on the engine thread ran far
slower than the same on the main thread (`benchmarks/thread_forward.py` measures it).

`release_openmp_pool()` frees the calling thread's pool (`omp_pause_resource_all`, OpenMP
5.0), so that the engine thread's is the only one. A thread that later runs parallel torch
ops again gets a new pool, and both slow down while they coexist: keep heavy torch work off
other threads while an engine runs, or give it `torch.set_num_threads(1)`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

import torch

logger = logging.getLogger("contbatch")

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_resource_all():
    """`omp_pause_resource_all` of the OpenMP runtime torch uses, or None if it has none."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(lib_dir, "libgomp*.so*")) + glob.glob(os.path.join(lib_dir, "libiomp*")))
    for handle in [*candidates, None]:  # None: whatever the process has loaded already
        try:
            pause = ctypes.CDLL(handle).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        return pause
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True if the runtime did."""
    pause = _pause_resource_all()
    if pause is None:
        logger.debug("contbatch: no omp_pause_resource_all in this OpenMP runtime; pools left as they are")
        return False
    return pause(_OMP_PAUSE_SOFT) == 0
