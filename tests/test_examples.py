"""The examples run, and do what their docstrings say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    """By path: `benchmarks/` holds modules of the same names."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_rollouts_reward_rises():
    means = _load("rl_rollouts").main(["--rounds", "8"])
    assert len(means) == 8 and means[-1] > means[0] + 0.2, means
