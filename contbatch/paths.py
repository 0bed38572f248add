"""Where contbatch keeps what it writes: one cache folder per user, shared by its processes.

A leaf module (standard library only), so anything can ask for the cache without importing
torch or the model loaders. What lives there, and how each entry is written and checked, is
in docs/operations.md.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CONTBATCH_CACHE"


def cache_dir() -> Path:
    """`$CONTBATCH_CACHE`, else `$XDG_CACHE_HOME/contbatch`, else `~/.cache/contbatch`.

    Read on every call (never memoised), so a test or a launcher that sets the variable later
    in the process is obeyed. The folder may not exist yet: writers create what they need."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "contbatch"
    )
    return Path(root)
