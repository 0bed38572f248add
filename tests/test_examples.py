"""The examples run, and do what their docstrings say."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_rl_rollouts_reward_rises():
    import rl_rollouts

    means = rl_rollouts.main(["--rounds", "8"])
    assert len(means) == 8 and means[-1] > means[0] + 0.2, means
