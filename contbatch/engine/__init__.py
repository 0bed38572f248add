from .manager import ContinuousBatchingManager
from .worker import run_worker

__all__ = ["ContinuousBatchingManager", "run_worker"]
