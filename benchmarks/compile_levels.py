"""Compile levels against eager on one long-lived manager: start-up seconds and throughput.

For each level (fresh process per level, levels alternating over `--repeats` rounds), one
manager on the default model is started (level >= 1 compiles while starting: the seconds are
reported) and then serves, one batch after another, 1, 4 and 16 requests of 16-216-token
prompts with `--new-tokens` each (greedy, EOS ignored); each batch runs twice and the second
run counts (a batch size the first run met for the first time may compile a new bucket).
Tokens are compared across levels. This is the measurement behind the CPU default level
(`runtime/compile.py`).

With `--cold`, each compiled run first starts on an empty Inductor cache (the cold start),
then again on the cache it filled (the warm start, a second process as after a restart);
`--trees a=/path,b=/path` compares source trees (each child imports contbatch from its tree).

    python benchmarks/compile_levels.py [--levels 0,1] [--new-tokens 128] [--repeats 2] [--cold]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import harness as H

CHILD = r'''
import json, sys, time, torch
from transformers import GenerationConfig
from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, load_model
level, new, sizes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
model, tok = load_model(dtype=torch.float32)
ids = tok.encode(open(sys.argv[4]).read())
gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
t0 = time.perf_counter()  # start-up: the manager's set-up (linear probe, cache) and its warm-up
m = ContinuousBatchingManager(model, gen, ContinuousBatchingConfig(default_compile_level=level))
m.start()
out = {"start_s": time.perf_counter() - t0, "tok_s": {}, "tokens": {}}
for n in sizes:
    prompts = [ids[i * 50: i * 50 + 16 + (i * 37) % 200] for i in range(n)]
    for _ in range(2):
        t0 = time.perf_counter()
        results = [m.get_result(r, timeout=3600) for r in [m.add_request(p) for p in prompts]]
        wall = time.perf_counter() - t0
    out["tok_s"][n] = n * new / wall
    out["tokens"][n] = [list(r.generated_tokens) for r in results]
out["compiles"] = m.stats()["compiles"]
m.stop()
print("RESULT " + json.dumps(out))
'''
TEXT = Path(__file__).resolve().parent / "README.md"  # the prompts are cut from it


def child(tree: str, level: int, args, sizes: list[int], cache: str | None) -> dict:
    return H.run_child(CHILD, [level, args.new_tokens, json.dumps(sizes), TEXT], tree=tree or None,
                       env={"TORCHINDUCTOR_CACHE_DIR": cache} if cache else None)


def one_run(tree: str, level: int, args, sizes: list[int]) -> dict:
    """A run of one level; with --cold a compiled level starts twice, on an empty cache and on
    the cache that start filled."""
    if not (args.cold and level > 0):
        return child(tree, level, args, sizes, None)
    with tempfile.TemporaryDirectory() as cache:
        cold = child(tree, level, args, sizes, cache)
        run = child(tree, level, args, sizes, cache)
    run["cold_start_s"] = cold["start_s"]
    return run


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--levels", default="0,1")
    p.add_argument("--sizes", default="1,4,16", help="requests per batch")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trees", default="", help="name=path,... : source trees to compare (default: the installed one)")
    p.add_argument("--cold", action="store_true",
                   help="each compiled run starts with an empty Inductor cache (cold), then starts again on it (warm)")
    args = H.parse(p)
    levels = H.comma_list(args.levels, int)
    sizes = H.comma_list(args.sizes, int)
    trees = H.parse_named(H.comma_list(args.trees)) if args.trees else {"": ""}
    systems = [(name, path, lv) for name, path in trees.items() for lv in levels]
    runs: dict[tuple, list[dict]] = {s: [] for s in systems}
    load = H.LoadRange()
    for _ in range(args.repeats):  # the levels alternate: every system once per round
        for system in systems:
            runs[system].append(one_run(system[1], system[2], args, sizes))
            load.sample()
    base = runs[systems[0]]
    rows = []
    for system in systems:
        rs = runs[system]
        cells = []
        for n in sizes:
            sp = H.Spread.of([r["tok_s"][str(n)] for r in rs])
            ratio = sp.median / H.Spread.of([r["tok_s"][str(n)] for r in base]).median
            cells.append(f"{sp.fmt()} ({ratio:.2f}x)")
        same = all(r["tokens"] == base[0]["tokens"] for r in rs)
        cold = [H.Spread.of([r.get("cold_start_s", r["start_s"]) for r in rs]).fmt()] if args.cold else []
        rows.append([system[0] or "installed", system[2], *cold, H.Spread.of([r["start_s"] for r in rs]).fmt(),
                     *cells, rs[-1]["compiles"], "identical" if same else "DIFFER"])
    print(f"{args.new_tokens} new tokens, {args.repeats} rounds, {load.line()}")
    print(H.md_table(["system", "level", *(["cold start s"] if args.cold else []), "start-up s",
                      *[f"{n} req tok/s" for n in sizes], "compiles", "tokens vs first"], rows,
                     [False, True, *([True] if args.cold else []), True, *[True] * len(sizes), True, False]))


if __name__ == "__main__":
    main()
