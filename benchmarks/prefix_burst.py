"""A burst sharing a system prompt: does the prefix get computed once or once per request?

64 chat requests share a ~300-token system prompt and are submitted at once, so they are
admitted in the same steps. Without `hold_shared_prefixes`, every one computes the shared
blocks itself (nothing is cached yet when they are admitted); with it, the requests whose next
block another request is computing wait a step and find it cached. Reported per setting:
prefix-cache hit rate, TTFT p50/p90, total time and output tok/s; the settings interleaved,
`--repeats` rounds, medians with [min, max].

    python benchmarks/prefix_burst.py [--repeats 3] [--block-size 16] [--json out.json]
"""

from __future__ import annotations

import json
import time

import harness as H

SYSTEM = (
    "You are a careful assistant for a public library. You answer questions about opening hours, "
    "borrowing rules, late fees, room bookings, printing, the catalogue, interlibrary loans, events "
    "for children and adults, accessibility, and volunteering. Be brief and polite, give exact figures "
    "when you know them, and say when you do not. Never invent a policy. "
)


def workload(tok, n: int, system_tokens: int) -> list[list[int]]:
    system = SYSTEM
    while len(tok.encode(system)) < system_tokens:
        system += SYSTEM
    questions = [f"Question {i}: how do I {verb} {thing}?" for i, (verb, thing) in enumerate(
        (v, t) for v in ("renew", "return", "reserve", "find", "pay for", "print", "book", "request")
        for t in ("a book", "a film", "a room", "a laptop", "a map", "a magazine", "an e-book", "a game"))][:n]
    return [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for q in questions]


def run_once(model, prompts, hold: bool, block_size: int, new_tokens: int) -> dict:
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig, continuous_batching

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    config = ContinuousBatchingConfig(block_size=block_size, hold_shared_prefixes=hold,
                                      max_requests_per_batch=len(prompts))
    t0 = time.perf_counter()
    with continuous_batching(model, gen, config) as m:
        ids = m.add_requests(prompts)
        outs = [m.get_result(rid, timeout=3600) for rid in ids]
        stats = m.stats()
    wall = time.perf_counter() - t0
    ttft = sorted(o.first_token_at - o.queued_at for o in outs)
    return {
        "hit_rate": stats["prefix_cache_hits"] / sum(len(p) for p in prompts),
        "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[int(len(ttft) * 0.9)],
        "wall_s": wall, "tok_s": sum(len(o.generated_tokens) for o in outs) / wall,
        "tokens": [o.generated_tokens for o in outs],
    }


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = H.parse(p)

    model, tok = H.load()
    prompts = workload(tok, args.requests, args.system_tokens)
    run_once(model, prompts[:4], True, args.block_size, 2)  # warm-up, the same for both settings
    runs: dict[bool, list[dict]] = {False: [], True: []}
    load = H.LoadRange()
    for _, hold in H.rounds([False, True], args.repeats):  # interleaved, the first setting alternating
        runs[hold].append(run_once(model, prompts, hold, args.block_size, args.new_tokens))
        load.sample()
    same = all(a["tokens"] == runs[False][0]["tokens"] for a in runs[False] + runs[True])
    print(f"{args.requests} requests, ~{len(prompts[0])}-token prompts sharing a {args.system_tokens}-token system "
          f"prompt, {args.new_tokens} new tokens, block_size {args.block_size}; {load.line()}; "
          f"greedy tokens identical across settings: {same}")
    keys = ("hit_rate", "ttft_p50", "ttft_p90", "wall_s", "tok_s")
    summary = {hold: H.spreads([{k: r[k] for k in keys} for r in runs[hold]]) for hold in (False, True)}
    print(H.md_table(["hold_shared_prefixes", "prefix-cache hit rate", "TTFT p50 s", "TTFT p90 s", "wall s",
                      "output tok/s"],
                     [[str(hold), *[summary[hold][k].fmt(".3g" if k == "hit_rate" else ".2f") for k in keys]]
                      for hold in (False, True)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load.values, "identical": same,
                       "summary": {str(h): {k: v.as_dict() for k, v in s.items()} for h, s in summary.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
