"""Tensor parallelism: one engine over a model sharded across processes (see group.py, steps.py, launch.py)."""

from .group import RankFailure, TensorParallel, check_tp_size
from .launch import launch, spawn
from .steps import run_worker

__all__ = ["RankFailure", "TensorParallel", "check_tp_size", "launch", "run_worker", "spawn"]
