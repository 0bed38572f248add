"""contbatch: a continuous-batching inference engine for `transformers` causal LMs."""

from .api import continuous_batching, generate_batch
from .cache import BlockManager, PagedAttentionCache
from .config import ContinuousBatchingConfig, ResolvedConfig
from .engine import ContinuousBatchingManager
from .setup.loading import load_model
from .requests import GenerationOutput, RequestState, RequestStatus
from .sampling import SamplingParams, StructuredOutput
from .scheduling import FIFOScheduler, PrefillFirstScheduler, Scheduler
from .speculative import SpeculativeConfig

__version__ = "0.1.0"

__all__ = [
    "BlockManager",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FIFOScheduler",
    "GenerationOutput",
    "PagedAttentionCache",
    "PrefillFirstScheduler",
    "RequestState",
    "RequestStatus",
    "ResolvedConfig",
    "SamplingParams",
    "Scheduler",
    "SpeculativeConfig",
    "StructuredOutput",
    "continuous_batching",
    "generate_batch",
    "load_model",
]
