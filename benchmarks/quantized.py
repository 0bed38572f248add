"""Weight-only quantized linears on the default model: decode tok/s for float32, int8 and int4.

Each system (`--systems`: float32, int8, int4 (groups of 32, round-to-nearest at load),
int4-g128, gguf (the default model's own Q4_1/Q8_0 blocks)) runs in a fresh process, the
systems interleaved round by round (`--rounds`), each process loading the model, warming up
once (one manager, started before the timing), then timing one request alone (`--new-tokens` tokens after a short prompt: decode tok/s,
the prompt included) and `--streams` requests together (aggregate tok/s). Printed as medians
[min, max] over the rounds, beside each system's weight-read floor: the bytes a decode token
reads (packed codes, scales and mins of the quantized layers, float32 for the rest) at the
read bandwidth the float32 model's weights measured in the parent (harness/ceilings.py).

Foreign load is watched as in every comparative benchmark (a noisy run is not recorded in
`--results-md`).

    python benchmarks/quantized.py [--systems float32,int8,int4] [--repeats 3] [--new-tokens 64]
        [--results-md benchmarks/RESULTS.md]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import harness as H

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from transformers import GenerationConfig
from contbatch import ContinuousBatchingConfig, continuous_batching, load_model
from harness.children import emit
from quantized import decode_read_bytes
system, new, streams = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model, tok = load_model(quantization=None if system == "float32" else system)
read = decode_read_bytes(model)
prompt = tok.encode("Tell me a story about a lighthouse keeper.")
gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
config = ContinuousBatchingConfig(max_prompt_length=64, max_generated_length=new, max_requests_per_batch=max(streams, 1))
with continuous_batching(model, gc, config) as manager:  # started once: only the requests are timed
    def timed(prompts):
        start = time.perf_counter()
        outs = [manager.get_result(rid, timeout=3600) for rid in manager.add_requests(prompts)]
        took = time.perf_counter() - start
        return sum(len(r.generated_tokens) for r in outs) / took
    timed([prompt])
    single = timed([prompt])
    many = timed([prompt[: 4 + i % 7] for i in range(streams)])
emit({"single": single, "streams": many, "read_bytes": read})
"""


def decode_read_bytes(model) -> int:
    """The weight bytes one decode token reads: every packed linear (codes, scales, mins) and
    float parameter, less a float embedding table (a token reads one row of it) unless a float
    head shares it. A packed table is held in buffers and read only as the head that shares it."""
    import torch

    from contbatch.cpu.quant.linear import QuantLinear

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    table = embed.weight if type(embed) is torch.nn.Embedding else None
    if table is None or (type(head) is torch.nn.Linear and head.weight is table):
        return packed + floats
    return packed + floats - table.numel() * table.element_size()


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--systems", default="float32,int8,int4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=32)
    H.add_common_args(p, repeats=3)
    args = H.parse(p)
    systems = H.comma_list(args.systems)
    from contbatch import load_model

    model, _ = load_model()
    gbps, nbytes, how = H.weight_read_bandwidth(model)
    del model
    print(f"weight read bandwidth {gbps:.1f} GB/s ({how}, float32 model, {nbytes / 1e6:.0f} MB)", flush=True)
    here = str(Path(__file__).resolve().parent)
    samples: dict[str, list[dict]] = {s: [] for s in systems}
    H.wait_for_quiet(args.noise_threshold)
    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    machine = H.machine_info()
    monitor.warn_if_loaded()
    for round_, system in H.rounds(systems, args.repeats):
        r = H.run_child(CHILD, [here, system, args.new_tokens, args.streams],
                      tree=str(Path(here).parent))
        samples[system].append(r)
        print(f"round {round_} {system}: {r['single']:.1f} tok/s alone, {r['streams']:.1f} tok/s x{args.streams}",
              flush=True)
    rows = []
    for s in systems:
        read = samples[s][0]["read_bytes"]
        rows.append([s, f"{read / 1e6:.0f}", f"{gbps * 1e9 / read:.1f}",
                     H.Spread.of([r["single"] for r in samples[s]]).fmt(),
                     H.Spread.of([r["streams"] for r in samples[s]]).fmt()])
    load = monitor.stop()
    table = H.md_table(["system", "MB read / token", "floor tok/s", "1 request tok/s", f"{args.streams} streams tok/s"],
                       rows, [False, True, True, True, True])
    print(H.load_line(load) + "\n" + table)
    md = H.report_header("quantized linears on the default model (`benchmarks/quantized.py`)", machine, load,
                         args.noise_threshold)
    md += [f"Each system in a fresh process, {args.repeats} rounds interleaved; one request of {args.new_tokens} new "
           f"tokens after a short prompt (the prompt counted), then {args.streams} together; median [min, max]. "
           f"Floor: the bytes a token reads at the weight-read bandwidth measured here ({gbps:.1f} GB/s).\n", table]
    report = {"benchmark": "quantized", "command": H.command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "load": load, "noisy_rule": H.noisy_rule(args.noise_threshold),
              "read_gbps": gbps, "samples": samples}
    H.write_outputs(args, report, "\n".join(md))
    print(json.dumps({s: samples[s] for s in systems}))


if __name__ == "__main__":
    main()
