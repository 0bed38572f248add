"""Benchmark prompts, made from a tokenizer and a seed so every run sends the same ones.

Prompts are random token ids decoded to text (as vLLM's benchmark does), re-encoded and cut
so each holds the wanted number of tokens under this tokenizer; a server with another
tokenizer sees about the same length, and its own count comes back in `usage`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, by the benchmark's tokenizer
    output_len: int  # max_tokens to ask for


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _special_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def random_text(tokenizer, rng: random.Random, num_tokens: int) -> tuple[str, int]:
    """Text of about `num_tokens` tokens (exact under this tokenizer after one re-encode)."""
    if num_tokens <= 0:
        return "", 0
    special = _special_ids(tokenizer)
    vocab = len(tokenizer)
    ids = []
    while len(ids) < num_tokens:
        t = rng.randrange(vocab)
        if t not in special:
            ids.append(t)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    again = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    text = tokenizer.decode(again, skip_special_tokens=True)
    return text, len(again)


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[BenchRequest]:
    """Independent prompts; lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        text, n = random_text(tokenizer, rng, _lengths(rng, input_len, range_ratio))
        out.append(BenchRequest(text, n, _lengths(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(tokenizer, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                          output_len: int, seed: int) -> list[BenchRequest]:
    """`num_prefixes` long shared prefixes (system prompts, documents), each followed by a
    unique suffix: what a prefix cache is for. Requests are interleaved across prefixes."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefixes = [random_text(tokenizer, rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        prefix, plen = prefixes[i % num_prefixes]
        suffix, slen = random_text(tokenizer, rng, suffix_len)
        out.append(BenchRequest(prefix + " " + suffix, plen + slen, output_len))
    return out
