"""Derived numbers and the Markdown of benchmarks/gpu_check.py's report (a plain dict, also
written as JSON)."""

from __future__ import annotations

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
    out["busy_fraction"] = st.get("gpu_busy_seconds", 0.0) / gen_s if gen_s else None
    out["gpu_busy_seconds"] = st.get("gpu_busy_seconds", 0.0)
    if not steps or not st.get("gpu_decode_seconds"):
        return out
    step_s = st["gpu_decode_seconds"] / steps
    rows = st.get("decode_only_rows", 0) / steps
    ctx = row["prompt_len"] + row["new_tokens"] / 2
    kv = rows * ctx * m["kv_bytes_per_token"]
    out.update(step_s=step_s, mean_rows=rows, mean_context=ctx, weight_bytes=m["weight_bytes"], kv_bytes=kv)
    if bandwidth:
        floor = (m["weight_bytes"] + kv) / bandwidth
        out.update(floor_s=floor, floor_over_step=floor / step_s)
    return out


def _exact_table(rows: list[dict]) -> list[str]:
    out = ["| model | block | requested (backend fast/graph/async) | resolved (backend fast/graph/async, layout) | result "
           "| prompts equal | graph cap/replay | s | notes |", "|---|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        q = r["requested"]
        req = f"{q['attention_backend']} {q.get('decode_fast_path', '-')}/{q.get('use_cuda_graph', '-')}/{q.get('use_async_batching', '-')}"
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
    for r in rows:
        d = r.get("decode") or {}
        if not d:
            continue
        ratio = d.get("floor_over_step")
        ok = "-" if ratio is None else ("yes" if ratio >= TARGET_FLOOR else "NO")
        gb = lambda x: None if x is None else x / 1e9  # noqa: E731
        ms = lambda x: None if x is None else x * 1e3  # noqa: E731
        miss = f" (stats missing: {', '.join(d['missing_stats'])})" if d.get("missing_stats") else ""
        out.append(f"| {r['model']} | {r['requests']} | {r['system']}{miss} | {d.get('decode_only_steps')} | "
                   f"{_f(d.get('mean_rows'), '.1f')} | {_f(ms(d.get('step_s')), '.3f')} | {_f(gb(d.get('weight_bytes')), '.3f')} | "
                   f"{_f(gb(d.get('kv_bytes')), '.3f')} | {_f(ms(d.get('floor_s')), '.3f')} | {_f(ratio)} | {ok} | "
                   f"{_f(d.get('gpu_busy_seconds'), '.2f')} | {_f(r.get('gen_s'))} | {_f(d.get('busy_fraction'), '.1%')} |")
    return out


def markdown(rep: dict) -> str:
    env, s = rep.get("env", {}), rep.get("sizes", {})
    lines = [f"## GPU check, {rep.get('date', '?')}{' (SMOKE: tiny sizes, not a measurement)' if rep.get('smoke') else ''}",
             "",
             f"Device: {env.get('device_name', '?')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}, tokenizers {env.get('tokenizers')}, flash_attn "
             f"{'importable' if env.get('flash_attn') else 'not installed'}. Script: benchmarks/gpu_check.py.",
             "",
             "Models are random-weight: the default model is **SmolLM2-135M-Instruct's architecture with random "
             f"weights** ({rep.get('models', {}).get('smollm2', '?')}), built from its hard-coded config because the "
             "94 MB GGUF cannot travel to the GPU machine; the 1B is a random Llama "
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
        lines += [f"### 1. Exactness: float32 greedy vs `model.generate` (per prompt, unpadded, EOS off)", "",
                  f"{s.get('exact_n')} prompts of {s.get('exact_lo')}..{s.get('exact_hi')} tokens, {s.get('exact_new')} new "
                  f"tokens, max_batch_tokens {s.get('exact_mbt')} (chunked prefill); weights initialised with "
                  f"std {rep.get('exact_init_range')} so greedy margins are real. "
                  f"Summary: {ex.get('summary', '-')}.", ""]
        lines += _exact_table(ex.get("rows", [])) + [""]
    tp = rep.get("throughput")
    if tp is not None:
        lines += ["### 2. Offline throughput, bf16", "",
                  f"{s.get('tp_prompt')}-token random prompts, {s.get('tp_new')} new tokens, EOS ignored; contbatch with "
                  "its defaults (auto backend; graphs and async on where they can run) against transformers' "
                  f"`model.generate_batch` ({tp.get('tf_attn', '?')}), same explicit num_blocks and max_batch_tokens "
                  f"({s.get('tp_mbt')}) for both, each system warmed up once on a small batch. e2e = the whole call "
                  "(start-up, graph capture, shutdown); gen = first request in -> last out. "
                  "Parameters: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in tp.get("params", {}).items()) + ".", ""]
        lines += _throughput_table(tp.get("rows", [])) + [""]
        lines += ["### 3. Decode step vs the memory-bandwidth floor; GPU busy fraction", "",
                  "From the engine's stats of each contbatch run: step = gpu_decode_seconds / decode_only_steps, rows = "
                  "decode_only_rows / decode_only_steps; floor = (weights read per step + KV read per step) / copy "
                  f"bandwidth; target floor/step >= {TARGET_FLOOR} at batch 64. Busy fraction = gpu_busy_seconds / gen wall "
                  "(the 1B at 64 requests runs with async on and off).", ""]
        lines += _decode_table(tp.get("rows", [])) + [""]
    if rep.get("errors"):
        lines += ["### Errors", ""] + [f"- {e}" for e in rep["errors"]] + [""]
    return "\n".join(lines)
