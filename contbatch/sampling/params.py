"""Per-request sampling parameters, validated when built and honoured every time.

`None` means "take it from the `GenerationConfig` in force"; `resolve()` fills every field, so
the engine never has to guess and never silently ignores a value it accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from dataclasses import dataclass

import torch

from .structured import StructuredOutput

MAX_TOP_LOGPROBS = 20
# Bounds that keep a step's per-request work small: a request may not make every other
# request's steps slow (one list entry costs work in every step it runs).
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
# Outside this range a penalty only overflows float32 logits (1e-300 turns them into inf/NaN);
# every practical value (1.0-1.5) is far inside it.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TEMPERATURE = 1e4
# vLLM's _SAMPLING_EPS: a smaller temperature is greedy (dividing by it overflows float32).
SAMPLING_EPS = 1e-5


def is_integer(value) -> bool:
    """An integer, numpy's included, but not a bool or a float that happens to be whole."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # -1 or 0 = off
    top_p: float | None = None  # (0, 1]
    min_p: float | None = None  # [0, 1]
    repetition_penalty: float | None = None  # > 0; 1 = off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_new_tokens: int = 0
    max_new_tokens: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    stop: tuple[str, ...] | list[str] | str | None = None  # matched on decoded text
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False  # log-probability of each chosen token
    top_logprobs: int = 0  # and of the k most likely tokens, k <= 20
    skip_special_tokens: bool = True
    # Constrains the output to a JSON schema, a regex, a choice or a grammar (`structured.py`).
    # The grammar decides where the output ends: reaching its end finishes the request with
    # "stop" (min_new_tokens does not hold it back), and logprobs are those of the masked
    # distribution (tokens the grammar forbids have probability 0).
    structured_output: StructuredOutput | None = None
    # Speculative decoding, where the engine has it on: False opts this request out (its
    # tokens are the same either way; speculation only changes how fast they come).
    speculative: bool = True

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid sampling parameter: {msg}")

        def number(name: str, low: float, high: float, *, low_open: bool = False, optional: bool = True) -> None:
            """A real, finite number in range: NaN, inf, bools and strings are refused here,
            since any of them would reach the logits as NaN or a type error mid-step."""
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
            if value < low or value > high or (low_open and value == low):
                fail(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
            object.__setattr__(self, name, float(value))

        def integer(name: str, low: int, high: int | None = None, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not is_integer(value):
                fail(f"{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                fail(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
            object.__setattr__(self, name, int(value))

        number("temperature", 0.0, MAX_TEMPERATURE)
        integer("top_k", -1, optional=True)
        number("top_p", 0.0, 1.0, low_open=True)
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", *REPETITION_PENALTY_RANGE)
        number("presence_penalty", -2.0, 2.0, optional=False)
        number("frequency_penalty", -2.0, 2.0, optional=False)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                fail(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
            for token, bias in self.logit_bias.items():
                if not is_integer(token) or token < 0:
                    fail(f"logit_bias keys must be token ids, got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -100 <= bias <= 100:
                    fail(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        integer("min_new_tokens", 0)
        integer("max_new_tokens", 1, optional=True)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            fail(f"min_new_tokens ({self.min_new_tokens}) > max_new_tokens ({self.max_new_tokens})")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                is_integer(t) and t >= 0 for t in self.stop_token_ids
            ):
                fail(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                fail(f"stop_token_ids has {len(self.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                fail(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            if len(stop) > MAX_STOP_STRINGS:
                fail(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
            object.__setattr__(self, "stop", tuple(stop))
        integer("seed", -(2**63), 2**63 - 1, optional=True)
        integer("n", 1)
        integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not isinstance(self.speculative, bool):
            fail(f"speculative must be true or false, got {self.speculative!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            fail("structured_output must be a StructuredOutput(json=..., regex=..., choice=..., grammar=... or "
                 f"json_object=True), got {type(self.structured_output).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy, with nothing that moves the argmax and no logprobs: one argmax is all.
        Cached (the params are frozen): it is asked for every request at every step."""
        return (
            self.temperature == 0
            and not self.logit_bias
            and self.repetition_penalty in (None, 1.0)
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.min_new_tokens
            and not self.wants_logprobs
            and self.structured_output is None
        )

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases), built once: every step of the request reuses them."""
        bias = self.logit_bias or {}
        return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32)

    def resolve(self, generation_config, default_max_new_tokens: int) -> "SamplingParams":
        """Fill every `None` from the generation config (sampling only if it says do_sample)."""
        gc = generation_config
        sample = bool(getattr(gc, "do_sample", False))

        def pick(value, name, neutral):
            if value is not None:
                return value
            from_gc = getattr(gc, name, None) if (sample or name == "repetition_penalty") else None
            return from_gc if from_gc is not None else neutral

        temperature = self.temperature
        if temperature is None:
            temperature = (getattr(gc, "temperature", None) or 1.0) if sample else 0.0
        return dataclasses.replace(
            self,
            temperature=0.0 if temperature < SAMPLING_EPS else float(temperature),
            top_k=int(pick(self.top_k, "top_k", -1)),
            top_p=float(pick(self.top_p, "top_p", 1.0)),
            min_p=float(pick(self.min_p, "min_p", 0.0)),
            repetition_penalty=float(pick(self.repetition_penalty, "repetition_penalty", 1.0)),
            max_new_tokens=self.max_new_tokens or default_max_new_tokens,
        )
