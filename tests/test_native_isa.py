"""Our C++ kernels as an AVX2-only CPU builds them, checked on a machine with AVX-512.

The kernels have AVX-512, AVX2 and portable paths, chosen at build time from the machine's
instruction set (`-march=native`). A CI machine with AVX-512 never runs the AVX2 ones, which
AVX2-only CPUs do run. `CONTBATCH_NATIVE_CFLAGS=-mno-avx512f` builds the
library again without AVX-512 (its own build key, so both stay cached), and the kernel tests run
against that build in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.cpu import native

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_cpu_kernel.py", "tests/test_cpu_norm.py", "tests/test_cpu_rotary.py",
                "tests/test_cpu_linear.py"]


def test_extra_build_flags_join_the_build_key(monkeypatch):
    monkeypatch.delenv(native.EXTRA_CFLAGS_ENV, raising=False)
    plain = native.build_key()
    monkeypatch.setenv(native.EXTRA_CFLAGS_ENV, "-mno-avx512f")
    assert native.cflags()[-1] == "-mno-avx512f" and native.cflags()[: len(native.CFLAGS)] == list(native.CFLAGS)
    assert native.build_key() != plain  # a library built with other flags is never loaded in its place


@pytest.mark.slow
def test_kernels_built_without_avx512_match_the_references():
    flags = set(native._cpu_flags().split())  # /proc/cpuinfo's flags line
    if "avx512f" not in flags or "avx2" not in flags:
        pytest.skip("needs a CPU with AVX-512 (an AVX2-only CPU runs these paths in the default tests)")
    if not native.load()[0]:
        pytest.skip("no C++ toolchain here")
    env = dict(os.environ, **{native.EXTRA_CFLAGS_ENV: "-mno-avx512f"})
    check = ("import contbatch.cpu.native as n; ok, how = n.load(); assert ok, how; "
             "assert '-mno-avx512f' in n.cflags(); print(how)")
    built = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
