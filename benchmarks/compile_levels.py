"""Compile levels against eager on one long-lived manager: start-up seconds and throughput.

For each level (fresh process per level, levels alternating over `--repeats` rounds), one
manager on the default model is started (level >= 1 compiles while starting: the seconds are
reported) and then serves, one batch after another, 1, 4 and 16 requests of 16-216-token
prompts with `--new-tokens` each (greedy, EOS ignored); each batch runs twice and the second
run counts (a batch size the first run met for the first time may compile a new bucket).
Tokens are compared across levels. This is the measurement behind the CPU default level
(`engine/compile.py`).

    python benchmarks/compile_levels.py [--levels 0,1] [--new-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time, torch
from transformers import GenerationConfig
from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, load_model
level, new, sizes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
model, tok = load_model(dtype=torch.float32)
ids = tok.encode(open(sys.argv[4]).read())
gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
m = ContinuousBatchingManager(model, gen, ContinuousBatchingConfig(default_compile_level=level))
t0 = time.perf_counter()
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="0,1")
    p.add_argument("--sizes", default="1,4,16", help="requests per batch")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    sizes = [int(v) for v in args.sizes.split(",")]
    text = __file__.replace("compile_levels.py", "README.md")
    runs: dict[int, list[dict]] = {lv: [] for lv in levels}
    for _ in range(args.repeats):
        for lv in levels:
            done = subprocess.run([sys.executable, "-c", CHILD, str(lv), str(args.new_tokens), json.dumps(sizes), text],
                                  capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            runs[lv].append(json.loads(line[7:]))
    base = levels[0]
    print(f"| level | start-up s | " + " | ".join(f"{n} req tok/s" for n in sizes) + " | compiles | tokens vs level "
          f"{base} |")
    print("|---:|---:|" + "---:|" * len(sizes) + "---:|---|")
    for lv in levels:
        rs = runs[lv]
        cells = []
        for n in sizes:
            vals = [r["tok_s"][str(n)] for r in rs]
            ratio = statistics.median(vals) / statistics.median([r["tok_s"][str(n)] for r in runs[base]])
            cells.append(f"{statistics.median(vals):.1f} [{min(vals):.1f}, {max(vals):.1f}] ({ratio:.2f}x)")
        same = all(r["tokens"] == runs[base][0]["tokens"] for r in rs)
        starts = [r["start_s"] for r in rs]
        print(f"| {lv} | {statistics.median(starts):.1f} [{min(starts):.1f}, {max(starts):.1f}] | " + " | ".join(cells)
              + f" | {rs[-1]['compiles']} | {'identical' if same else 'DIFFER'} |")


if __name__ == "__main__":
    main()
