"""What a Ray actor needs to build its own engine: a picklable description, not an engine.

An engine holds a thread, a KV cache and a model on a device; none of that travels between
processes. Each Serve replica and each Ray Data actor receives an `EngineSpec` and loads the
model itself, once, in its constructor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..config import ContinuousBatchingConfig

logger = logging.getLogger("contbatch.ray")


@dataclass(frozen=True)
class EngineSpec:
    """A model to load and the engine config to run it with, in any actor."""

    model: str | None = None  # local HF folder or .gguf; None: the embedded default model
    dtype: str = "float32"
    device: str = "cpu"  # "cuda" in an actor given num_gpus
    config: ContinuousBatchingConfig = field(default_factory=ContinuousBatchingConfig)
    # Ray starts workers with OMP_NUM_THREADS=1, so torch would run one thread whatever CPUs
    # the actor was given. None: the actor's CPU share, rounded up (at least 1).
    torch_threads: int | None = None

    def set_threads(self) -> int:
        """Set torch's intra-op threads for this actor explicitly; returns the count."""
        import torch

        threads = self.torch_threads
        if threads is None:
            threads = 1
            try:
                import ray

                if ray.is_initialized():
                    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
                    threads = max(1, math.ceil(cpus))
            except Exception:  # outside an actor: keep 1
                pass
        torch.set_num_threads(threads)
        return threads

    def load(self):
        """Returns `(model, tokenizer)` on `device`, after setting the thread count."""
        import torch

        from ..setup.loading import load_model

        threads = self.set_threads()
        model, tokenizer = load_model(self.model, dtype=getattr(torch, self.dtype), device=self.device)
        logger.info("contbatch.ray: loaded %s (%s, %s) with %d torch threads", self.model or "default model",
                    self.dtype, self.device, threads)
        return model, tokenizer
