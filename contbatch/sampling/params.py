"""Per-request sampling parameters, validated when built and honoured every time.

`None` means "take it from the `GenerationConfig` in force"; `resolve()` fills every field, so
the engine never has to guess and never silently ignores a value it accepted.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid sampling parameter: {msg}")

        if self.temperature is not None and self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < -1:
            fail(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    fail(f"logit_bias keys must be token ids, got {token!r}")
                if not -100 <= bias <= 100:
                    fail(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.min_new_tokens < 0:
            fail(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            fail(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            fail(f"min_new_tokens ({self.min_new_tokens}) > max_new_tokens ({self.max_new_tokens})")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(t, int) and t >= 0 for t in self.stop_token_ids
            ):
                fail(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                fail(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and not isinstance(self.seed, int):
            fail(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an int >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            fail(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

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
        )

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

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
            temperature=float(temperature),
            top_k=int(pick(self.top_k, "top_k", -1)),
            top_p=float(pick(self.top_p, "top_p", 1.0)),
            min_p=float(pick(self.min_p, "min_p", 0.0)),
            repetition_penalty=float(pick(self.repetition_penalty, "repetition_penalty", 1.0)),
            max_new_tokens=self.max_new_tokens or default_max_new_tokens,
        )
