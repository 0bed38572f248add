from .params import MAX_TOP_LOGPROBS, SamplingParams
from .sampler import SampleRequest, SampleResult, Sampler
from .structured import StructuredOutput

__all__ = ["MAX_TOP_LOGPROBS", "SampleRequest", "SampleResult", "Sampler", "SamplingParams", "StructuredOutput"]
