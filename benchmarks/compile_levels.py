"""Compile levels against eager on one long-lived manager: start-up seconds and throughput.

For each level (fresh process per level, levels alternating over `--repeats` rounds), one
manager on the default model is started (level >= 1 compiles while starting: the seconds are
reported) and then serves, one batch after another, 1, 4 and 16 requests of 16-216-token
prompts with `--new-tokens` each (greedy, EOS ignored); each batch runs twice and the second
run counts (a batch size the first run met for the first time may compile a new bucket).
Tokens are compared across levels. This is the measurement behind the CPU default level
(`engine/compile.py`).

With `--cold`, each compiled run first starts on an empty Inductor cache (the cold start),
then again on the cache it filled (the warm start, a second process as after a restart);
`--trees a=/path,b=/path` compares source trees (each child imports contbatch from its tree).

    python benchmarks/compile_levels.py [--levels 0,1] [--new-tokens 128] [--repeats 2] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

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


def _child(tree: str, level: int, new: int, sizes: list[int], text: str, cache: str | None) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    done = subprocess.run([sys.executable, "-c", CHILD, str(level), str(new), json.dumps(sizes), text],
                          capture_output=True, text=True, check=True, env=env, cwd="/")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="0,1")
    p.add_argument("--sizes", default="1,4,16", help="requests per batch")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trees", default="", help="name=path,... : source trees to compare (default: the installed one)")
    p.add_argument("--cold", action="store_true",
                   help="each compiled run starts with an empty Inductor cache (cold), then starts again on it (warm)")
    args = p.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    sizes = [int(v) for v in args.sizes.split(",")]
    text = __file__.replace("compile_levels.py", "README.md")
    trees = [t.split("=", 1) for t in args.trees.split(",")] if args.trees else [["", ""]]
    systems = [(name, path, lv) for name, path in trees for lv in levels]
    runs: dict[tuple, list[dict]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for system in systems:
            name, path, lv = system
            if args.cold and lv > 0:
                with tempfile.TemporaryDirectory() as cache:
                    cold = _child(path, lv, args.new_tokens, sizes, text, cache)
                    run = _child(path, lv, args.new_tokens, sizes, text, cache)
                run["cold_start_s"] = cold["start_s"]
            else:
                run = _child(path, lv, args.new_tokens, sizes, text, None)
            runs[system].append(run)
    base = systems[0]
    print("| system | level | " + ("cold start s | " if args.cold else "") + "start-up s | "
          + " | ".join(f"{n} req tok/s" for n in sizes) + " | compiles | tokens vs first |")
    print("|---|---:|" + ("---:|" if args.cold else "") + "---:|" + "---:|" * len(sizes) + "---:|---|")
    for system in systems:
        rs = runs[system]
        cells = []
        for n in sizes:
            vals = [r["tok_s"][str(n)] for r in rs]
            ratio = statistics.median(vals) / statistics.median([r["tok_s"][str(n)] for r in runs[base]])
            cells.append(f"{statistics.median(vals):.1f} [{min(vals):.1f}, {max(vals):.1f}] ({ratio:.2f}x)")
        same = all(r["tokens"] == runs[base][0]["tokens"] for r in rs)
        starts = [r["start_s"] for r in rs]
        colds = [r.get("cold_start_s", r["start_s"]) for r in rs]
        cold = f"{statistics.median(colds):.1f} [{min(colds):.1f}, {max(colds):.1f}] | " if args.cold else ""
        print(f"| {system[0] or 'installed'} | {system[2]} | {cold}{statistics.median(starts):.1f} [{min(starts):.1f}, "
              f"{max(starts):.1f}] | " + " | ".join(cells) + f" | {rs[-1]['compiles']} | "
              f"{'identical' if same else 'DIFFER'} |")


if __name__ == "__main__":
    main()
