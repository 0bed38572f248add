"""Which requests propose this step, how many tokens, and what the counters say afterwards.

A request proposes only where verification keeps its outputs exact and cheap: it opted in
(`SamplingParams.speculative`, on by default), it is decoding (its last token is the only
one to compute), and its processors do not read the history a proposal would change
(repetition, presence and frequency penalties, a grammar, min-new-tokens not yet met, top
logprobs). k never takes it past `max_new_tokens` or its context. A request whose recent
acceptance falls below `min_acceptance_rate` pauses (8 steps, doubling up to
`max_pause_steps`): text that does not repeat itself is then decoded at plain speed. And
proposals stop where a step would pass `max_step_rows` rows: past the point where a step is
bound by reading the weights, verifying proposals costs compute that rejections waste. A
draft model's round costs k draft steps whoever proposes, so when its acceptance over all
requests falls below the floor, every request pauses (8 steps, doubling).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..requests import RequestState, RequestStatus
from ..config import SpeculativeConfig
from .ngram import propose_ngram

FIRST_PAUSE = 8
EMA_WEIGHT = 0.5  # of the latest verification step in a request's acceptance average
DRAFT_EMA_WEIGHT = 0.1  # of one request's verification in the draft model's average over all


def eligible(state: RequestState) -> bool:
    p = state.params
    return (
        p is not None
        and p.speculative
        and state.grammar is None
        and p.repetition_penalty in (None, 1.0)
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.top_logprobs
        and len(state.generated_tokens) >= p.min_new_tokens
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None) -> None:
        self.config = config
        self.draft = draft  # DraftProposer for method "draft_model"
        self.proposals = 0  # verification steps with at least one proposed token
        self.draft_tokens = 0
        self.accepted_tokens = 0
        # A draft model costs its k steps whoever proposes: when its acceptance over every
        # request falls below the floor, the whole round pauses (8 steps, doubling).
        self.rate, self.pause, self.backoff = 1.0, 0, FIRST_PAUSE
        self.paused_steps = 0

    def budget(self, state: RequestState) -> int:
        """Tokens this request may propose now (0: none)."""
        if state.status != RequestStatus.DECODING or state.remaining_tokens != 1 or state.pending_tokens:
            return 0
        if not eligible(state):
            return 0
        if state.spec_pause > 0:
            state.spec_pause -= 1
            return 0
        k = min(self.config.num_speculative_tokens, state.max_new_tokens - len(state.generated_tokens) - 1)
        if state.max_context is not None:
            k = min(k, state.max_context - len(state.all_token_ids))
        return max(0, k)

    def propose(self, states: Iterable[RequestState]) -> None:
        """Set `draft_tokens` on the requests that propose this step (and clear the others':
        a proposal the scheduler had no room for last step is stale now), oldest first, within
        the step's row budget."""
        states = sorted(states, key=lambda s: s.arrival)
        if self.pause > 0:  # a draft model that keeps missing: nobody proposes for now
            self.pause -= 1
            self.paused_steps += 1
            for state in states:
                state.draft_tokens = []
            return
        rows_left = self.config.max_step_rows - sum(s.status == RequestStatus.DECODING for s in states)
        cfg, wanted = self.config, []
        for state in states:
            state.draft_tokens = []
            k = min(self.budget(state), rows_left)
            if k <= 0:
                continue
            if self.draft is not None:  # a draft model runs k steps: the rows are taken now
                wanted.append((state, k))
                rows_left -= k
            else:
                tokens = np.asarray(state.all_token_ids, dtype=np.int64)
                state.draft_tokens = propose_ngram(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
                rows_left -= len(state.draft_tokens)
        if wanted:
            for (state, _), draft in zip(wanted, self.draft.propose(wanted)):
                state.draft_tokens = draft

    def record(self, state: RequestState, proposed: int, accepted: int) -> None:
        """After a verification step: counters, and the back-off of a request that misses."""
        self.proposals += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        state.spec_draft_tokens += proposed
        state.spec_accepted_tokens += accepted
        state.spec_rate = (1 - EMA_WEIGHT) * state.spec_rate + EMA_WEIGHT * accepted / proposed
        if state.spec_rate < self.config.min_acceptance_rate:
            state.spec_pause = state.spec_backoff
            state.spec_backoff = min(2 * state.spec_backoff, self.config.max_pause_steps)
            state.spec_rate = 1.0  # a fresh chance after the pause
        if self.draft is not None:
            self.rate = (1 - DRAFT_EMA_WEIGHT) * self.rate + DRAFT_EMA_WEIGHT * accepted / proposed
            if self.rate < self.config.min_acceptance_rate:
                self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.config.max_pause_steps)
                self.rate = 1.0

    def forget(self, request_id: str) -> None:
        """The request has ended: a draft model's shadow of it goes."""
        if self.draft is not None:
            self.draft.forget(request_id)

    def close(self) -> None:
        """The engine stops: a draft model given by the user gets its attention back."""
        if self.draft is not None:
            self.draft.detach()

    def stats(self) -> dict:
        return {
            "spec_decode_num_drafts": self.proposals,
            "spec_decode_num_draft_tokens": self.draft_tokens,
            "spec_decode_num_accepted_tokens": self.accepted_tokens,
            "spec_decode_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "spec_decode_draft_seconds": self.draft.seconds if self.draft is not None else 0.0,
            "spec_decode_paused_steps": self.paused_steps,
        }


def make_speculator(config: SpeculativeConfig, resolved, draft_model=None) -> Speculator:
    """The engine's speculator; a draft model (method "draft_model": `draft_model` loaded,
    setup/loading.py's `load_draft`) gets its own paged cache and runner."""
    draft = None
    if config.method == "draft_model":
        from .draft import DraftProposer

        draft = DraftProposer(config, draft_model, resolved)
    return Speculator(config, draft)
