"""The shared-system-prompt TTFT workload of `serve.py --compare --workload ttft-prefix`.

For each system-prompt length (30, 100, 300 and 1000 tokens by default) a pass sends, to one
server: one priming request (the system prompt and a user suffix: it puts the prompt in the
server's prefix cache, untimed), then `lone` requests one at a time, then `concurrent`
requests at once, every one the same system prompt followed by its own short user suffix.
It reports the time to first token (p50, p99) of the lone and of the concurrent requests: how
much of a shared prompt each server reuses, and how its first tokens fare under a burst.

Every pass draws fresh texts (seeded by the pass number), so a later round never finds its
whole prompts cached from an earlier one: only the system prompt is shared, as in a chat
service.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

PREFIX_LENS = (30, 100, 300, 1000)


@dataclass(frozen=True)
class TtftPlan:
    prefix_lens: tuple[int, ...] = PREFIX_LENS
    lone: int = 8  # requests one at a time after the priming one
    concurrent: int = 32  # requests sent at once
    suffix_len: int = 8  # tokens of each request's own user text
    output_len: int = 4  # max_tokens of each (TTFT needs one; a few show it streams)

    def __post_init__(self) -> None:
        if not self.prefix_lens or min(self.prefix_lens) < 1 or self.lone < 1 or self.concurrent < 1:
            raise ValueError(f"a TTFT plan needs prefix lengths >= 1 and at least one request of each kind: {self}")


def level_names(plan: TtftPlan) -> list[str]:
    return [f"prefix {n}: {kind}" for n in plan.prefix_lens for kind in ("lone", f"{plan.concurrent} concurrent")]


def build(tokenizer, plan: TtftPlan, seed: int) -> dict[int, tuple[list, list, list]]:
    """prefix length -> (priming, lone, concurrent) lists of `BenchRequest`s."""
    from contbatch.bench.datasets import BenchRequest, random_text

    rng = random.Random(seed)
    out = {}
    for n in plan.prefix_lens:
        system, _ = random_text(tokenizer, rng, n)

        def req(system: str = system) -> BenchRequest:
            user, _ = random_text(tokenizer, rng, plan.suffix_len)
            prompt = system + "\n" + user
            return BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), plan.output_len)

        out[n] = ([req()], [req() for _ in range(plan.lone)], [req() for _ in range(plan.concurrent)])
    return out


def run_pass(endpoint, tokenizer, plan: TtftPlan, seed: int, timeout: float) -> dict[str, dict]:
    """One server, every prefix length: level name -> `level_stats` (TTFT p50/p99 among them)."""
    from contbatch.bench.report import level_stats
    from contbatch.bench.runner import Load, run_level

    out = {}
    for n, (prime, lone, burst) in build(tokenizer, plan, seed).items():
        asyncio.run(run_level(endpoint, prime, Load(max_concurrency=1), seed, timeout, progress=False))
        for kind, reqs, load in (("lone", lone, Load(max_concurrency=1)),
                                 (f"{plan.concurrent} concurrent", burst, Load(max_concurrency=plan.concurrent))):
            results, duration = asyncio.run(run_level(endpoint, reqs, load, seed, timeout, progress=False))
            out[f"prefix {n}: {kind}"] = level_stats(load, results, duration)
    return out
