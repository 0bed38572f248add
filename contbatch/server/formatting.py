"""OpenAI response bodies: choices, stream chunks, logprobs and usage, as plain dicts.

Plain dicts rather than pydantic response models: they are built per token while streaming,
and `json.dumps` of a dict is the cheapest correct thing there.

JSON has no infinities or NaN. A token that top-k/top-p/min-p masked has logprob -inf: it is
left out of `top_logprobs`, and every logprob shown is floored at `LOGPROB_FLOOR` (vLLM's
convention). Bodies are encoded with `allow_nan=False`, so a NaN that slips through fails
loudly (`NonFiniteNumber`, answered as an error) instead of being sent as invalid JSON.
"""

from __future__ import annotations

import json
import math

LOGPROB_FLOOR = -9999.0  # vLLM's: the logprob shown for anything less likely, -inf included


class NonFiniteNumber(ValueError):
    """A body held NaN or an infinity: a bug upstream, never to be sent as JSON."""


def dumps(payload: dict) -> str:
    """Strict, compact JSON: NaN and infinities raise `NonFiniteNumber`."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as exc:
        raise NonFiniteNumber(f"the response holds a non-finite number ({exc})") from None


def floored(logprob: float) -> float:
    """`logprob`, or the floor for anything below it (-inf); NaN stays NaN, for `dumps` to catch."""
    return LOGPROB_FLOOR if logprob < LOGPROB_FLOOR else float(logprob)


def _listed(top: dict[int, float]) -> list[tuple[int, float]]:
    """Top alternatives worth listing: a masked token (-inf) was never a candidate."""
    return [(tid, floored(v)) for tid, v in top.items() if v != -math.inf]


class TokenText:
    """A token's own text, for logprobs (cached: the same tokens recur constantly)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """`cached_tokens`: prompt tokens the engine found in its prefix cache when it first
    scheduled the request (sample 0 of each prompt: later samples share its blocks anyway)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(
    text_of: TokenText, tokens: list[int], logprobs: list[float], top: list[dict[int, float]] | None, offset: int
) -> dict:
    """Completions' legacy shape: parallel lists; `top_logprobs` maps token text to logprob,
    the k most likely plus the chosen token (as OpenAI and vLLM do)."""
    strs = [text_of(t) for t in tokens]
    offsets = []
    for s in strs:
        offsets.append(offset)
        offset += len(s)
    chosen = [floored(lp) for lp in logprobs]
    tops = []
    for i, lp in enumerate(chosen):
        entry = {text_of(tid): v for tid, v in (_listed(top[i]) if top else ())}
        entry.setdefault(strs[i], lp)
        tops.append(entry)
    return {"tokens": strs, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(text_of: TokenText, tokens: list[int], logprobs: list[float],
                  top: list[dict[int, float]] | None) -> dict:
    """Chat's shape: one entry per token with its text, bytes and the k most likely."""

    def item(tid: int, lp: float) -> dict:
        s = text_of(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        row = item(t, floored(lp))
        row["top_logprobs"] = [item(tid, v) for tid, v in _listed(top[i])] if top else []
        content.append(row)
    return {"content": content}


def finish_reason(reason: str | None) -> str | None:
    """The engine's reasons are OpenAI's, except a cancelled request (its client is gone)."""
    return "abort" if reason == "cancelled" else reason


def sse(payload: dict | str) -> str:
    """One server-sent event; a dict is encoded by `dumps` (NaN raises `NonFiniteNumber`)."""
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {data}\n\n"
