"""What a decode step costs beside its arithmetic: a model with the default model's structure
(30 Llama layers, 9/3 heads, tied embeddings) but 64 hidden units, whose kernels take next to no
time, so a lone request's step time is the engine's and the forward's Python and op overhead.

Runs a lone request with the whole decoder stack as one C++ call (`cpu_kernel_overrides={"layer": "auto"}`),
the decoder layers as one call each (`"layer"`) and per module (`"off"`), alternated, the
linears on our few-row kernel in all three (as the default model's are at one row; at these
sizes the start-up probe would pick PyTorch's), and prints the median ms per decode step
(engine-thread wall time of `EngineCore.step`) with [min, max] over the rounds, and the
tokens' agreement.

    .venv/bin/python benchmarks/layer_overhead.py --rounds 5
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness as H  # noqa: E402
from contbatch import ContinuousBatchingConfig, generate_batch  # noqa: E402
from contbatch.runtime import core  # noqa: E402

SYSTEMS = (("one call for the stack", "auto"), ("one call per layer", "layer"), ("per module", "off"))


def time_steps() -> list[float]:
    """Wrap `EngineCore.step` so every step's wall time lands in the returned list."""
    steps: list[float] = []
    real_step = core.EngineCore.step

    def timed_step(self, *a, **k):
        start = time.perf_counter()
        out = real_step(self, *a, **k)
        steps.append(time.perf_counter() - start)
        return out

    core.EngineCore.step = timed_step
    return steps


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    H.add_model_args(p, model=False)
    args = H.parse(p)
    model = H.random_llama(seed=0, dtype=H.dtype_of(args.dtype), hidden_size=64, intermediate_size=160,
                           num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True)
    prompt = list(range(5, 25))
    gc = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)
    steps = time_steps()
    per_step: dict[str, list[float]] = {name: [] for name, _ in SYSTEMS}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds + 1):  # the first round warms every system up and is not counted
        for name, kernel in SYSTEMS:
            steps.clear()
            out = generate_batch(model, [prompt], generation_config=gc, progress_bar=False,
                                 config=ContinuousBatchingConfig(cpu_kernel_overrides={"layer": kernel,
                                                                                       "linear": "small_linear"}))
            tokens.setdefault(name, next(iter(out.values())).generated_tokens)
            per_step[name].append(statistics.median(steps[1:]) * 1e3)  # decode steps: the first is the prompt
    print(H.md_table(["decoder layers", "ms per decode step, median [min, max]"],
                     [[name, H.Spread.of(values[1:]).fmt(".2f")] for name, values in per_step.items()]))
    print(f"\ntokens identical: {len(set(map(tuple, tokens.values()))) == 1}")


if __name__ == "__main__":
    main()
