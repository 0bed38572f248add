"""One OpenMP pool for the forward: the thread that starts an engine gives its pool up.

Run in a fresh interpreter each: a pool is per thread and per process, and pytest's own
process has run torch ops on several threads already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="no OpenMP pool with one torch thread")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


PRELUDE = """
    import os, time, torch
    def threads():
        time.sleep(0.2)  # released workers take a moment to exit
        return len(os.listdir("/proc/self/task"))
    def parallel_ops():
        x = torch.randn(512, 512)
        (x @ x).sum(); torch.nn.functional.silu(torch.randn(1 << 20))
"""


def test_release_frees_the_calling_threads_pool():
    out = _run(PRELUDE + """
    from contbatch.engine.threads import release_openmp_pool
    before = threads(); parallel_ops(); with_pool = threads()
    released = release_openmp_pool(); after = threads()
    print(before, with_pool, released, after)
    """)
    before, with_pool, released, after = out.split()
    assert int(with_pool) > int(before), "parallel ops made no pool: the test is moot"
    assert released == "True" and int(after) == int(before)


def test_manager_start_leaves_the_engine_the_only_pool():
    """The user's thread loaded a model (a pool); after start() only the engine thread is new."""
    out = _run(PRELUDE + """
    import sys; sys.path.insert(0, "tests")
    from conftest import make_tiny_model
    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
    model = make_tiny_model("llama")
    before = threads(); parallel_ops(); with_pool = threads()
    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(block_size=4))
    manager.start(); started = threads(); manager.stop()
    print(before, with_pool, started)
    """)
    before, with_pool, started = map(int, out.split())
    assert with_pool > before, "parallel ops made no pool: the test is moot"
    assert started == before + 1  # the engine thread, and no pool left behind
