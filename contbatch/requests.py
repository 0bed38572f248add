"""Request lifecycle types shared by every layer: the one place request state lives.

`RequestState` is mutated only by the scheduler and the manager, in the engine thread; other
threads see immutable `GenerationOutput` snapshots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .sampling.grammar import GrammarState
    from .sampling.params import SamplingParams


# Async batching: a token sampled by a step still in flight. It holds the token's place so
# the next step can be planned; the device fills it in (carry-over) and the manager later.
PLACEHOLDER = -1


class RequestStatus(str, Enum):
    PENDING = "pending"  # queued, never scheduled
    PREEMPTED = "preempted"  # queued again after KV pressure: offloaded, or soft reset
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __init__(self, value: str) -> None:
        # A plain attribute rather than a property: it is read several times per request per step.
        self.is_done: bool = value in ("finished", "failed", "cancelled")


@dataclass
class GenerationOutput:
    """What a caller gets back: a snapshot, safe to hand to other threads.

    A final result holds the whole output. A streamed chunk (`is_finished` false) holds only
    what is new since the previous chunk: `generated_tokens` (= `new_tokens`), `logprobs`,
    `top_logprobs` and `delta_text`; `text` is None and `prompt_ids` is shared, read-only.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    status: RequestStatus
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    queued_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    scheduled_at: float | None = None  # first time it was given a step: queue time ends here
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at that moment
    text: str | None = None  # final: decoded output (needs a tokenizer), stop string removed
    new_tokens: list[int] = field(default_factory=list)  # streaming: tokens since the last chunk
    delta_text: str = ""  # streaming: text since the last chunk
    logprobs: list[float] | None = None  # one per generated token
    top_logprobs: list[dict[int, float]] | None = None
    index: int = 0  # which of the n samples of its prompt
    samples: list["GenerationOutput"] | None = None  # n > 1: every sample, in index order
    weight_version: int = 0  # the manager's weight version that produced the latest token
    # One per generated token, only where the request's tokens came from several versions
    # (`update_weights` with in-flight requests kept or recomputed): RL trainers drop those.
    weight_versions: list[int] | None = None
    # Speculative decoding: tokens proposed for this request, and how many the target accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_done


@dataclass
class RequestState:
    """A request as the engine sees it.

    The engine only tracks `all_token_ids` (prompt + generated) and how many of them already
    have KV in the cache (`num_computed_tokens`). Prefill, chunked prefill, decode and the
    recompute after a soft reset are then one operation: compute the tokens past
    `num_computed_tokens`, and sample when the chunk reaches the end of the sequence.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int | None = None
    streaming: bool = False
    arrival: int = 0  # monotonically increasing submission number: FIFO order
    status: RequestStatus = RequestStatus.PENDING
    generated_tokens: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    soft_resets: int = 0
    params: "SamplingParams | None" = None
    min_new_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    detokenizer: "IncrementalDetokenizer | None" = None
    delta_text: str = ""
    published_tokens: int = 0
    index: int = 0
    leader: "RequestState | None" = None  # n > 1: wait until this sibling's prompt is computed
    parent_id: str | None = None  # n > 1: the id the caller knows
    queued_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    finished_at: float | None = None
    scheduled_at: float | None = None
    cached_tokens: int = 0
    pending_tokens: int = 0  # trailing placeholders (async batching)
    committed_tokens: int = 0  # tokens whose blocks are published to the prefix cache
    weight_version: int = 0  # of its latest token
    adapter: str | None = None  # LoRA adapter name, None: the base model
    lora_slot: int = -1  # the adapter's resident slot while admitted (engine/adapters.py), -1: none
    cache_salt: int | None = None  # mixed into its prefix-cache hashes: blocks of other adapters never match
    token_versions: list[int] | None = None  # per token, once a weight update came mid-request
    stale_kv: bool = False  # KV kept across a weight update: never published to the prefix cache
    grammar: "GrammarState | None" = None  # structured output: waits in the queue until compiled
    # Speculative decoding (speculative/speculator.py): this step's proposals, the counters,
    # and the adaptive back-off (an acceptance average; steps left to pause; the next pause).
    draft_tokens: list[int] = field(default_factory=list)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_rate: float = 1.0
    spec_pause: int = 0
    spec_backoff: int = 8

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def remaining_tokens(self) -> int:
        """Tokens still to be run through the model before the next sample."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def known_tokens(self) -> list[int]:
        """Generated tokens without the trailing placeholders of steps still in flight."""
        return self.generated_tokens[: len(self.generated_tokens) - self.pending_tokens]

    @property
    def exhausted(self) -> bool:
        """Out of token budget (counting placeholders): it ends whatever its next token is."""
        return len(self.generated_tokens) >= self.max_new_tokens or (
            self.max_context is not None and len(self.all_token_ids) >= self.max_context
        )

    def append_token(self, token: int) -> None:
        """Record a sampled token and finish the request if a stop condition holds."""
        self.set_token(self.reserve_token(), token)

    def reserve_token(self) -> int:
        """Hold the place of a token still being sampled; returns its index in generated_tokens."""
        self.generated_tokens.append(PLACEHOLDER)
        self.all_token_ids.append(PLACEHOLDER)
        self.pending_tokens += 1
        self.status = RequestStatus.DECODING
        return len(self.generated_tokens) - 1

    def set_token(self, index: int, token: int) -> None:
        """Fill a reserved place; if the request stops there, later placeholders are dropped."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        self.generated_tokens[index] = token
        self.all_token_ids[len(self.prompt_ids) + index] = token
        self.pending_tokens -= 1
        count = index + 1
        if token in self.eos_token_ids and count >= self.min_new_tokens:
            self.finish(RequestStatus.FINISHED, "stop")
        elif count >= self.max_new_tokens:
            self.finish(RequestStatus.FINISHED, "length")
        elif self.max_context is not None and len(self.prompt_ids) + count >= self.max_context:
            self.finish(RequestStatus.FINISHED, "length")

    def drop_pending(self) -> None:
        """Forget placeholders whose steps will never be applied (the request has ended)."""
        if self.pending_tokens:
            del self.generated_tokens[-self.pending_tokens :]
            del self.all_token_ids[-self.pending_tokens :]
            self.pending_tokens = 0

    def soft_reset(self) -> None:
        """Forget the KV: generated tokens stay in `all_token_ids` and get recomputed."""
        self.num_computed_tokens = 0
        self.committed_tokens = 0  # its published blocks stay cached; its own count restarts
        self.status = RequestStatus.PREEMPTED
        self.soft_resets += 1

    def finish(self, status: RequestStatus, reason: str, error: str | None = None) -> None:
        self.drop_pending()
        self.status = status
        self.finish_reason = reason
        self.error = error
        self.finished_at = time.time()

    def to_output(self) -> GenerationOutput:
        """A snapshot for other threads. A streamed chunk (not final) carries only what is
        new since the previous one, and shares the prompt list instead of copying it: a long
        prompt streamed for many tokens would otherwise cost prompt x output memory."""
        known = self.known_tokens
        start, self.published_tokens = self.published_tokens, len(known)
        new = known[start:]
        delta, self.delta_text = self.delta_text, ""
        final = self.status.is_done
        logprobs, top = self.logprobs, self.top_logprobs
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids) if final else self.prompt_ids,
            generated_tokens=list(known) if final else new,
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            queued_at=self.queued_at,
            first_token_at=self.first_token_at,
            finished_at=self.finished_at,
            scheduled_at=self.scheduled_at,
            cached_tokens=self.cached_tokens,
            text=self.detokenizer.emitted if self.detokenizer is not None and final else None,
            new_tokens=new,
            delta_text=delta,
            logprobs=None if logprobs is None else list(logprobs) if final else logprobs[start:],
            top_logprobs=None if top is None else list(top) if final else top[start:],
            index=self.index,
            weight_version=self.weight_version,
            weight_versions=None if self.token_versions is None else list(self.token_versions) if final
            else self.token_versions[start:],
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
        )
