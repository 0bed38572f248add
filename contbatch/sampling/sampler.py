"""Token choice for a whole step at once: every request its own parameters, one batch.

Each processor runs only over the rows that use it, as tensor operations over those rows (no
Python loop per token; a loop per request only to collect its parameters and token history,
and to draw seeded noise). Structured-output masks come first (`grammar.py`: one batched
bitmask); the rest follow `transformers`' definitions and order, so that each matches its
`LogitsProcessor` namesake: logit bias, repetition penalty, presence and frequency penalties,
min-new-tokens, then temperature, top-k, top-p, min-p.

Sampling is an exponential race, `argmax(p / E)` with `E ~ Exp(1)`, which draws from `p`
exactly. A seeded request draws its noise from a generator keyed by (seed, position), so its
tokens do not depend on what shares its batches, on chunking, or on preemption.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..cpu.ops import argmax_rows
from ..faults import inject
from .grammar import GrammarMasks, GrammarState
from .params import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_ids: list[int]
    generated: list[int]
    stop_ids: frozenset[int]  # masked while fewer than min_new_tokens are generated
    grammar: GrammarState | None = None  # structured output: the row's matcher


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [S]
    logprobs: torch.Tensor | None = None  # [S]: chosen tokens
    top_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]
    ok: torch.Tensor | None = None  # [S] bool: the chosen token's logit was finite (else the row's logits were NaN/inf)
    # Speculative verification (`verify.py`): each request's accepted run, drafts then the
    # target's own token, padded; `tokens` is then each run's last token.
    run_tokens: torch.Tensor | None = None  # [S, K + 1]
    run_lengths: torch.Tensor | None = None  # [S]: 1 + accepted drafts
    run_logprobs: torch.Tensor | None = None  # [S, K + 1], where logprobs are wanted


def _dev(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a device tensor without stalling the host: a copy from pageable memory
    first waits for the GPU stream to drain, which would undo async batching's overlap."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) and dtype is not None else torch.as_tensor(data, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _rows(reqs: list[SampleRequest], pred) -> list[int]:
    return [i for i, r in enumerate(reqs) if pred(r)]


def _padded(seqs: list[list[int]], pad: int, device) -> torch.Tensor:
    """Rows of token ids padded with `pad`, filled in bulk (a long prompt costs one copy, not
    a Python loop over its tokens)."""
    width = max(1, max(len(s) for s in seqs))
    out = np.full((len(seqs), width), pad, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = seq
    return _dev(torch.from_numpy(out), device)


def _cat_rows(parts: list[tuple[int, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column ids) for per-row id tensors, concatenated: one tensor op per step,
    whatever the number of ids (no Python loop per token)."""
    rows = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids in parts])
    cols = torch.cat([ids for _, ids in parts])
    return _dev(rows, device), _dev(cols, device)


def apply_logit_bias(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    parts = [(i, r.params.logit_bias_tensors) for i, r in enumerate(reqs) if r.params.logit_bias]
    if not parts:
        return
    rows, cols = _cat_rows([(i, ids) for i, (ids, _) in parts], logits.device)
    vals = _dev(torch.cat([v for _, (_, v) in parts]), logits.device, logits.dtype)
    keep = cols < logits.shape[1]
    logits.index_put_((rows[keep], cols[keep]), vals[keep], accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    """Like `RepetitionPenaltyLogitsProcessor`, over prompt and generated tokens."""
    rows = _rows(reqs, lambda r: r.params.repetition_penalty != 1.0)
    if not rows:
        return
    vocab = logits.shape[1]
    ids = _padded([reqs[i].prompt_ids + reqs[i].generated for i in rows], vocab, logits.device)
    penalty = _dev([reqs[i].params.repetition_penalty for i in rows], logits.device, torch.float32)[:, None]
    rows = _dev(rows, logits.device, torch.long)
    sub = torch.cat([logits[rows], torch.zeros(len(rows), 1, device=logits.device)], dim=1)
    score = sub.gather(1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    sub.scatter_(1, ids, score)
    logits[rows] = sub[:, :vocab]


def apply_presence_frequency(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    """OpenAI semantics, over generated tokens: minus frequency * count, minus presence if seen."""
    rows = _rows(reqs, lambda r: (r.params.presence_penalty or r.params.frequency_penalty) and r.generated)
    if not rows:
        return
    vocab = logits.shape[1]
    ids = _padded([reqs[i].generated for i in rows], vocab, logits.device)
    counts = torch.zeros(len(rows), vocab + 1, device=logits.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=logits.device))
    counts = counts[:, :vocab]
    freq = _dev([reqs[i].params.frequency_penalty for i in rows], logits.device, torch.float32)[:, None]
    pres = _dev([reqs[i].params.presence_penalty for i in rows], logits.device, torch.float32)[:, None]
    logits[_dev(rows, logits.device, torch.long)] -= freq * counts + pres * (counts > 0)


@functools.lru_cache(maxsize=4096)
def _ids(ids: frozenset[int]) -> torch.Tensor:
    """A request's stop ids as a tensor, built once per distinct set (frozensets hash once)."""
    return torch.tensor(sorted(ids), dtype=torch.long)


def apply_min_new_tokens(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    # A grammar decides where its output ends: masking its stop tokens could leave no token.
    parts = [(i, _ids(r.stop_ids)) for i, r in enumerate(reqs)
             if len(r.generated) < r.params.min_new_tokens and r.stop_ids and r.grammar is None]
    if not parts:
        return
    rows, cols = _cat_rows(parts, logits.device)
    keep = cols < logits.shape[1]
    logits[rows[keep], cols[keep]] = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, kmax: int | None = None) -> torch.Tensor:
    """Like `TopKLogitsWarper`, per row; k <= 0 keeps every token. `kmax`, the largest k,
    saves a device sync when the caller knows it."""
    k = top_k.clamp(max=logits.shape[1])
    kmax = min(kmax, logits.shape[1]) if kmax is not None else int(k.max())
    if kmax <= 0:
        return logits
    kth = logits.topk(kmax, dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Like `TopPLogitsWarper`, per row; p = 1 keeps every token."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p[:, None])
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Like `MinPLogitsWarper`, per row; min_p = 0 keeps every token."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)  # always keep the best token
    return logits.masked_fill(remove, float("-inf"))


def warp(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for rows that sample; each only where some row uses it."""
    device = logits.device
    # Which warpers run is decided from the host-side parameters: no device sync.
    logits = logits / _dev([r.params.temperature for r in reqs], device, torch.float32)[:, None]
    top_k = [r.params.top_k for r in reqs]
    if max(top_k) > 0:
        logits = apply_top_k(logits, _dev(top_k, device, torch.long), max(top_k))
    top_p = [r.params.top_p for r in reqs]
    if min(top_p) < 1:
        logits = apply_top_p(logits, _dev(top_p, device, torch.float32))
    min_p = [r.params.min_p for r in reqs]
    if max(min_p) > 0:
        logits = apply_min_p(logits, _dev(min_p, device, torch.float32))
    return logits


_UNIFORM_SALT = 0x5EED_5BEC


def _finite_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Whether each row's chosen logit is finite. A NaN anywhere in a row wins its argmax (and
    spoils its softmax), so one gather finds a broken row without a pass over the vocabulary."""
    return logits.gather(1, tokens[:, None])[:, 0].isfinite()


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = torch.Generator()
        if seed is not None:
            self._rng.manual_seed(seed)
        else:
            self._rng.seed()
        self.grammar_masks = GrammarMasks()

    def _noise(self, reqs: list[SampleRequest], vocab: int, device) -> torch.Tensor:
        noise = torch.empty(len(reqs), vocab).exponential_(generator=self._rng)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed((r.params.seed * 1_000_003 + len(r.generated)) % 2**63)
                noise[i] = torch.empty(vocab).exponential_(generator=g)
        return noise.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else noise

    def uniforms(self, reqs: list[SampleRequest], device) -> torch.Tensor:
        """One U[0, 1) draw per row, for speculative acceptance; a seeded row draws from its
        own (seed, position) stream, apart from the exponential noise of `_noise`."""
        u = torch.rand(len(reqs), generator=self._rng)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed((r.params.seed * 1_000_003 + len(r.generated) + 7_919) % 2**63 ^ _UNIFORM_SALT)
                u[i] = torch.rand(1, generator=g)[0]
        return _dev(u, device)

    def sample_states(self, logits: torch.Tensor, states) -> SampleResult:
        """Sample for engine request states (`params`, `prompt_ids`, `known_tokens`,
        `eos_token_ids`, `grammar`); plain greedy rows, the common case, skip building any history."""
        inject("sampler")
        if all(s.params.plain_greedy for s in states):
            tokens = argmax_rows(logits)
            return SampleResult(tokens, ok=_finite_at(logits, tokens))
        return self(logits, [SampleRequest(s.params, s.prompt_ids, s.known_tokens, s.eos_token_ids, s.grammar)
                             for s in states])

    def process(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
        """The processors that move a row's logits before any choice, in `transformers`'
        order, on a float32 copy: grammar masks, logit bias, penalties, min-new-tokens."""
        logits = logits.float()
        self.grammar_masks.apply(logits, reqs)
        apply_logit_bias(logits, reqs)
        apply_repetition_penalty(logits, reqs)
        apply_presence_frequency(logits, reqs)
        apply_min_new_tokens(logits, reqs)
        return logits

    def __call__(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> SampleResult:
        logits = self.process(logits, reqs)
        tokens = argmax_rows(logits)
        final = logits
        sample_rows = _rows(reqs, lambda r: not r.params.greedy)
        if sample_rows:
            sub_reqs = [reqs[i] for i in sample_rows]
            idx = _dev(sample_rows, logits.device, torch.long)
            warped = warp(logits[idx], sub_reqs)
            probs = torch.softmax(warped, dim=-1)
            tokens[idx] = argmax_rows(probs / self._noise(sub_reqs, logits.shape[1], logits.device))
            final = logits.clone()
            final[idx] = warped

        result = SampleResult(tokens, ok=_finite_at(final, tokens))
        if any(r.params.wants_logprobs for r in reqs):
            logprobs = torch.log_softmax(final, dim=-1)
            result.logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
            k = max(r.params.top_logprobs for r in reqs)
            if k:
                result.top_logprobs, result.top_ids = logprobs.topk(k, dim=-1)
        return result
