from .params import MAX_TOP_LOGPROBS, SamplingParams
from .sampler import SampleRequest, SampleResult, Sampler

__all__ = ["MAX_TOP_LOGPROBS", "SampleRequest", "SampleResult", "Sampler", "SamplingParams"]
