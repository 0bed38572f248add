"""GPU check of contbatch's GPU path in one run: exactness, throughput against transformers, and
decode time against the memory-bandwidth floor: the project's GPU validation. Run it through
benchmarks/gpu_check.sh (which installs the wheels in .whl/ and runs each part in its own
process); `--smoke --device cpu` runs every part at tiny sizes on a CPU.

Parts, each under its own time budget and try/except, results written after every run:
 1. exactness: float32 greedy output == `model.generate`, on SmolLM2-135M's architecture (random
    weights) and a tiny Qwen3, across attention backends and decode fast path / CUDA graphs /
    async batching on and off, block sizes 16 and 256, chunked prefill;
 2. offline throughput in bf16 (SmolLM2 arch and a ~1B Llama, 64 and 256 requests) against
    transformers' `model.generate_batch`, each row's tokens counted and the first prompts'
    compared with bf16 `model.generate`;
 3. decode step time at batch 64 against (weights + KV bytes) / measured copy bandwidth, and the
    GPU busy fraction with async batching on and off.
Every promised row must be verified: an exactness row not PASS (a skipped one included), a
throughput row skipped, short of its tokens, or (contbatch) whose bf16 tokens disagree with
`model.generate` on the same GPU beyond a near-tie, all fail. Exit status: 0, or 1 if anything
failed or any part crashed (after everything ran); `--merge` re-checks every row from the JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_report as R  # noqa: E402  (first: its clock starts the log's timestamps)
import harness as H  # noqa: E402
from gpu_check_report import PART_FILE, T0, Report, log  # noqa: E402

# torch, transformers, contbatch and the helpers that use them: imported in load(), so that
# `--merge` (run after both parts) starts in a fraction of a second.
torch = transformers = M = X = None


def load() -> None:
    global torch, transformers, M, X
    import torch
    import transformers

    import gpu_check_models as M
    import gpu_check_runs as X


# Budgets: the python's own, each ~25 s inside the shell's timeout of its part (gpu_check.sh).
FULL = dict(exact_n=12, exact_lo=5, exact_hi=200, exact_new=24, exact_mbt=64, exact_blocks=(16, 256),
            tp_requests=(64, 256), tp_prompt=512, tp_new=128, tp_mbt=8192, warm_n=8, warm_prompt=64, warm_new=16,
            bf16_ref_n=2, bw_bytes=2 * 2**30, exact_budget_s=125, tp_budget_s=175, exact_run_s=50, cb_run_s=60,
            tf_run_s=75, min_left_s=15)
SMOKE = dict(exact_n=4, exact_lo=5, exact_hi=40, exact_new=6, exact_mbt=16, exact_blocks=(16,),
             tp_requests=(4, 8), tp_prompt=32, tp_new=8, tp_mbt=256, warm_n=2, warm_prompt=8, warm_new=2,
             bf16_ref_n=2, bw_bytes=64 * 2**20, exact_budget_s=200, tp_budget_s=250, exact_run_s=30, cb_run_s=30,
             tf_run_s=30, min_left_s=5)
# Deliberately skip the exactness row of this index (0-based): the check must then fail. Tests use
# it to prove that a skipped row is never a pass.
SKIP_ROW_ENV = "GPU_CHECK_SKIP_ROW"


def left(s: dict) -> float:
    """Seconds left in the running part's budget."""
    return s["part_end"] - time.time()


def exact_combos(flat: str) -> list[dict]:
    out = [dict(attention_backend="torch")]
    for fast in (False, True):
        for graph in (False, True):
            for asy in (False, True):
                out.append(dict(attention_backend=flat, decode_fast_path=fast, use_cuda_graph=graph,
                                use_async_batching=asy))
    return out


def config_mismatch(requested: dict, block_size: int, resolved: dict) -> list[str]:
    diffs = [f"{k}: asked {v}, ran {resolved.get(k)}" for k, v in requested.items() if resolved.get(k) != v]
    if resolved.get("block_size") != block_size:
        diffs.append(f"block_size: asked {block_size}, ran {resolved.get('block_size')}")
    return diffs


def judge(row: dict, r: dict, req: dict, bs: int, ref: list, margins: list, prompts: list, cuda: bool) -> None:
    """PASS: every prompt's tokens equal the reference, no request failed, and (on the GPU) what
    ran is what was asked for; a fallback off the GPU is expected and only noted."""
    row.update(resolved=r["resolved"], stats=r["stats"], wall_s=r["e2e_s"])
    equal = [a == b for a, b in zip(r["tokens"], ref)]
    row["matched"] = sum(equal)
    bad = [i for i, ok in enumerate(equal) if not ok]
    if bad:
        i, got = bad[0], r["tokens"][bad[0]]
        pos = next((j for j, (a, b) in enumerate(zip(got, ref[i])) if a != b), min(len(got), len(ref[i])))
        m = margins[i][pos] if pos < len(margins[i]) else None
        row["notes"].append(f"prompts {bad} differ; prompt {i} (len {len(prompts[i])}) first at token {pos} "
                            f"(reference top-2 logit margin there: {'-' if m is None else format(m, '.2e')})")
    row["notes"] += r["errors"]
    mismatch = config_mismatch(req, bs, r["resolved"])
    if mismatch:
        row["notes"].append(("NOT AS REQUESTED: " if cuda else "fallback (expected off-GPU): ") + "; ".join(mismatch))
    row["notes"] += [f"warning: {w}" for w in r["resolved"].get("warnings", [])]
    if r["resolved"].get("use_cuda_graph") and cuda and not r["stats"].get("graph_replays"):
        row["notes"].append("graphs on but no replay counted"
                            + (" (stat missing)" if "graph_replays" in r["missing_stats"] else ""))
    ok = row["matched"] == len(prompts) and not r["errors"] and not (cuda and mismatch)
    row["status"] = "PASS" if ok else "FAIL"


def part_exactness(args, s: dict, rep: Report) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true float32
    torch.backends.cudnn.allow_tf32 = False
    rows: list[dict] = []
    rep.data["exactness"] = {"rows": rows, "summary": "running"}
    rep.data["exact_init_range"] = M.EXACTNESS_INIT_RANGE
    cases = {}
    for name in ("smollm2", "qwen3tiny"):
        log(f"exactness: building {M.LABELS[name]} in float32")
        model = M.build_model(name, torch.float32, args.device, args.smoke, seed=1,
                              initializer_range=M.EXACTNESS_INIT_RANGE)
        prompts = X.random_prompts(s["exact_n"], s["exact_lo"], s["exact_hi"], model.config.vocab_size, seed=2)
        ref, margins = X.reference_generate(model, prompts, s["exact_new"])
        low = min(min(m) for m in margins)
        log(f"exactness: reference for {name}: {sum(map(len, ref))} tokens, smallest top-2 logit margin {low:.2e}")
        cases[name] = (model, prompts, ref, margins)
    rep.data["exactness"]["promised"] = len(s["exact_blocks"]) * len(cases) * len(exact_combos(args.flat_backend))
    stuck = False
    skip_row = int(os.environ.get(SKIP_ROW_ENV, "-1"))
    for bs in s["exact_blocks"]:
        for name, (model, prompts, ref, margins) in cases.items():
            for req in exact_combos(args.flat_backend):
                row = {"model": name, "block_size": bs, "requested": req, "n_prompts": len(prompts), "notes": []}
                rows.append(row)
                if left(s) < 5 or stuck or len(rows) - 1 == skip_row:
                    row["status"] = "SKIPPED"
                    row["notes"].append("a timed-out run is still on the device" if stuck else "time budget spent"
                                        if len(rows) - 1 != skip_row else f"skipped on request ({SKIP_ROW_ENV})")
                    rep.write()
                    continue
                nb = X.blocks_needed(prompts, s["exact_new"], bs) + 8
                try:
                    r = X.run_contbatch(model, prompts, s["exact_new"], args.device, min(s["exact_run_s"], left(s)),
                                        block_size=bs, max_batch_tokens=s["exact_mbt"], num_blocks=nb, **req)
                except Exception as e:  # noqa: BLE001
                    row.update(status="ERROR", notes=[repr(e)[:300]])
                    log(f"exactness {name} bs={bs} {req}: ERROR {e!r}")
                    stuck = isinstance(e, X.RunTimeout) and e.still_running
                    rep.write()
                    X.free_memory(args.device)
                    continue
                judge(row, r, req, bs, ref, margins, prompts, args.device.startswith("cuda"))
                v = r["resolved"]
                log(f"exactness {name:9} bs={bs:3} {req} -> {row['status']} {row['matched']}/{len(prompts)} "
                    f"ran {v['attention_backend']} fast={v['decode_fast_path']} graphs={v['use_cuda_graph']} "
                    f"async={v['use_async_batching']} layout={v['kv_layout']} ({r['e2e_s']:.1f}s)"
                    + ("".join(f"\n    {n}" for n in row["notes"]) if row["notes"] else ""))
                rep.write()
                X.free_memory(args.device)
    del cases
    X.free_memory(args.device)
    counts = {k: sum(r["status"] == k for r in rows) for k in ("PASS", "FAIL", "ERROR", "SKIPPED")}
    rep.data["exactness"]["summary"] = ", ".join(f"{v} {k}" for k, v in counts.items())
    if counts["FAIL"] or counts["ERROR"] or counts["SKIPPED"]:  # a row not verified is not a pass
        rep.failed = True
    log(f"exactness: {rep.data['exactness']['summary']}")


def update_ratios(rows: list[dict]) -> None:
    """Every contbatch row against the transformers row of the same model and request count."""
    for x in rows:
        tf = next((t for t in rows if t["system"] == "tf" and t["model"] == x["model"]
                   and t["requests"] == x["requests"] and t.get("tok_s_e2e")), None)
        if x["system"].startswith("contbatch") and x.get("tok_s_e2e") and tf:
            x["vs_tf_e2e"] = x["tok_s_e2e"] / tf["tok_s_e2e"]
            x["vs_tf_gen"] = x["tok_s_gen"] / tf["tok_s_gen"] if x.get("tok_s_gen") and tf.get("tok_s_gen") else None


def part_throughput(args, s: dict, rep: Report) -> None:
    dtype = torch.bfloat16
    rows: list[dict] = []
    tp = rep.data["throughput"] = {"rows": rows, "tf_attn": X.tf_attention(), "params": {}}
    models = {}
    for name in ("llama1b", "smollm2"):
        log(f"throughput: building {M.LABELS[name]} in bf16 ({M.describe_config(name, args.smoke)})")
        model = M.build_model(name, dtype, args.device, args.smoke, seed=3)
        nbytes = {"weight_bytes": M.weight_bytes_per_decode_step(model),
                  "kv_bytes_per_token": M.kv_bytes_per_token(model)}
        tp["params"][name] = M.n_params(model)
        log(f"throughput: {name}: {M.n_params(model) / 1e9:.3f}B parameters, {nbytes['weight_bytes'] / 1e9:.3f} GB "
            f"read per decode step, {nbytes['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token")
        models[name] = (model, nbytes)
    mbt, new, plen = s["tp_mbt"], s["tp_new"], s["tp_prompt"]
    # On the GPU contbatch runs its defaults ("auto"); a CPU would pick the torch backend, which has
    # no decode-only stats, so smoke runs take the flat backend to exercise part 3's arithmetic.
    base = {} if args.device.startswith("cuda") else {"attention_backend": args.flat_backend}

    def cache_blocks(n: int) -> int:  # the same generous explicit cache for both systems
        return 2 * n * -(-(plen + new) // 256) + 8

    for name, (model, _) in models.items():  # warm-ups: kernels compiled, allocator and handles primed
        vocab = model.config.vocab_size
        wp = X.random_prompts(s["warm_n"], s["warm_prompt"], s["warm_prompt"], vocab, seed=4)
        cap = max(5.0, min(s["tf_run_s"], left(s) - 5))
        for system, fn in (("contbatch", lambda: X.run_contbatch(model, wp, s["warm_new"], args.device, cap,
                                                                  max_batch_tokens=mbt, num_blocks=64, **base)),
                           ("tf", lambda: X.run_transformers_cb(model, wp, s["warm_new"], args.device, cap, mbt, 64))):
            try:
                r = fn()
                log(f"warm-up {name} {system}: {r['e2e_s']:.1f}s")
            except Exception as e:  # noqa: BLE001
                rep.error(f"warm-up {name} {system}", e)
                if isinstance(e, X.RunTimeout) and e.still_running:
                    return
            X.free_memory(args.device)
    r64, r256 = s["tp_requests"]
    plan = [("llama1b", r64, "contbatch", {}), ("llama1b", r64, "tf", None),
            ("llama1b", r64, "contbatch async off", {"use_async_batching": False}),
            ("smollm2", r64, "contbatch", {}), ("smollm2", r64, "tf", None),
            ("llama1b", r256, "contbatch", {}), ("smollm2", r256, "contbatch", {}),
            ("llama1b", r256, "tf", None), ("smollm2", r256, "tf", None)]
    tp["promised"] = len(plan)
    refs: dict = {}  # (model, requests) -> bf16 `model.generate` of the first prompts, with margins
    stuck = False
    for name, n, system, extra in plan:
        model, nbytes = models[name]
        row = {"model": name, "requests": n, "system": system, "prompt_len": plen, "new_tokens": new,
               "model_bytes": nbytes, "notes": []}
        rows.append(row)
        budget = min(s["tf_run_s"] if extra is None else s["cb_run_s"], left(s) - 5)
        if stuck or budget < s["min_left_s"]:
            why = "a previous run is still on the device" if stuck else "time budget spent"
            row.update(status="SKIPPED", notes=[why])
            rep.failed = True  # a promised row that was not measured and checked is not a pass
            rep.write()
            continue
        prompts = X.random_prompts(n, plen, plen, model.config.vocab_size, seed=10 + n)
        if (name, n) not in refs:  # the same GPU, the same bf16 weights: what each row's tokens must equal
            try:
                refs[name, n] = X.with_deadline(lambda: X.reference_generate(model, prompts[:s["bf16_ref_n"]], new),
                                                budget)
            except Exception as e:  # noqa: BLE001
                row.update(status="ERROR", notes=[f"bf16 reference: {e!r}"[:300]])
                stuck = isinstance(e, X.RunTimeout) and e.still_running
                rep.failed = True
                rep.write()
                continue
            budget = min(budget, left(s) - 5)
        # At 64 requests a second batch follows in the same manager: part 3's steady-state numbers.
        second = X.random_prompts(n, plen, plen, model.config.vocab_size, seed=20 + n) if n == r64 else None
        try:
            if extra is None:
                r = X.run_transformers_cb(model, prompts, new, args.device, budget, mbt, cache_blocks(n))
                row["notes"].append(r["attn"])
            else:
                r = X.run_contbatch(model, prompts, new, args.device, budget, second=second, max_batch_tokens=mbt,
                                    num_blocks=cache_blocks(n), **base, **extra)
                v = r["resolved"]
                row.update(stats=r["stats"], missing_stats=r["missing_stats"], resolved=v, warm=r["warm"])
                if r["warm"] and (r["warm"]["errors"] or r["warm"]["output_tokens"] != n * new):
                    row["notes"].append(f"second batch: {r['warm']['output_tokens']} of {n * new} tokens; "
                                        + "; ".join(r["warm"]["errors"])[:200])
                row["notes"].append(f"ran {v['attention_backend']} fast={v['decode_fast_path']} "
                                    f"graphs={v['use_cuda_graph']} async={v['use_async_batching']} "
                                    f"blocks={v['num_blocks']}x{v['block_size']} "
                                    f"mbt={v['max_batch_tokens']} steps={int(r['stats']['steps'])}")
                row["notes"] += [f"warning: {w}" for w in v.get("warnings", [])]
        except Exception as e:  # noqa: BLE001
            row.update(status="ERROR", notes=[repr(e)[:300]])
            log(f"throughput {name} n={n} {system}: ERROR {e!r}")
            stuck = isinstance(e, X.RunTimeout) and e.still_running
            rep.failed = True
            rep.write()
            X.free_memory(args.device)
            continue
        expected = n * new
        row.update(e2e_s=r["e2e_s"], gen_s=r["gen_s"], peak_gib=r["peak_gib"], output_tokens=r["output_tokens"],
                   tok_s_e2e=r["output_tokens"] / r["e2e_s"],
                   tok_s_gen=r["output_tokens"] / r["gen_s"] if r["gen_s"] else None)
        ref, margins = refs[name, n]
        check = X.agreement(r["tokens"], ref, margins, X.BF16_NEAR_TIE)
        row["tokens_checked"] = {"output_tokens": r["output_tokens"], "expected": expected,
                                 "bf16_vs_generate": check}
        row["notes"].append(f"bf16 vs generate: {check['tokens_compared']} tokens of {check['prompts']} prompts, "
                            + ("agree" if check["ok"] else "DIFFER")
                            + (f" ({len(check['near_ties'])} near-tie divergences)" if check["near_ties"] else ""))
        # transformers' own agreement is recorded, not required: the check verifies contbatch.
        agrees = check["ok"] or extra is None
        row["status"] = "ok" if r["output_tokens"] == expected and not r["errors"] and agrees else "BAD OUTPUT"
        if row["status"] != "ok":
            rep.failed = True
            row["notes"].append(f"{r['output_tokens']} of {expected} tokens; {'; '.join(r['errors'])[:200]}; "
                                f"bf16 vs generate: {'; '.join(check['mismatches'])[:200]}")
        if extra is not None:
            bw = (rep.data.get("bandwidth") or {}).get("bytes_per_s")
            row["decode"] = R.decode_floor(row, bw)
            if row.get("warm"):
                row["decode_warm"] = R.decode_floor({**row, "stats": row["warm"]["stats"],
                                                     "gen_s": row["warm"]["gen_s"]}, bw)
        update_ratios(rows)
        d = row.get("decode_warm") or row.get("decode") or {}
        log(f"throughput {name} n={n} {system}: {row['status']} e2e {r['e2e_s']:.2f}s ({row['tok_s_e2e']:.0f} tok/s), "
            f"gen {R._f(r['gen_s'])}s ({R._f(row['tok_s_gen'], '.0f')} tok/s)"
            + (f", vs tf {row['vs_tf_e2e']:.2f}x e2e" if row.get("vs_tf_e2e") else "")
            + (f", decode step {d['step_s'] * 1e3:.3f} ms, floor/step {R._f(d.get('floor_over_step'))}"
               if d.get("step_s") else "")
            + (f", busy {R._f(d.get('busy_fraction'), '.1%')}" if d else "") + f"; {'; '.join(row['notes'])}")
        rep.write()
        X.free_memory(args.device)


def main() -> int:
    p = H.parser(__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for a CPU): checks the script, measures nothing")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or "out/gpu_check"))
    p.add_argument("--parts", default="exact,throughput",
                   help="comma list of: exact, throughput. One part alone writes gpu_part_<part>.json (see --merge)")
    p.add_argument("--merge", action="store_true", help="only combine gpu_part_*.json into gpu_results.{json,md}")
    p.add_argument("--flat-backend", help="backend of the exactness matrix (default: triton on cuda, reference on cpu)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    args = H.parse(p)
    if args.merge:
        return R.merge(args.out_dir)
    load()
    s = dict(SMOKE if args.smoke else FULL)
    for k in ("exact_budget_s", "tp_budget_s"):
        s[k] *= args.budget_scale
    args.flat_backend = args.flat_backend or ("triton" if args.device.startswith("cuda") else "reference")
    transformers.logging.set_verbosity_error()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("ERROR: --device cuda but torch sees no GPU")
        return 2
    names = [x for x in args.parts.split(",") if x]
    rep = Report(args.out_dir, args.smoke, s, PART_FILE.format(names[0]) if len(names) == 1 else "gpu_results.json")

    def on_term(signum, frame):  # the shell's `timeout`: keep what was measured
        rep.data["status_line"] = f"killed by signal {signum} at +{time.time() - T0:.0f}s; the rest is missing"
        rep.write()
        log(rep.data["status_line"])
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    if args.smoke:
        R.selftest()
        log("decode-floor arithmetic self-test passed")
    rep.data["env"] = X.env_info(args.device)
    rep.data["models"] = {n: M.describe_config(n, args.smoke) for n in ("smollm2", "llama1b", "qwen3tiny")}
    rep.data["smollm2_config_check"] = M.check_smollm2_config()
    log("env: " + json.dumps(rep.data["env"]))
    log(f"SmolLM2 config: {rep.data['smollm2_config_check']}")
    if rep.data["env"]["contbatch_server_modules_imported"] or rep.data["env"]["fastapi_imported"]:
        log("NOTE: `import contbatch` imported server modules: "
            + ", ".join(rep.data["env"]["contbatch_server_modules_imported"]))
    if "throughput" in names:  # the floor of part 3 needs it; measured in the same process
        try:
            rep.data["bandwidth"] = X.copy_bandwidth(args.device, s["bw_bytes"])
            log(f"copy bandwidth: {rep.data['bandwidth']['bytes_per_s'] / 1e12:.3f} TB/s (read+written)")
        except Exception as e:  # noqa: BLE001
            rep.error("bandwidth", e)
    rep.write()
    parts = {"exact": (part_exactness, "exact_budget_s"), "throughput": (part_throughput, "tp_budget_s")}
    for name in names:
        fn, budget = parts[name]
        s["part_end"] = time.time() + s[budget]
        log(f"== part {name} (budget {s[budget]:.0f}s)")
        try:
            fn(args, s, rep)
        except Exception as e:  # noqa: BLE001
            rep.error(f"part {name}", e)
        X.free_memory(args.device)
        rep.write()
    rep.data["status_line"] = (f"finished in {time.time() - T0:.0f}s; "
                               + ("SOME CHECKS FAILED" if rep.failed else "all checks passed"))
    rep.write()
    if rep.json_name == "gpu_results.json":
        print("\n" + R.markdown(rep.data), flush=True)
    log(f"wrote {args.out_dir / rep.json_name}; {rep.data['status_line']}")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # engine/transformers threads left behind by a timed-out run must not hold the exit
