"""What the engine core asks of a speculative proposer (`speculative/speculator.py`'s
`Speculator` is the one there is): the core calls it and never builds it, so the package that
builds proposals on this one's step machinery (a draft model's steps) stays above it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ..requests import RequestState


class Proposer(Protocol):
    def propose(self, states: Iterable[RequestState]) -> None:
        """Set the running requests' `draft_tokens` for the next step (none where it does not propose)."""

    def record(self, state: RequestState, proposed: int, accepted: int) -> None:
        """A verification step's outcome for one request."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's cache)."""

    def stats(self) -> dict:
        """Counters merged into the engine's stats."""
