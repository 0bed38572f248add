"""contbatch on Ray: replicas behind one endpoint (Ray Serve) and batch generation (Ray Data).

Ray is an optional extra (`pip install 'contbatch[ray]'`): `import contbatch` never imports
it, and importing this package without it fails at once with how to install it, rather than
deep inside a deployment. docs/ray.md says what runs where.

- `serve.py`: `ContbatchServer`, one engine per replica behind the server's own FastAPI app,
  and `ContbatchFront`, the HTTP ingress that forwards to them with prefix-aware routing.
- `routing.py`: `PrefixAwareRouter`, a Serve request router (prefix hash, load tie-break).
- `data.py`: `ContbatchPredictor` for `Dataset.map_batches`, and `generate(ds, ...)`.
- `spec.py`: `EngineSpec`, what each actor needs to build its engine.
- `draining.py`: the front's drain; `shutdown.py`: how `contbatch serve --ray-replicas` ends
  on a signal (the drain, Serve, then the Ray runtime it started). The commands themselves
  (`contbatch serve/generate --ray-replicas`) are in `contbatch/cli/ray.py`.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("ray") is None:
    raise ImportError("contbatch.ray needs Ray, an optional extra: pip install 'contbatch[ray]' "
                      "(pins ray[serve,data]==2.60.0)")

from .data import ContbatchPredictor, generate, generate_rows
from .routing import PrefixAwareRouter, prefix_key
from .serve import ContbatchFront, ContbatchServer, ServeOptions, build_serve_app, replica_actors, run_serve
from .spec import EngineSpec

__all__ = [
    "ContbatchFront",
    "ContbatchPredictor",
    "ContbatchServer",
    "EngineSpec",
    "PrefixAwareRouter",
    "ServeOptions",
    "build_serve_app",
    "generate",
    "generate_rows",
    "prefix_key",
    "replica_actors",
    "run_serve",
]
