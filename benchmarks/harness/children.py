"""Fresh processes: each timed run in a new interpreter, importing contbatch from a given tree.

A/B comparisons of two source trees (or of settings that act at import or start-up) need each
run in its own process: `run_child` starts `python -c CODE args...` (or a script) with the tree
first on `PYTHONPATH`, from `/` so the working directory cannot shadow it, and reads the JSON
the child prints after `RESULT ` (`emit()` in the child).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

MARKER = "RESULT "


def child_env(tree: str | None = None, extra: dict | None = None) -> dict[str, str]:
    """The environment of a child: `tree` (a contbatch source tree) first on PYTHONPATH,
    transformers' warnings off, then `extra`."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    if tree:
        rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), *rest])
    env.update(extra or {})
    return env


def run_child(code: str | None, args: Sequence[str] = (), tree: str | None = None, env: dict | None = None,
              script: str | None = None) -> dict:
    """Run `code` (or `script`) in a fresh interpreter and return the JSON it emitted; a child
    that fails raises with the tail of its stderr."""
    argv = [sys.executable, *(["-c", code] if code is not None else [script]), *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(tree, env), cwd="/")
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith(MARKER)), None)
    if done.returncode or line is None:
        raise RuntimeError(f"child {argv[1:3]} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line[len(MARKER):])


def emit(result: dict) -> None:
    """In a child: hand `result` to the parent."""
    print(MARKER + json.dumps(result), flush=True)


def parse_named(specs: Sequence[str]) -> dict[str, str]:
    """`name=value` arguments (trees, servers) as a dict, in order."""
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {spec!r}")
        out[name] = value
    return out
