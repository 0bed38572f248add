"""Before the first step: load the model (`loading.py`), check that the engine runs it exactly
(`support.py`), resolve the configuration (`resolve.py`) and build the engine's parts
(`build.py`)."""

from .loading import load_model

__all__ = ["load_model"]
