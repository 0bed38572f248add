"""How far quantized linears are from float32 on the default model: product errors and tokens.

For each method (`--methods`: int8, int4, int4-g128, gguf) this loads the default model
quantized that way and the float32 model, and reports (1) the relative error of each
quantized layer's product against the float32 layer's on the real hidden states of a prompt
(captured by forward hooks: ||y_q - y_f|| / ||y_f|| per layer, max and mean over layers), and
(2) the share of greedy tokens equal to float32's (`--new-tokens` per prompt, counted up to the
first difference, after which the texts part ways), over a few fixed prompts.

    python benchmarks/quantized_error.py [--methods int8,int4,gguf] [--new-tokens 32]
"""

from __future__ import annotations

import torch

import harness as H

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Explain photosynthesis in one sentence.", "List three primary colors:", "Once upon a time"]


def captured_inputs(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input of every linear layer of the float model on `ids`."""
    seen, hooks = {}, []

    def keep(name: str):
        def hook(module, args, out) -> None:  # returns None: the output is left as it is
            seen.setdefault(name, args[0].detach().clone())
        return hook

    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            hooks.append(m.register_forward_hook(keep(name)))
    with torch.inference_mode():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def greedy(model, ids: torch.Tensor, new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--methods", default="int8,int4,gguf")
    p.add_argument("--new-tokens", type=int, default=32)
    args = H.parse(p)
    from contbatch import load_model

    ref, tok = load_model()
    prompts = [tok(t, return_tensors="pt").input_ids for t in PROMPTS]
    inputs = captured_inputs(ref, prompts[0])
    expected = [greedy(ref, ids, args.new_tokens) for ids in prompts]
    rows = []
    for method in H.comma_list(args.methods):
        model, _ = load_model(quantization=method)
        errors = []
        with torch.inference_mode():
            for name, x in inputs.items():
                q = model.get_submodule(name)
                f = ref.get_submodule(name)
                yf = f(x)
                errors.append(float((q(x) - yf).norm() / yf.norm()))
        same = 0
        for ids, want in zip(prompts, expected):
            got = greedy(model, ids, args.new_tokens)
            same += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        rows.append([method, f"{max(errors):.4f}", f"{sum(errors) / len(errors):.4f}",
                     f"{same}/{len(prompts) * args.new_tokens} ({same / (len(prompts) * args.new_tokens):.0%})"])
        print(rows[-1], flush=True)
    print(H.md_table(["method", "max rel. error", "mean rel. error", "greedy tokens equal to float32"], rows,
                     [False, True, True, True]))


if __name__ == "__main__":
    main()
