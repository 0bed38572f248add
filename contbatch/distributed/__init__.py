"""Tensor parallelism: one engine over a model sharded across processes: the process group and
its handshake (group.py), rank 0's runner that sends each step to the other ranks (steps.py),
and the launcher of one process per rank (launch.py). A worker rank's life is
`contbatch.engine.run_worker`."""

from .group import RankFailure, TensorParallel, check_tp_size
from .launch import launch, spawn

__all__ = ["RankFailure", "TensorParallel", "check_tp_size", "launch", "spawn"]
