"""What a decode step costs beside its arithmetic: a model with the default model's structure
(30 Llama layers, 9/3 heads, tied embeddings) but 64 hidden units, whose kernels take next to no
time, so a lone request's step time is the engine's and the forward's Python and op overhead.

Runs a lone request with the whole decoder stack as one C++ call (`cpu_layer_kernel="auto"`),
the decoder layers as one call each (`"layer"`) and per module (`"aten"`), alternated, the linears on our few-row kernel in both (as the default
model's are at one row; at these sizes the start-up probe would pick PyTorch's), and prints the median ms per decode step (engine-thread
wall time of `EngineCore.step`) with [min, max] over the rounds, and the tokens' agreement.

    .venv/bin/python benchmarks/layer_overhead.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from contbatch import ContinuousBatchingConfig, generate_batch  # noqa: E402
from contbatch.engine import core  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=30, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    prompt = list(range(5, 25))
    gc = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)
    steps: list[float] = []
    real_step = core.EngineCore.step

    def timed_step(self, *a, **k):
        start = time.perf_counter()
        out = real_step(self, *a, **k)
        steps.append(time.perf_counter() - start)
        return out

    core.EngineCore.step = timed_step
    systems = (("one call for the stack", "auto"), ("one call per layer", "layer"), ("per module", "aten"))
    per_step: dict[str, list[float]] = {name: [] for name, _ in systems}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds + 1):  # the first round warms both up and is not counted
        for name, kernel in systems:
            steps.clear()
            out = generate_batch(model, [prompt], generation_config=gc, progress_bar=False,
                                 config=ContinuousBatchingConfig(cpu_layer_kernel=kernel,
                                                                 cpu_linear_kernel="native"))
            tokens.setdefault(name, next(iter(out.values())).generated_tokens)
            per_step[name].append(statistics.median(steps[1:]) * 1e3)  # decode steps: the first is the prompt
    print("| decoder layers | ms per decode step, median [min, max] |\n|---|---:|")
    for name, values in per_step.items():
        rounds = values[1:]
        print(f"| {name} | {statistics.median(rounds):.2f} [{min(rounds):.2f}, {max(rounds):.2f}] |")
    print(f"\ntokens identical: {len(set(map(tuple, tokens.values()))) == 1}")


if __name__ == "__main__":
    main()
