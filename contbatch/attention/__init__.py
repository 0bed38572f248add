from .metadata import BatchMetadata, DecodeGroup, PrefillRow
from .paged import ATTENTION_NAME, ENGINE_MASK, attach, detach, paged_attention_forward

__all__ = ["ATTENTION_NAME", "BatchMetadata", "DecodeGroup", "ENGINE_MASK", "PrefillRow", "attach", "detach", "paged_attention_forward"]
