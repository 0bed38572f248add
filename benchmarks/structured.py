"""Structured output on the default model: what a JSON schema costs per generated token.

Three measurements, in one process on a quiet machine:
- throughput: `--requests` (64) chat requests constrained by a JSON schema against the same
  requests free, interleaved and repeated (medians with spread). Greedy; each free request is
  given exactly the token count its constrained twin produced (`max_new_tokens`, EOS ignored),
  so both runs generate the same tokens per request and batches shrink alike: the ratio of
  tok/s is the cost per generated token (target: schema >= 0.9x free);
- the share of the constrained runs' step time spent filling and applying bitmasks;
- grammar compile time: the schema cold (a fresh compiler), then cached; and a large schema
  (40 properties with patterns) cold, as the worst case a request waits in the queue for.

    .venv/bin/python benchmarks/structured.py --repeats 3 --results-md benchmarks/RESULTS.md
    .venv/bin/python benchmarks/structured.py --requests 2 --new-tokens 8 --repeats 1 --no-warmup  # smoke
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness as H  # noqa: E402
from contbatch import ContinuousBatchingConfig, SamplingParams, StructuredOutput, continuous_batching  # noqa: E402
from contbatch.sampling.grammar import GrammarCompiler  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["novel", "poetry", "drama", "essay", "science", "history"]},
                   "minItems": 1, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "year", "genres", "rating", "in_print"],
}
LARGE = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},20}}[0-9]+$"}
                                          for i in range(40)}}
LARGE["required"] = list(LARGE["properties"])
TOPICS = ["a famous novel", "a book of poems", "a play", "a history book", "a science book", "an essay collection",
          "a children's book", "a detective story"]


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (number {i}) "
                                      "as JSON with title, year, genres, rating and in_print."}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def run(model, tok, ps, params: list[SamplingParams], out: dict | None = None) -> H.Sample:
    """Timed from submission to the last result (the manager's start-up is not counted)."""
    config = ContinuousBatchingConfig(max_requests_per_batch=len(ps), max_prompt_length=max(map(len, ps)),
                                      max_generated_length=max(p.max_new_tokens for p in params))
    with continuous_batching(model, config=config, tokenizer=tok) as m:
        core = m.core
        steps0, masks0 = core.step_seconds, core.runner.sampler.grammar_masks.seconds
        start = time.perf_counter()
        results = [m.get_result(r, timeout=None) for r in m.add_requests(ps, sampling_params=params)]
        wall = time.perf_counter() - start
        step_s = core.step_seconds - steps0
        mask_s = core.runner.sampler.grammar_masks.seconds - masks0
    tokens = [o.generated_tokens for o in results]
    if out is not None:
        out["texts"] = [o.text for o in results]
        out["reasons"] = [o.finish_reason for o in results]
    return H.Sample(wall, sum(map(len, tokens)), tokens, {"mask_share": mask_s / step_s if step_s else 0.0})


def compile_seconds(tok, vocab: int, schema: dict, cached: bool = False) -> float:
    compiler = GrammarCompiler(tok, vocab)
    spec = StructuredOutput(json=schema)
    if cached:
        compiler.compile(spec).result()
    start = time.perf_counter()
    compiler.compile(spec).result()
    return time.perf_counter() - start


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96, help="the constrained requests' budget")
    H.add_model_args(p)
    H.add_common_args(p)
    args = H.parse(p)
    torch.manual_seed(0)
    model, tok = H.load(args.model, args.dtype)
    vocab = model.get_input_embeddings().num_embeddings
    ps = prompts(tok, args.requests)
    spec = StructuredOutput(json=SCHEMA)
    constrained = [SamplingParams(temperature=0, max_new_tokens=args.new_tokens, structured_output=spec)] * len(ps)
    machine = H.machine_info()
    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    shape: dict = {}
    first = H.in_worker(lambda: run(model, tok, ps, constrained, shape))  # fixes each free request's length
    free = [SamplingParams(temperature=0, max_new_tokens=max(1, len(t)), ignore_eos=True) for t in first.tokens]
    runs = H.run_interleaved({"json schema": lambda: run(model, tok, ps, constrained),
                              "free": lambda: run(model, tok, ps, free)},
                             args.repeats, warmup=not args.no_warmup, between=H.cleanup)
    repeats = max(3, args.repeats)
    cold = statistics.median(H.in_worker(lambda: compile_seconds(tok, vocab, SCHEMA)) for _ in range(repeats))
    cached = statistics.median(H.in_worker(lambda: compile_seconds(tok, vocab, SCHEMA, True)) for _ in range(repeats))
    large = statistics.median(H.in_worker(lambda: compile_seconds(tok, vocab, LARGE)) for _ in range(repeats))
    load = monitor.stop()

    schema_s, free_s = (H.Spread.of([s.tok_s for s in runs[k]]) for k in ("json schema", "free"))
    share = H.Spread.of([s.extra["mask_share"] for s in runs["json schema"]])
    same = all(s.tokens == first.tokens for s in runs["json schema"])
    stops = sum(r == "stop" for r in shape["reasons"])
    rows = [["tok/s, json schema", schema_s.fmt()], ["tok/s, free (same token counts)", free_s.fmt()],
            ["json schema / free", H.fmt_ratio(H.ratio(schema_s, free_s))],
            ["share of step time in masks (fill + apply)", share.fmt(".3f")],
            ["compile, schema cold (ms)", f"{cold * 1e3:.1f}"],
            ["compile, schema cached (ms)", f"{cached * 1e3:.3f}"],
            ["compile, 40-pattern schema cold (ms)", f"{large * 1e3:.1f}"],
            ["outputs ended by the grammar", f"{stops}/{len(ps)}"],
            ["constrained greedy tokens identical across runs", str(same)]]
    md = "\n".join(H.report_header(f"Structured output ({args.dtype}, {args.requests} requests, JSON schema vs free, "
                                   f"~{statistics.mean(map(len, first.tokens)):.0f} tokens each)", machine, load)
                   + [H.md_table(["measure", "median [min, max]"], rows), "", f"Example: `{shape['texts'][0]}`"])
    print(md)
    H.write_outputs(args, {"load": load, "schema": schema_s.as_dict(), "free": free_s.as_dict(),
                           "mask_share": share.as_dict(), "compile_cold_s": cold,
                           "compile_cached_s": cached, "compile_large_cold_s": large, "identical": same}, md,
                    [] if same else ["constrained greedy tokens differ between runs"])


if __name__ == "__main__":
    main()
