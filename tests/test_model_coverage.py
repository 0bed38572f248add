"""Day-zero coverage: every causal-LM architecture of the pinned transformers is served exactly,
or refused when the manager is made, with a ValueError that says why.

One case per architecture of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny random-weight model
of it (`benchmarks/tiny_models.py`) serves a mixed batch of three prompts through chunked
prefill and 4-token blocks, compared token for token with `model.generate`
(`benchmarks/model_coverage.py`, which also writes docs/models.md). A verdict must be exact or
refused, and must be the one docs/models.md records: a support rule that starts refusing a
model that was exact, or a table left stale after a change, fails here. Architectures of
which no tiny model can be built are skipped with the reason.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_coverage import contbatch_verdict, prompts  # noqa: E402
from tiny_models import Unbuildable, build_tiny, causal_lm_architectures  # noqa: E402

DOC = ROOT / "docs" / "models.md"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and the reference `generate` (this thread) and each
    manager's engine thread then never trade OpenMP pools (which costs seconds per case on
    2 cores, see contbatch/engine/threads.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _documented() -> dict[str, str]:
    """architecture -> contbatch verdict, from the table in docs/models.md."""
    if not DOC.exists():
        return {}
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", DOC.read_text(), re.MULTILINE)
    return dict(rows)


DOCUMENTED = _documented()


def test_the_table_covers_every_architecture():
    missing = sorted(set(causal_lm_architectures()) - set(DOCUMENTED))
    assert not missing, f"docs/models.md lacks {missing}: rerun benchmarks/model_coverage.py"
    assert sum(v == "exact" for v in DOCUMENTED.values()) >= 125
    assert "wrong" not in DOCUMENTED.values()


@pytest.mark.parametrize("arch", causal_lm_architectures())
def test_architecture_is_exact_or_refused_at_start(arch):
    try:
        model = build_tiny(arch)
    except Unbuildable as exc:
        pytest.skip(str(exc))
    verdict = contbatch_verdict(model, prompts())
    assert verdict.verdict in ("exact", "refused"), f"{arch}: {verdict.reason}"
    if verdict.verdict == "refused":  # the message names the model, the feature and what to do instead
        assert f"model type {model.config.model_type!r}" in verdict.reason, verdict.reason
        assert "model.generate" in verdict.reason, verdict.reason
    documented = DOCUMENTED.get(arch)
    assert documented in (None, verdict.verdict), (
        f"{arch} is {verdict.verdict} ({verdict.reason[:200]}) but docs/models.md says {documented}: rerun "
        "benchmarks/model_coverage.py if the change is intended"
    )
