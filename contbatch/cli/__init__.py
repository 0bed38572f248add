"""The `contbatch` command: `generate`, `serve` (here, as tensor-parallel ranks or on Ray) and
`bench serve`. `options.py` holds the flags the commands share and the one function that turns
them into a `ContinuousBatchingConfig`."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
