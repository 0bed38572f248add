"""Many LoRA adapters in one batch: what serving them costs against the base model alone.

`--streams` (32) concurrent streamed completions, each `--new-tokens` tokens (EOS ignored),
sent at once to a server on the base model (`--peer-model`, default `smollm2-135m`: the default
model's weights as a safetensors folder, `make bench-peers`). Two workloads per engine:

- `base`: every stream on the base model;
- `lora`: the same streams spread over `--adapters` (8) adapters of rank `--rank` (16), stream
  i on adapter i mod 8, every adapter resident (`--max-loras` = the adapter count).

Engines: `contbatch serve --lora ...` and, when the peers' venv is set up, vLLM's CPU build
(`--enable-lora --lora-modules ...`: its CPU platform applies LoRA with its PyTorch punica ops,
compiled graphs off). Each (engine, workload) is a system run in a fresh server process: started,
warmed up (as many streams of other prompts, a few tokens each, untimed: no prefix cache holds
the timed prompts), timed once, stopped; `--repeats` rounds,
the first system rotated each round. Reported per system: output tok/s, TTFT p50 and TPOT p50 of
the streams, median [min, max] over the rounds, and per engine the ratio lora / base of tok/s.

Checked: in each system's first round, a greedy completion of one warm-up prompt on every model it
serves (the base and each adapter, `--check-tokens` tokens) is compared with `model.generate` on
that model with the adapter merged here (`W + scale * B @ A`); a system whose text differs shows
MISMATCH and, for contbatch, keeps the run out of RESULTS.md.

The adapters are random (seeded, `std` 0.02, alpha = 2 x rank) on every linear layer of the
attention and MLP, written as PEFT's `save_pretrained` lays them out, under
`<peers work dir>/lora-adapters/`.

    python benchmarks/lora.py --streams 32 --new-tokens 32 --repeats 3 [--systems contbatch,vllm]
        [--results-md benchmarks/RESULTS.md]
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import socket
import sys
from pathlib import Path

import harness as H

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOADS = ("base", "lora")


def write_adapters(model, root: Path, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT LoRA adapter directories for `model` (seeded), reused when already written."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for i in range(count):
        path = root / f"r{rank}-a{i}"
        out[f"a{i}"] = str(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for name, layer in model.named_modules():
            if isinstance(layer, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
                key = f"base_model.model.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=gen) * 0.02
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(TARGETS), "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
                  "use_rslora": False, "use_dora": False, "base_model_name_or_path": None}
        (path / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged(model, path: str):
    """A copy of `model` with the adapter merged in: the check's reference (independent of contbatch)."""
    import torch
    from safetensors.torch import load_file

    config = json.loads(Path(path, "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(Path(path, "adapter_model.safetensors")))
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[name].weight += (scale * (b.double() @ a.double())).to(modules[name].weight.dtype)
    return out


def prompts(tok, n: int, length: int, seed: int = 0) -> list[str]:
    """`n` pieces of `length` tokens of the fixed source text, at seeded offsets, as text."""
    ids = tok.encode(H.source_text()[:400_000])
    rng = random.Random(seed)
    return [tok.decode(ids[o:o + length]) for o in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def references(model, tok, prompt: str, adapters: dict[str, str], new_tokens: int, base_name: str) -> dict[str, str]:
    """{model name: greedy text of `new_tokens` tokens (EOS ignored)} for the base and each adapter."""
    import torch

    ids = torch.tensor([tok.encode(prompt)])
    out = {}
    for name, m in [(base_name, model), *((n, merged(model, p)) for n, p in adapters.items())]:
        with torch.inference_mode():
            gen = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=tok.eos_token_id)
        out[name] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def lora_argv(engine: str, adapters: dict[str, str], rank: int) -> tuple[str, ...]:
    pairs = [f"{name}={path}" for name, path in adapters.items()]
    if engine == "contbatch":
        return (*[x for pair in pairs for x in ("--lora", pair)], "--max-loras", str(len(adapters)),
                "--max-lora-rank", str(rank))
    return ("--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(rank), "--lora-modules", *pairs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _streams(url: str, models: list[str], texts: list[str], new_tokens: int) -> tuple[list, float]:
    import time

    import httpx

    from contbatch.bench.client import Endpoint, send
    from contbatch.bench.datasets import BenchRequest

    limits = httpx.Limits(max_connections=len(texts), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            send(client, Endpoint(url, model, ignore_eos=True), BenchRequest(text, 0, new_tokens))
            for model, text in zip(models, texts)))
        return list(results), time.perf_counter() - start


def _complete(url: str, model: str, prompt: str, tokens: int) -> str:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/completions", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def run_system(engine: str, workload: str, args, adapters: dict[str, str], texts: list[str], warm: list[str],
               expected: dict[str, str] | None) -> dict:
    """One fresh server of `engine` on `workload`: warm-up, (check), one timed pass, stop."""
    import statistics

    from peers import servers

    extra = lora_argv(engine, adapters, args.rank) if workload == "lora" else ()
    server = servers.launch(engine, args.peer_model, "float32", {}, free_port(), extra_argv=extra)
    try:
        names = ([f"a{i % len(adapters)}" for i in range(len(texts))] if workload == "lora"
                 else [server.name] * len(texts))
        # Warm-up, untimed: as many streams of other prompts, a few tokens each (every model it names, every
        # batch size), so that no prefix cache holds the timed prompts.
        asyncio.run(_streams(server.url, names, warm, min(args.new_tokens, 4)))
        mismatched = None
        if expected is not None:
            check = [server.name, *([n for n in adapters] if workload == "lora" else [])]
            mismatched = [n for n in check if _complete(server.url, n, warm[0], args.check_tokens) != expected[n]]
        results, wall = asyncio.run(_streams(server.url, names, texts, args.new_tokens))
    finally:
        server.stop()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{engine}/{workload}: {len(failed)} streams failed, e.g. {failed[0]}")
    tokens = sum(r.output_tokens for r in results)
    return {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens, "startup_s": server.startup_s,
            "ttft_p50_ms": 1e3 * statistics.median(r.ttft for r in results),
            "tpot_p50_ms": 1e3 * statistics.median(r.tpot for r in results if r.tpot is not None),
            "mismatched": mismatched}


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("--peer-model", default="smollm2-135m", help="a peer model folder (benchmarks/peers/paths.py)")
    p.add_argument("--systems", default="contbatch,vllm", help="engines, comma-separated: contbatch, vllm")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=16, help="tokens of the greedy check (0: no check)")
    H.add_common_args(p)
    args = H.parse(p)
    engines = H.comma_list(args.systems, allowed=("contbatch", "vllm"), p=p, what="systems")

    from peers import paths
    from peers.vllm_offline import PeerError

    folder = paths.model_dir(args.peer_model)
    if not folder.is_dir():
        sys.exit(f"{folder} missing: run `make bench-peers`")
    notes = []
    if "vllm" in engines and not paths.venv_python().is_file():
        engines.remove("vllm")
        notes.append("vLLM left out: its venv is not set up (`make bench-peers`)")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    adapters = write_adapters(model, paths.work_dir() / "lora-adapters" / args.peer_model, args.adapters, args.rank)
    texts = prompts(tok, args.streams, args.prompt_len)
    warm = prompts(tok, args.streams, args.prompt_len, seed=1)
    expected = (references(model, tok, warm[0], adapters, args.check_tokens, args.peer_model)
                if args.check_tokens else None)
    del model

    systems = [(e, w) for e in engines for w in WORKLOADS]
    runs: dict[tuple, list[dict]] = {s: [] for s in systems}
    refused: dict[str, str] = {}
    H.wait_for_quiet(log=lambda s: print(s, flush=True))  # the references above were our own load
    load = H.LoadRange()
    for r, (engine, workload) in H.rounds(systems, args.repeats):
        if engine in refused:
            continue
        H.log(f"round {r + 1}: {engine} / {workload}")
        try:
            runs[(engine, workload)].append(run_system(engine, workload, args, adapters, texts, warm,
                                                       expected if not runs[(engine, workload)] else None))
        except (PeerError, RuntimeError) as exc:
            if engine == "contbatch":
                raise
            refused[engine] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            notes.append(f"{engine} left out: {refused[engine]}")
        load.sample()
    report_and_record(args, runs, load, notes)


def report_and_record(args, runs: dict[tuple, list[dict]], load, notes: list[str]) -> None:
    rows, ratios, blockers = [], {}, []
    for (engine, workload), rs in runs.items():
        if not rs:
            continue
        check = rs[0]["mismatched"]
        verdict = "-" if check is None else ("exact" if not check else f"MISMATCH {len(check)}: {', '.join(check)}")
        if check and engine == "contbatch":
            blockers.append(f"contbatch {workload} mismatched {check}")
        spread = {k: H.Spread.of([r[k] for r in rs]) for k in ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "startup_s")}
        rows.append([engine, workload, spread["tok_s"].fmt(), spread["ttft_p50_ms"].fmt(".0f"),
                     spread["tpot_p50_ms"].fmt(".0f"), spread["startup_s"].fmt(), verdict])
    for engine in {e for e, _ in runs}:
        if runs.get((engine, "base")) and runs.get((engine, "lora")):
            ratios[engine] = H.ratio(H.Spread.of([r["tok_s"] for r in runs[(engine, "lora")]]),
                                     H.Spread.of([r["tok_s"] for r in runs[(engine, "base")]]))
    noisy = load.values[0] > args.noise_threshold
    title = (f"LoRA: {args.streams} streams x {args.new_tokens} new tokens over {args.adapters} adapters of rank "
             f"{args.rank} vs the base ({args.peer_model}, float32)")
    lines = H.report_header(title, H.machine_info(), None)
    lines.append(f"Load: {load.line()} (before the first run, then after each)\n")
    lines.append(H.md_table(["engine", "workload", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "start-up s",
                             "greedy check"], rows, [False, False, True, True, True, True, False]))
    lines.append("")
    lines += [f"- {engine}: lora / base output tok/s = {H.fmt_ratio(r)}" for engine, r in sorted(ratios.items())]
    lines += [f"- {note}" for note in notes]
    markdown = "\n".join(lines)
    print(markdown)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "notes": notes,
              "load": {"values": load.values, "noisy": noisy,
                       "noisy_reasons": [f"1-minute load {load.values[0]:.2f} before the first run"] if noisy else []},
              "runs": {f"{e}/{w}": rs for (e, w), rs in runs.items()},
              "ratios": {e: r.as_dict() for e, r in ratios.items()}}
    H.write_outputs(args, report, markdown, blockers)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
