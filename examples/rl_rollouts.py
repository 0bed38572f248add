"""A small GRPO-style loop: the same model object samples rollouts and learns from them.

Each round: sample `n` completions per prompt from the engine, with the chosen tokens'
logprobs (`return_logprobs=True`: no second scoring pass for the old policy); score them with
a toy reward (the share of tokens that fall in a target set of ids); normalize rewards within
each prompt's group; take a policy-gradient step (importance ratio against the rollout
logprobs, clipped as in PPO) on the model, and tell the engine the weights changed
(`update_weights()`: new version, stale prefix cache dropped). The mean reward rises.

    .venv/bin/python examples/rl_rollouts.py --rounds 12
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams

VOCAB = 256


def tiny_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def reward(tokens: list[int]) -> float:
    """The toy task: emit ids below 32 (an eighth of the vocabulary)."""
    return sum(t < 32 for t in tokens) / len(tokens)


def policy_loss(model, prompt: list[int], tokens: list[int], old_logprobs: list[float], advantage: float,
                clip: float = 0.2) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    new = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    ratio = torch.exp(new - torch.tensor(old_logprobs))
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
    return -torch.min(ratio * advantage, clipped * advantage).mean()


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-2)
    args = p.parse_args(argv)

    model = tiny_policy(0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(32, VOCAB, (6,), generator=gen).tolist() for _ in range(args.prompts)]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    config = ContinuousBatchingConfig(block_size=8, return_logprobs=True)
    manager = ContinuousBatchingManager(model, GenerationConfig(eos_token_id=None), config)
    manager.start()
    means = []
    try:
        for round_ in range(args.rounds):
            params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens,
                                    seed=round_, ignore_eos=True)
            ids = manager.add_requests(prompts, sampling_params=params)
            groups = [manager.get_result(rid, timeout=120).samples for rid in ids]
            rewards = [[reward(s.generated_tokens) for s in group] for group in groups]
            means.append(sum(map(sum, rewards)) / (len(prompts) * args.samples))
            print(f"round {round_:2d}  weight_version {groups[0][0].weight_version}  mean reward {means[-1]:.3f}",
                  flush=True)
            model.train()
            optimizer.zero_grad()
            loss = torch.zeros(())
            for prompt, group, rs in zip(prompts, groups, rewards):
                mean = sum(rs) / len(rs)
                std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5 + 1e-6
                for sample, r in zip(group, rs):
                    loss = loss + policy_loss(model, prompt, sample.generated_tokens, sample.logprobs,
                                              (r - mean) / std)
            (loss / (len(prompts) * args.samples)).backward()
            optimizer.step()  # the engine's model is this model: its weights changed in place...
            model.eval()
            manager.update_weights(None)  # ...so tell the engine: new version, stale KV dropped
    finally:
        manager.stop(timeout=60)
    print(f"mean reward: first round {means[0]:.3f}, last round {means[-1]:.3f}")
    return means


if __name__ == "__main__":
    main()
