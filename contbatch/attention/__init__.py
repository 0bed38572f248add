from .metadata import StepMetadata
from .paged import ATTENTION_NAME, ENGINE_MASK, attach, detach, paged_attention_forward

__all__ = ["ATTENTION_NAME", "ENGINE_MASK", "StepMetadata", "attach", "detach", "paged_attention_forward"]
