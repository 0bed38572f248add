"""OpenAI request fields -> the engine's `SamplingParams`, with the context checks.

Everything a client can get wrong is caught here or by `SamplingParams` itself and turned into
a 400 that names the field and the numbers; nothing invalid reaches the engine thread, where
an exception would fail every request sharing the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ResolvedConfig
from ..sampling.params import SamplingParams
from ..sampling.structured import StructuredOutput
from .errors import APIError, bad_request
from .schemas import SamplingFields

# vLLM's _SAMPLING_EPS: a temperature this small is greedy (dividing logits by it overflows).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class Limits:
    """How many tokens one request may use, and where the number comes from."""

    max_model_len: int  # the context a request may fill: prompt + completion
    vocab_size: int
    default_temperature: float  # OpenAI's 1.0 unless the model's generation config samples

    @classmethod
    def build(cls, resolved: ResolvedConfig, max_model_len: int | None, vocab_size: int, generation_config) -> Limits:
        """The context is the smallest of the model's, `--max-model-len`, the tokens one
        block table addresses and the whole KV cache: a request beyond any of them could
        never run."""
        cache_tokens = min(resolved.max_blocks_per_request, resolved.num_blocks) * resolved.block_size
        limit = min(resolved.max_context, cache_tokens)
        if max_model_len is not None:
            if max_model_len > resolved.max_context:
                raise ValueError(
                    f"--max-model-len {max_model_len} exceeds the model's context of {resolved.max_context} tokens"
                )
            limit = min(limit, max_model_len)
        gc = generation_config
        temperature = 1.0
        if gc is not None and getattr(gc, "do_sample", False) and getattr(gc, "temperature", None) is not None:
            temperature = float(gc.temperature)
        return cls(limit, vocab_size, temperature)


def max_new_tokens(
    requested: int | None, default: int | None, prompt_len: int, limits: Limits, param: str, prompt_param: str
) -> int:
    """The completion budget: the request's, else `default` (clipped to what is left), else
    everything the context leaves (vLLM's rule for chat)."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt is "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > limits.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the length of the prompt or of {param}.",
            param,
            "context_length_exceeded",
        )
    return requested


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """OpenAI's `response_format` or vLLM's `structured_outputs` (not both), checked in full
    here: a schema, regex or grammar the backend cannot enforce is a 400 naming the problem.
    Built once per request (a completion with several prompts shares it)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type == "text":
        fmt = None
    if fmt is not None and so is not None:
        raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None:
        param = "response_format"
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise bad_request("response_format.json_schema needs type 'json_schema'", param)
            spec = {"json_object": True}
        elif fmt.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs a json_schema object", param)
        else:
            schema = fmt.json_schema.schema_
            spec = {"json_object": True} if schema is None else {"json": schema}
    elif so is not None:
        param = "structured_outputs"
        spec = {k: v for k, v in so.model_dump(by_alias=True).items() if v is not None and v is not False}
    else:
        return None
    try:
        return StructuredOutput(**spec)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def sampling_params(
    req: SamplingFields, limits: Limits, max_tokens: int, logprobs: bool, top_logprobs: int, max_n: int,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """Every accepted field, mapped; the engine validates the rest and raises ValueError."""
    if req.n > max_n:
        raise bad_request(f"n must be <= {max_n}, got {req.n}", "n")
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    temperature = limits.default_temperature if req.temperature is None else req.temperature
    if temperature < SAMPLING_EPS:
        temperature = 0.0
    top_k = req.top_k
    if top_k is not None and (top_k == 0 or top_k >= limits.vocab_size):
        top_k = -1  # 0 is OpenAI-style "off"; k >= vocab keeps everything anyway
    stop = req.stop
    if isinstance(stop, list) and not stop:
        stop = None
    try:
        return SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=_logit_bias(req.logit_bias, limits.vocab_size),
            min_new_tokens=req.min_tokens,
            max_new_tokens=max_tokens,
            stop_token_ids=req.stop_token_ids or None,
            stop=stop,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            n=req.n,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_output=structured,
            speculative=req.speculative,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {token}", "logit_bias")
        out[token] = float(value)
    return out
