"""An engine for a model, built one way for every rank: refuse what it cannot run exactly,
resolve the configuration, build the `EngineCore`.

Under tensor parallelism (a model loaded with `tp_plan`) every rank builds the same engine
with rank 0's config and the fewest blocks any rank can hold (`distributed/group.py`); rank 0's
runner is wrapped in a `DriverRunner`, which sends each step to the other ranks first. The
manager sees a runner either way: it never needs to know which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ContinuousBatchingConfig, ResolvedConfig
from ..distributed.group import TensorParallel
from ..distributed.steps import DriverRunner
from ..requests import RequestState
from ..runtime.core import EngineCore
from .resolve import resolve_config
from .support import check_model_support


@dataclass
class BuiltEngine:
    config: ContinuousBatchingConfig  # as given (rank 0's, under tensor parallelism)
    resolved: ResolvedConfig
    core: EngineCore
    group: TensorParallel | None  # the tensor-parallel group, or None


def build_engine(model: torch.nn.Module, config: ContinuousBatchingConfig | None,
                 publish: Callable[[RequestState], None]) -> BuiltEngine:
    """Raises `ValueError` for a model the engine cannot run exactly, or a config it cannot honour."""
    group = TensorParallel.for_model(model)
    if group is not None:
        config = group.share_config(config)
    config = config or ContinuousBatchingConfig()
    check_model_support(model, config)
    resolved, layout = resolve_config(config, model)
    if group is not None:
        resolved = group.agree(resolved, layout.num_kv_heads)
    core = EngineCore(model, resolved, layout, publish)
    if group is not None and group.is_driver:
        core.runner = DriverRunner(core.runner, group, core.host)
    return BuiltEngine(config, resolved, core, group)
