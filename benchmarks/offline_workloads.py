"""The workloads of `offline.py`: prompts cut from one text or wrapped in the chat template,
fixed or mixed output lengths.

A `Workload` is a list of prompts with each one's `max_new_tokens` (EOS ignored) and, at
float32, the reference tokens every system must reproduce. Prompts are cut at seeded offsets
from Python's pydoc topics (`harness.models.source_text`, ~113k tokens of the default model);
`chat` prompts wrap such a piece in the model's chat template with "Summarize the text above.".
Mixed lengths are drawn log-uniform from [lo, hi].
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import harness as H


@dataclass
class Workload:
    kind: str  # "fixed" or "mixed"
    source: str  # "text" or "chat"
    prompts: list[list[int]]
    max_new: list[int]
    reference: list[list[int]] | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.source}"

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def generated_tokens(self) -> int:
        return sum(self.max_new)

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        new = (f"{self.max_new[0]} new tokens each" if self.kind == "fixed" else
               f"max_new_tokens log-uniform {min(self.max_new)}..{max(self.max_new)} (mean {self.generated_tokens / len(self.max_new):.0f})")
        src = ("cut from one text (Python's pydoc topics)" if self.source == "text"
               else "built with the chat template around text cut from the same source")
        return (f"{len(self.prompts)} prompts {src}, {min(lens)}..{max(lens)} tokens ({self.prompt_tokens} in all), "
                f"{new}, EOS ignored; {self.generated_tokens} output tokens")


def cut_pieces(ids: list[int], n: int, lo: int, hi: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def make_prompts(tok, source: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{source}-{seed}")
    ids = tok(H.source_text())["input_ids"]
    if source == "text":
        return cut_pieces(ids, n, lo, hi, rng)
    out = []
    for piece in cut_pieces(ids, n, lo, hi, rng):
        msg = [{"role": "user", "content": tok.decode(piece) + "\n\nSummarize the text above."}]
        enc = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def make_new_tokens(kind: str, n: int, fixed: int, lo: int, hi: int, seed: int) -> list[int]:
    if kind == "fixed":
        return [fixed] * n
    rng = random.Random(f"mixed-{seed}")
    return [min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(n)]
