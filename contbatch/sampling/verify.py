"""Speculative verification: which proposed tokens a step accepts, for a whole step at once.

A request with k proposed tokens `d1..dk` ran k + 1 query rows (its last known token, then the
proposals), so the step holds the target model's logits for every position of the run. Row j
is processed exactly as a normal step would process that position (its history includes
`d1..dj`), then:
- greedy: `dj+1` is accepted while it equals row j's argmax; the run ends with the argmax of
  the first row that disagrees (or of the last row): the tokens `generate` would produce;
- sampled: `dj+1` is accepted with probability p_j(dj+1) (a proposer is deterministic: its
  distribution is a point mass, so min(1, p/q) = p); at the first rejection the run ends with
  a draw from p_j without `dj+1`, renormalised; with every proposal accepted it ends with a
  draw from p_k. The output is distributed exactly as the target's (Leviathan et al., 2023),
  and a seeded request draws every uniform and noise from its (seed, position) streams, so its
  tokens do not depend on the batch.

Rows are laid out request after request, k_i + 1 each; everything runs as tensor operations
over padded `[S, K + 1]` views (no Python loop per token).
"""

from __future__ import annotations

import torch

from ..cpu.ops import argmax_rows
from .sampler import SampleRequest, SampleResult, Sampler, _dev, _finite_at, warp


def verify(sampler: Sampler, logits: torch.Tensor, states, drafts: list[list[int]]) -> SampleResult:
    """`logits`: [sum(k_i + 1), V], request after request; `states` the S requests (engine
    states: `params`, `prompt_ids`, `known_tokens`, `eos_token_ids`, `grammar`)."""
    device = logits.device
    counts = [len(d) for d in drafts]
    width = max(counts) + 1
    reqs: list[SampleRequest] = []
    for state, draft in zip(states, drafts):
        known = state.known_tokens
        reqs.extend(SampleRequest(state.params, state.prompt_ids, known + draft[:j], state.eos_token_ids, state.grammar)
                    for j in range(len(draft) + 1))
    # Padded views: row_of[i, j] is request i's row j (clamped to its last row past k_i).
    starts = torch.cumsum(torch.tensor([0] + [c + 1 for c in counts[:-1]], dtype=torch.long), 0)
    k = torch.tensor(counts, dtype=torch.long)
    j = torch.arange(width)
    row_of = _dev(starts[:, None] + torch.minimum(j[None, :], k[:, None]), device)
    j, k = _dev(j, device), _dev(k, device)
    draft_pad = torch.full((len(drafts), width), -1, dtype=torch.long)
    for i, d in enumerate(drafts):
        draft_pad[i, : len(d)] = torch.tensor(d, dtype=torch.long)
    # Column j holds the proposal row j is asked to confirm: d_{j+1} (-1 where there is none).
    draft_pad = _dev(draft_pad, device)
    valid = j[None, :] < k[:, None]

    plain = all(r.params.plain_greedy for r in reqs)
    final = logits.float() if plain else sampler.process(logits, reqs)
    target = argmax_rows(final)
    accept = target[row_of] == draft_pad
    chosen = target.clone()

    sample_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if sample_rows:
        idx = _dev(sample_rows, device, torch.long)
        sub = [reqs[i] for i in sample_rows]
        warped = warp(final[idx], sub)
        probs = torch.softmax(warped, dim=-1)
        # The proposal row r must confirm, per row: d_{j+1}, or -1 for a run's last row.
        next_draft = torch.full((final.shape[0],), -1, dtype=torch.long, device=device)
        next_draft[row_of[valid]] = draft_pad[valid]
        proposed = next_draft[idx]
        has = proposed >= 0
        p_proposed = torch.where(has, probs.gather(1, proposed.clamp(min=0)[:, None])[:, 0], torch.zeros_like(probs[:, 0]))
        accepted_row = sampler.uniforms(sub, device) < p_proposed
        # A rejected proposal leaves the run: the residual distribution is p without it.
        residual = probs.scatter(1, proposed.clamp(min=0)[:, None], 0.0)
        residual = torch.where(has[:, None], residual, probs)
        chosen[idx] = argmax_rows(residual / sampler._noise(sub, final.shape[1], device))
        row_accept = torch.zeros(final.shape[0], dtype=torch.bool, device=device)
        row_accept[idx] = accepted_row
        sampled_req = torch.zeros(final.shape[0], dtype=torch.bool, device=device)
        sampled_req[idx] = True
        accept = torch.where(sampled_req[row_of], row_accept[row_of], accept)
        final = final.clone()
        final[idx] = warped
    accept &= valid
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of accepted proposals
    last_row = row_of.gather(1, accepted[:, None])[:, 0]
    last = chosen[last_row]
    run = torch.where(j[None, :] < accepted[:, None], draft_pad, last[:, None])
    result = SampleResult(last, ok=_finite_at(final[last_row], last))
    result.run_tokens, result.run_lengths = run, accepted + 1
    if any(r.params.wants_logprobs for r in reqs):
        logprobs = torch.log_softmax(final, dim=-1)
        result.run_logprobs = logprobs[row_of, run.clamp(min=0)]
        result.logprobs = result.run_logprobs.gather(1, accepted[:, None])[:, 0]
        top = max(r.params.top_logprobs for r in reqs)
        if top:  # only requests that never propose ask for these: their one row is their last
            result.top_logprobs, result.top_ids = logprobs[last_row].topk(top, dim=-1)
    return result
