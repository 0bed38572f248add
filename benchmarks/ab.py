"""A/B of two source trees (or two settings) on one offline workload, interleaved.

For "did this change slow anything down": each run is a fresh process importing contbatch from
the tree given (`PYTHONPATH`), on the default model (or `--model`, a local folder or GGUF file),
the same prompts (64 cut from one text, 16-256 tokens or `--prompt-tokens` each, 64 new tokens
each, EOS ignored, greedy), warmed up the same way; the systems alternate, `--repeats` rounds,
and each row reports its median tok/s with [min, max], the load average, and whether every
system's tokens equal the first one's.

    git worktree add /tmp/before <commit>
    python benchmarks/ab.py before=/tmp/before after=. --dtype float32 --repeats 3
    python benchmarks/ab.py eager=. compiled=.:--compile-level=1   # same tree, two settings
    python benchmarks/ab.py now=. mkl=.:--cpu-kernel-overrides='{"linear":"aten"}' gather=.:--decode-fast-path=false
    python benchmarks/ab.py glibc=. tcmalloc=.:--env=LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    python benchmarks/ab.py before=/tmp/before after=. --model benchmarks/peers/.work/models/qwen2.5-0.5b-shape

Options after a tree are `ContinuousBatchingConfig` fields, dashes for underscores
(`--compile-level` is `default_compile_level`); values are parsed as JSON where they can be.
`--env=NAME=VALUE` sets an environment variable of that system's processes instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness as H

CHILD = r'''
import json, sys, time, torch
from transformers import GenerationConfig
import contbatch
from contbatch import ContinuousBatchingConfig, generate_batch, load_model
dtype, n, new, kw = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
model_path = sys.argv[6]  # "" for the embedded model
for path in ("decode_compile_config", "varlen_compile_config"):  # given as JSON objects
    if isinstance(kw.get(path), dict):
        from transformers import CompileConfig
        kw[path] = CompileConfig(**kw[path])
model, tok = load_model(model_path or None, dtype=getattr(torch, dtype))
ids = tok.encode(open(sys.argv[5]).read())
length = int(sys.argv[7])  # 0: 16-256 tokens
if length:  # the text over and over, each prompt from its own offset
    ids = ids * (length // len(ids) + 2)
prompts = [ids[(i * 997) % (len(ids) - max(300, length)):][: length or 16 + (i * 53) % 241] for i in range(n)]
gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
t0 = time.perf_counter()
generate_batch(model, prompts[:4], GenerationConfig(max_new_tokens=4, do_sample=False), progress_bar=False,
               config=ContinuousBatchingConfig(**kw))
warm = time.perf_counter() - t0
t0 = time.perf_counter()
out = generate_batch(model, prompts, gen, progress_bar=False, config=ContinuousBatchingConfig(**kw))
wall = time.perf_counter() - t0
tokens = [out[f"req_{i}"].generated_tokens for i in range(n)]
print("RESULT " + json.dumps({"tok_s": sum(map(len, tokens)) / wall, "warm_s": warm, "tokens": tokens,
                              "src": contbatch.__file__}))
'''
TEXT = Path(__file__).resolve().parents[1] / "README.md"  # the prompts are cut from it


def config_kwargs(extra: dict) -> dict:
    kw = {}
    for opt, raw in extra.items():
        name = opt.lstrip("-").replace("-", "_")
        name = "default_compile_level" if name == "compile_level" else name
        try:
            kw[name] = json.loads(raw)
        except json.JSONDecodeError:
            kw[name] = raw
    return kw


def parse_systems(specs: list[str]) -> dict[str, tuple[str, dict]]:
    """name=tree[:--option=value ...] -> {name: (tree, {--option: value})}"""
    systems = {}
    for name, rest in H.parse_named(specs).items():
        tree, *opts = rest.split(":--")  # options may hold JSON (with colons) of their own
        systems[name] = (tree, dict(("--" + o).split("=", 1) for o in opts))
    return systems


def run(tree: str, extra: dict, args) -> dict:
    extra = dict(extra)
    env = dict([extra.pop("--env").split("=", 1)]) if "--env" in extra else None
    return H.run_child(CHILD, [args.dtype, args.prompts, args.new_tokens, json.dumps(config_kwargs(extra)), TEXT,
                              str(Path(args.model).resolve()) if args.model else "", args.prompt_tokens],
                       tree=tree, env=env)


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("systems", nargs="+", help="name=tree[:--option=value ...], e.g. b=.:--compile-level=1")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=0, help="every prompt this long (default: 16-256 tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="", help="a local HF folder or .gguf file (default: the embedded model)")
    p.add_argument("--json", default=None)
    args = H.parse(p)
    systems = parse_systems(args.systems)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    load = H.LoadRange()
    for _, name in H.rounds(list(systems), args.repeats):  # who goes first rotates each round
        runs[name].append(run(*systems[name], args))
        load.sample()
    names = list(systems)
    first = runs[names[0]][0]["tokens"]
    lengths = f"{args.prompt_tokens}-token" if args.prompt_tokens else "16-256-token"
    print(f"{args.model or 'default model'}: {args.prompts} {lengths} prompts, {args.new_tokens} new tokens, "
          f"{args.dtype}, {args.repeats} interleaved rounds, "
          f"{load.line()}, {load.elapsed_s:.0f} s")
    base = H.Spread.of([r["tok_s"] for r in runs[names[0]]])
    rows = []
    for name in names:
        tps = H.Spread.of([r["tok_s"] for r in runs[name]])
        warm = H.Spread.of([r["warm_s"] for r in runs[name]])
        same = all(r["tokens"] == first for r in runs[name])
        rows.append([name, tps.fmt(), H.fmt_ratio(H.ratio(tps, base)), f"{warm.median:.1f}",
                     "identical" if same else "DIFFER", runs[name][0]["src"]])
    print(H.md_table(["system", "tok/s median [min, max]", f"vs {names[0]}", "warm-up s", "tokens", "contbatch from"],
                     rows, [False, True, True, True, False, False]))
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load.values, "runs": {
            k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
