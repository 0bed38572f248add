"""What to speculate with, validated when built (vLLM's `speculative_config` names)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # proposals per request per step (k)
    # n-gram prompt lookup: match the last n tokens (longest n first) against the request's
    # own prompt and output, and propose what followed the most recent match.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: a smaller causal LM with the target's tokenizer (a path, a hub id, or a
    # loaded module), run greedily with its own paged cache.
    model: object | None = None
    # Adaptive: a request whose recent acceptance rate (an exponential average over its
    # verification steps) falls below this stops proposing for a while, then tries again
    # (the pause doubles each time, up to `max_pause_steps`). 0 never pauses.
    min_acceptance_rate: float = 0.3
    max_pause_steps: int = 256
    # Proposals are handed out (oldest request first) only while the step's decoding requests
    # plus the tokens proposed so far stay within this many rows. Up to about that many rows a
    # step costs what one row costs (it reads every weight once); past it, rows cost compute,
    # and a rejected proposal costs more than it saves. None: 24 on the CPU (measured on the
    # default model: 4 requests x (1 + 4) rows ran 2.2x faster with n-gram proposals, 8 x 5
    # rows 1.05x), 256 on a GPU.
    max_step_rows: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative method 'draft_model' needs `model` (a path, hub id or loaded model)")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
        if self.max_step_rows is not None and self.max_step_rows < 2:
            raise ValueError(f"max_step_rows must be >= 2, got {self.max_step_rows}")
        if self.max_pause_steps < 1:
            raise ValueError(f"max_pause_steps must be >= 1, got {self.max_pause_steps}")

    @classmethod
    def coerce(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")

    def describe(self) -> str:
        what = (f"n-gram lookup (n {self.prompt_lookup_min}..{self.prompt_lookup_max})" if self.method == "ngram"
                else f"draft model {getattr(self.model, 'name_or_path', None) or self.model!r}")
        return (f"{what}, k={self.num_speculative_tokens}, pause below {self.min_acceptance_rate:.0%} acceptance, "
                f"proposals while a step has <= {self.max_step_rows} rows")
