from .manager import ContinuousBatchingManager

__all__ = ["ContinuousBatchingManager"]
