"""Where the forward runs: the engine's thread against the main thread of a fresh process.

Each OpenMP pool is per thread; with two pools on two cores libgomp stops spinning between
parallel regions and every op of the forward pays a sleep and a wake-up. The engine releases
the starting thread's pool (`contbatch/engine/threads.py`); this benchmark shows what that
buys. The same plain forward of the default model (1 token and 64 tokens, float32) is timed:

- `main`: on the main thread of a fresh process (the target);
- `second-thread`: on a second thread after the main thread ran torch ops (our engine thread
  before the fix: the main thread always has, since it loaded the model);
- `engine`: on contbatch's own engine thread (inside a result handler) as started now;
- `engine-no-release`: the same with the release disabled (the old behaviour).

Every mode runs in its own fresh process, the modes interleaved, `--repeats` rounds; each
reports the median forward time and the voluntary context switches per forward (libgomp's
futex sleeps). Then one request of 256 new tokens end to end: contbatch (release on and off)
and plain `model.generate` on the main thread.

    python benchmarks/thread_forward.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import threading
import time
from pathlib import Path

import harness as H

MODES = ("main", "second-thread", "engine", "engine-no-release")
STREAM_MODES = ("stream-engine", "stream-engine-no-release", "stream-generate")


def _voluntary_switches() -> int:
    total = 0
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            with open(status) as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:
            pass
    return total


def _time_forward(model, tokens: int, n: int) -> tuple[float, float]:
    import torch

    ids = torch.arange(100, 100 + tokens)[None]
    with torch.inference_mode():
        for _ in range(3):
            model(ids)
        times, switches = [], 0
        for _ in range(n):
            s0, t0 = _voluntary_switches(), time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
            switches += _voluntary_switches() - s0
    return statistics.median(times) * 1e3, switches / n


def _measure(model, n: int) -> dict:
    one, sw1 = _time_forward(model, 1, n)
    many, sw64 = _time_forward(model, 64, max(3, n // 3))
    return {"1_token_ms": one, "64_tokens_ms": many, "switches_per_forward_1": sw1, "switches_per_forward_64": sw64}


def _on_engine_thread(model, fn, release: bool):
    """Run `fn` on contbatch's engine thread: inside a result handler, where the step loop runs."""
    import contbatch.engine.manager as manager_module
    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager

    if not release:
        manager_module.release_openmp_pool = lambda: False
    out: dict = {}
    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(block_size=64))
    manager.register_result_handler(lambda o: o.is_finished and out.setdefault("r", fn()))
    manager.start()
    rid = manager.add_request([1, 2, 3], max_new_tokens=1)
    manager.get_result(rid, timeout=600)
    manager.stop()
    return out["r"]


def child(mode: str, n: int) -> dict:
    import torch

    model, tok = H.load()  # the main thread runs torch ops here, as every user's does
    if mode == "main":
        return _measure(model, n)
    if mode == "second-thread":
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("r", _measure(model, n)))
        t.start()
        t.join()
        return box["r"]
    if mode in ("engine", "engine-no-release"):
        return _on_engine_thread(model, lambda: _measure(model, n), release=mode == "engine")
    # one stream, 256 new tokens, EOS ignored
    from transformers import GenerationConfig

    from contbatch import generate_batch

    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about the sea."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = GenerationConfig(max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=None)
    if mode == "stream-generate":
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            model.generate(ids, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False))
            t0 = time.perf_counter()
            out = model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
        return {"tok_s": (out.shape[1] - len(prompt)) / (time.perf_counter() - t0)}
    if mode == "stream-engine-no-release":
        import contbatch.engine.manager as manager_module

        manager_module.release_openmp_pool = lambda: False
    generate_batch(model, [prompt], GenerationConfig(max_new_tokens=8, do_sample=False), progress_bar=False)
    t0 = time.perf_counter()
    out = generate_batch(model, [prompt], gen, progress_bar=False)["req_0"]
    return {"tok_s": len(out.generated_tokens) / (time.perf_counter() - t0)}


def run_child(mode: str, n: int) -> dict:
    return H.run_child(None, ["--child", mode, "--n", n], script=str(Path(__file__).resolve()))


def print_table(table: dict[str, dict[str, H.Spread]], stream: bool) -> None:
    main_row = table["main"]
    rows = []
    for mode in MODES:
        one, many = table[mode]["1_token_ms"], table[mode]["64_tokens_ms"]
        ratio = (f"{one.median / main_row['1_token_ms'].median:.2f} / "
                 f"{many.median / main_row['64_tokens_ms'].median:.2f}")
        switches = (f"{table[mode]['switches_per_forward_1'].median:.1f} / "
                    f"{table[mode]['switches_per_forward_64'].median:.1f}")
        rows.append([mode, one.fmt(), many.fmt(), ratio, switches])
    print(H.md_table(["where", "1 token ms", "64 tokens ms", "vs main (1 / 64)", "switches per forward (1 / 64)"],
                     rows))
    if stream:
        print("\n" + H.md_table(["one request, 256 new tokens", "tok/s median [min, max]"],
                                [[mode, table[mode]["tok_s"].fmt()] for mode in STREAM_MODES]))


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=30, help="timed forwards of one token per process")
    p.add_argument("--no-stream", action="store_true", help="skip the end-to-end single-stream rows")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = H.parse(p)
    if args.child:
        H.emit(child(args.child, args.n))
        return
    modes = MODES + (() if args.no_stream else STREAM_MODES)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    load = H.LoadRange()
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else reversed(modes):  # interleaved, order alternating
            runs[mode].append(run_child(mode, args.n))
            load.sample()
    table = {mode: H.spreads(rows) for mode, rows in runs.items()}
    print(f"{load.line()} during the run; {args.repeats} interleaved rounds")
    print_table(table, not args.no_stream)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load.values, "runs": runs,
                       "table": {m: {k: v.as_dict() for k, v in t.items()} for m, t in table.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
