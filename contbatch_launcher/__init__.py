"""The `contbatch` command's entry point: tcmalloc as the process's allocator, where the machine
has it, before anything else is imported.

The engine's steps make and free many short-lived tensors; with glibc's malloc a `contbatch`
process ran ~5% slower than with tcmalloc (docs/cpu.md has the measurement: one request and
32 prompts on the default model, interleaved pairs of processes). An allocator has to be in
place before the process starts, so this module, which imports nothing of the package (nor
torch), re-executes the command once with `LD_PRELOAD` naming the library: same process id,
same arguments, and every process the command starts inherits it. `CONTBATCH_MALLOC=system`
keeps glibc's malloc; a machine without the library runs with glibc's (`make setup` installs
it where the distribution's package manager can). The allocator in use is logged at start-up
(`contbatch.cli.main`).
"""

from __future__ import annotations

import os
import sys

ENV = "CONTBATCH_MALLOC"  # "auto" (default): tcmalloc where found; "system": glibc's malloc
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """The path of a tcmalloc library on this machine, or None."""
    for folder in FOLDERS:
        for name in LIBRARIES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def preload_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute the command in, or None to run as it is: already
    preloaded (the re-executed process, or a user's own LD_PRELOAD of tcmalloc), opted out,
    or no library here."""
    choice = environ.get(ENV, "auto")
    if choice not in ("auto", "system"):
        raise SystemExit(f"error: {ENV} must be 'auto' or 'system', got {choice!r}")
    if choice == "system" or "tcmalloc" in environ.get("LD_PRELOAD", ""):
        return None
    library = find_tcmalloc()
    if library is None:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    # tcmalloc reports every allocation above 1 GiB on stderr by default (a KV cache is one).
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 62))
    return env


def main() -> int:
    env = preload_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, sys.argv[0], *sys.argv[1:]], env)
    from contbatch.cli import main as cli_main

    return cli_main()
