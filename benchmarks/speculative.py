"""Speculative decoding on the default model: off vs n-gram prompt lookup vs a draft model.

Two workloads, single stream and concurrent:
- repetitive: the model is asked to rewrite a paragraph with one word changed, or to repeat a
  code snippet with a small edit: the answer quotes its prompt, which prompt lookup finds;
- open-ended: chat questions whose answers do not repeat the prompt.
Greedy float32, up to `--new-tokens` (the chat's end-of-turn token ends a request, as it
would in use; the tokens are checked equal across systems). The draft model is the target's first
`--draft-layers` layers with its own final norm and head (an untrained early exit, LayerSkip-
style: same tokenizer, no download): what this machine has, not a tuned draft.

    .venv/bin/python benchmarks/speculative.py --repeats 3 --results-md benchmarks/RESULTS.md
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness as H  # noqa: E402
from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams  # noqa: E402

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every evening the "
    "keeper climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to "
    "put it out. Ships passed far below, and none of their sailors ever knew his name.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into sugar "
    "and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll.",
    "The train left the station at seven in the morning. It crossed three rivers and two mountain passes before "
    "it reached the coast, where the passengers stepped out into the warm afternoon air and walked down to the sea.",
    "Our library is open from nine to five on weekdays and from ten to two on Saturdays. Books may be borrowed for "
    "three weeks and renewed twice, online or at the front desk, unless another reader has reserved them.",
]
CODE = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        self.count += 1\n"
    "        return self.count\n\n    def reset(self):\n        self.count = 0\n",
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each.",
    "Describe a walk through a forest in autumn.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me some ideas for a birthday party for my grandmother.",
    "What should I pack for a week of camping in the mountains?",
    "Explain how a bicycle works.",
    "Tell me about the history of tea.",
]


def prompts(tok, workload: str, n: int) -> list[list[int]]:
    if workload == "repetitive":
        asks = [f"Rewrite this paragraph exactly, changing only the word \"{w}\" to \"{r}\":\n\n{p}"
                for p, (w, r) in zip(PARAGRAPHS, [("cliff", "hill"), ("leaves", "stems"), ("seven", "eight"),
                                                  ("nine", "eight")])]
        asks += [f"Repeat this Python code, renaming the variable `total` to `acc`:\n\n{c}" for c in CODE]
    else:
        asks = QUESTIONS
    asks = [asks[i % len(asks)] for i in range(n)]
    return [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for a in asks]


def early_exit_draft(model, layers: int):
    """The target's first `layers` decoder layers with its norm and head: a draft with the same tokenizer."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


def run(model, ps, new_tokens: int, spec: dict | None, concurrency: int, eos: int) -> H.Sample:
    config = ContinuousBatchingConfig(speculative_config=spec, max_requests_per_batch=concurrency)
    manager = ContinuousBatchingManager(model, GenerationConfig(do_sample=False, eos_token_id=eos), config)
    manager.start()
    try:
        start = time.perf_counter()
        ids = manager.add_requests(ps, sampling_params=SamplingParams(temperature=0, max_new_tokens=new_tokens))
        outs = [manager.get_result(r, timeout=None) for r in ids]
        wall = time.perf_counter() - start
        stats = manager.stats()
    finally:
        manager.stop(timeout=60)
    tokens = [o.generated_tokens for o in outs]
    drafted, accepted = stats.get("spec_decode_num_draft_tokens", 0), stats.get("spec_decode_num_accepted_tokens", 0)
    return H.Sample(wall, sum(map(len, tokens)), tokens,
                    {"drafted": drafted, "accepted": accepted, "steps": stats["steps"]})


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft-layers", type=int, default=6)
    p.add_argument("--systems", default="off,ngram,draft")
    p.add_argument("--workloads", default="repetitive,open-ended")
    p.add_argument("--modes", default="single,concurrent")
    H.add_model_args(p, dtype=None)
    H.add_common_args(p)
    args = H.parse(p)
    torch.manual_seed(0)
    model, tok = H.load(args.model)
    specs = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
             "draft": {"method": "draft_model", "model": early_exit_draft(model, args.draft_layers),
                       "num_speculative_tokens": args.k}}
    systems = args.systems.split(",")
    machine = H.machine_info()
    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    rows, report, blockers = [], {}, []
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            n = 1 if mode == "single" else args.concurrent
            ps = prompts(tok, workload, n)
            conc = 1 if mode == "single" else n
            runs = H.run_interleaved({s: (lambda s=s: run(model, ps, args.new_tokens, specs[s], conc, tok.eos_token_id))
                                      for s in systems},
                                     args.repeats, warmup=not args.no_warmup, between=H.cleanup)
            base = runs[systems[0]][0].tokens
            for s in systems:
                same = all(r.tokens == base for r in runs[s])
                if not same:
                    blockers.append(f"{workload}/{mode}/{s}: tokens differ from {systems[0]}")
                spread = H.Spread.of([r.tok_s for r in runs[s]])
                last = runs[s][-1].extra
                rate = last["accepted"] / last["drafted"] if last["drafted"] else None
                ref = H.Spread.of([r.tok_s for r in runs[systems[0]]])
                rows.append([workload, mode, s, spread.fmt(), H.fmt_ratio(H.ratio(spread, ref)),
                             f"{rate:.0%}" if rate is not None else "-",
                             f"{last['accepted'] / max(1, last['steps']):.2f}", "same" if same else "DIFFERENT"])
                report[f"{workload}/{mode}/{s}"] = {"tok_s": spread.as_dict(), **last}
    load = monitor.stop()
    md = "\n".join(H.report_header(f"speculative decoding (float32, k={args.k}, {args.new_tokens} new tokens, "
                                   f"draft = first {args.draft_layers} of {model.config.num_hidden_layers} layers)",
                                   machine, load)
                   + [H.md_table(["workload", "mode", "system", "tok/s median [min, max]", "vs off",
                                  "acceptance", "accepted/step", "tokens"], rows)])
    print(md)
    H.write_outputs(args, {"load": load, "rows": report}, md, blockers)


if __name__ == "__main__":
    main()
