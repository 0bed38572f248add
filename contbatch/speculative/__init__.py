"""Speculative decoding: proposals (n-gram prompt lookup, a draft model) verified in the batch.

`SpeculativeConfig` says what to propose; `Speculator` decides, each step, which requests
propose and how many tokens (eligibility, budgets, adaptive back-off); the acceptance itself
is the sampler's (`sampling/verify.py`).
"""

from ..config import SpeculativeConfig
from .speculator import Speculator

__all__ = ["SpeculativeConfig", "Speculator"]
