"""What one server process is configured with, apart from the engine itself.

Kept separate from `ContinuousBatchingConfig`: these are HTTP-facing policies (names, keys,
limits on bodies and contexts, shutdown), and tests build apps from them without a CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a 100k-token prompt as JSON ids is ~1 MiB: plenty of room
DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    """HTTP policies of one server; the engine's own limits come from its resolved config."""

    served_model_names: tuple[str, ...]  # the first is reported; every one is accepted as `model`
    model_root: str = ""  # where the weights came from, shown by /v1/models
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_model_len: int | None = None  # None: the model's context (and what the KV cache can address)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_n: int = 128  # samples per prompt; each is a full request in the engine

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names needs at least one non-empty name")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one generated), got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
