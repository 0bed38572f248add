from .greedy import greedy

__all__ = ["greedy"]
