"""Token checks: a system's speed is posted only if its greedy tokens are right.

At float32 the tokens every system must reproduce are those of `model.generate` on each prompt
alone (batch 1, no padding, EOS ignored), computed once per workload (`reference_tokens`);
`check_tokens` compares a run with them, and a row that differs shows `MISMATCH k/N`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .running import in_worker


def reference_tokens(model, prompts: Sequence[Sequence[int]], max_new: Sequence[int], pad_token_id=None,
                     log: Callable[[str], None] = print) -> list[list[int]]:
    """Greedy `model.generate` on each prompt alone (batch 1, no padding), EOS ignored: the
    tokens every system must reproduce at float32. Run in a worker thread like the systems."""
    import torch
    from transformers import GenerationConfig

    def go() -> list[list[int]]:
        out = []
        start = time.perf_counter()
        with torch.inference_mode():
            for p, n in zip(prompts, max_new):
                gc_ = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=-1,
                                       pad_token_id=pad_token_id)
                ids = torch.tensor([list(p)])
                res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
                out.append(res[0, ids.shape[1]:].tolist())
        log(f"   reference: model.generate on each of {len(prompts)} prompts alone, "
            f"{time.perf_counter() - start:.1f} s")
        return out

    return in_worker(go)


def check_tokens(tokens: Sequence[Sequence[int]] | None, ref: Sequence[Sequence[int]] | None) -> dict:
    """{'checked': bool, 'mismatch': k, 'n': N, 'first': index of the first differing request}"""
    if ref is None or tokens is None:
        return {"checked": False}
    bad = [i for i, (a, b) in enumerate(zip(tokens, ref)) if list(a) != list(b)]
    bad += list(range(min(len(tokens), len(ref)), max(len(tokens), len(ref))))
    return {"checked": True, "mismatch": len(bad), "n": len(ref), "first": bad[0] if bad else None}


def check_label(check: dict) -> str:
    if not check.get("checked"):
        return "not checked"
    return "ok" if check["mismatch"] == 0 else f"MISMATCH {check['mismatch']}/{check['n']}"


def worst_check(checks: Sequence[dict]) -> dict:
    """Over the repeats of one system: the run with the most mismatches speaks for all."""
    checked = [c for c in checks if c.get("checked")]
    return max(checked, key=lambda c: c["mismatch"]) if checked else {"checked": False}


def same_tokens(runs: Sequence[Sequence[Sequence[int]]]) -> bool:
    """Whether every run produced the first run's tokens (systems compared with each other)."""
    return all(list(map(list, r)) == list(map(list, runs[0])) for r in runs)
