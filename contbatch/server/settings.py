"""What one server process is configured with, apart from the engine itself.

Kept separate from `ContinuousBatchingConfig`: these are HTTP-facing policies (names, keys,
limits on bodies, contexts, connections and the request-preparation pool, shutdown), and
tests build apps from them without a CLI. docs/security.md explains each limit.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_BODY_BYTES = 2**20  # the smallest sized limit: room for a large chat or stop list at any context
MAX_SIZED_BODY_BYTES = 16 * 2**20  # the largest sized limit (reached at 256k tokens of context)
BODY_BYTES_PER_TOKEN = 64  # a token as text is ~4 characters; JSON escapes and chat framing add more
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


def sized_body_limit(max_model_len: int) -> int:
    """The default body limit: max(1 MiB, 64 bytes x context), at most 16 MiB.

    A body that could only hold a prompt far beyond the context is refused with 413 before it
    is read, rather than parsed and tokenized (work that holds a worker, and for the JSON parse
    the interpreter lock too) only to be refused for its length afterwards."""
    return min(MAX_SIZED_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len))


@dataclass(frozen=True)
class ServerSettings:
    """HTTP policies of one server; the engine's own limits come from its resolved config."""

    served_model_names: tuple[str, ...]  # the first is reported; every one is accepted as `model`
    model_root: str = ""  # where the weights came from, shown by /v1/models
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_model_len: int | None = None  # None: the model's context (and what the KV cache can address)
    max_body_bytes: int | None = None  # None: sized from the context, see `sized_body_limit`
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_n: int = 128  # samples per prompt; each is a full request in the engine
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # request line + headers, from their first byte
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # the whole body, from the end of the headers
    worker_threads: int = 2  # parse, validate, template and tokenize requests off the event loop
    max_queued_jobs: int = 64  # requests waiting for a worker; more get 503
    escape_special_tokens: bool = False  # chat content: special tokens typed by clients stay text
    weights_dir: str | None = None  # /update_weights_from_disk reads safetensors files under it only
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral; None: read from the chat template
    responses_store_size: int = 1024  # responses kept for previous_response_id and GET /v1/responses/{id}
    responses_store_bytes: int = 64 * 2**20  # and the bytes they may take together

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names needs at least one non-empty name")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one generated), got {self.max_model_len}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_threads < 1:
            raise ValueError(f"worker_threads must be >= 1, got {self.worker_threads}")
        if self.tool_call_parser not in (None, "auto", "hermes", "llama3_json", "mistral"):
            raise ValueError("tool_call_parser must be auto, hermes, llama3_json or mistral, "
                             f"got {self.tool_call_parser!r}")
        if self.responses_store_size < 0 or self.responses_store_bytes < 0:
            raise ValueError("responses_store_size and responses_store_bytes must be >= 0")
        if self.max_queued_jobs < 0:
            raise ValueError(f"max_queued_jobs must be >= 0, got {self.max_queued_jobs}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def body_limit(self, max_model_len: int) -> int:
        """Bytes a request body may have: `max_body_bytes` if set, else sized from the context."""
        return self.max_body_bytes if self.max_body_bytes is not None else sized_body_limit(max_model_len)
