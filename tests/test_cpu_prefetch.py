"""The one-row kernels' prefetch distance (cpu/prefetch.py): it never changes a value, the
machine's verdict is measured once and kept, a forced choice is taken as asked, and a manager
sets it for the process while it runs and puts it back at its stop."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.cpu import native, ops, prefetch
from contbatch.cpu.quant.format import QuantFormat, quantize, tile

pytestmark = pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No verdict in this process or on disk; the distances put back afterwards."""
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(prefetch, "_verdicts", {})
    before = {kind: ops.stream_prefetch(kind) for kind in ops.STREAM_KINDS}
    yield tmp_path
    for kind, distance in before.items():
        ops.stream_prefetch(kind, distance)


def test_the_distance_never_changes_a_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    # tiled where this CPU runs the tiled kernels (AVX-512 VNNI), the row layout elsewhere
    layout = tile if ops.quant_tiles_available() else (lambda p: p)
    packed = [layout(quantize(w, QuantFormat(bits, group, "test"))) for bits, group in ((4, 32), (8, 256))]
    before = {kind: ops.stream_prefetch(kind) for kind in ops.STREAM_KINDS}
    try:
        for rows in (1, 2):
            x = torch.randn(rows, 256, generator=g)
            outs = []
            for distance in (0, 4096, 64):
                for kind in ops.STREAM_KINDS:
                    ops.stream_prefetch(kind, distance)
                outs.append([ops.small_linear(x, w, None)] + [
                    ops.quant_linear(x, p.codes, p.scales, p.mins, None, p.fmt.op_bits, p.fmt.group) for p in packed])
            assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    finally:
        for kind, distance in before.items():
            ops.stream_prefetch(kind, distance)
    for bad in ((2, 0), (0, 100), (1, -64)):
        with pytest.raises(RuntimeError, match="stream_prefetch"):
            torch.ops.contbatch_cpu.stream_prefetch(*bad)


@pytest.mark.parametrize("on, off, chosen", [(1.30, 1.0, 0), (1.01, 1.0, prefetch.AHEAD), (0.9, 1.0, prefetch.AHEAD)])
def test_the_machine_verdict_is_measured_once_and_kept(fresh, monkeypatch, on, off, chosen):
    calls = []
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: calls.append(kind) or (on, off))
    plan = prefetch.plan_prefetch(("float", "packed"), "auto", huge=False)
    assert plan.distances() == {"float": chosen, "packed": chosen} and calls == ["float", "packed"]
    assert "measured" in plan.summary and f"{on / off:.2f}x" in plan.summary
    stored = json.loads(next(fresh.glob("linear_probe/*.prefetch.json")).read_text())
    assert stored == {"float": [on, off], "packed": [on, off]}
    monkeypatch.setattr(prefetch, "_verdicts", {})  # a later process: the file answers
    again = prefetch.plan_prefetch(("packed",), "auto", huge=False)
    assert again.distances() == {"packed": chosen} and calls == ["float", "packed"]
    assert "from the probe file" in again.summary and again.float_streams is None


def test_a_damaged_file_is_measured_again_and_a_loaded_machine_not_saved(fresh, monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: (2.0, 1.0))
    path = prefetch._path()
    path.parent.mkdir(parents=True)
    path.write_text('{"float": [1.0, "x"], "packed": 3}')
    monkeypatch.setattr(prefetch.ForeignLoad, "cores", lambda self: 1.5)
    with caplog.at_level(logging.WARNING, "contbatch"):
        assert prefetch.plan_prefetch(("float",), "auto", huge=False).distances() == {"float": 0}
    assert "not saved" in caplog.text and '"x"' in path.read_text()  # the file is left as it was
    assert prefetch.verdict("float", huge=False) == ((2.0, 1.0), False)  # this process keeps it


def test_a_forced_choice_measures_nothing(fresh, monkeypatch):
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: pytest.fail("measured"))
    assert prefetch.plan_prefetch(("float", "packed"), "none", huge=False).distances() == {"float": 0, "packed": 0}
    ahead = prefetch.plan_prefetch(("packed",), "ahead", huge=False)
    assert ahead.distances() == {"packed": prefetch.AHEAD} and "as asked" in ahead.summary
    assert prefetch.plan_prefetch((), "auto", huge=False).summary == "no one-row weight streams of ours"


@pytest.mark.parametrize("kind", ops.STREAM_KINDS)
def test_measuring_times_both_ways_and_leaves_the_distance(fresh, kind):
    if kind == "packed" and not ops.quant_tiles_available():
        pytest.skip("the tiled packed kernels (AVX-512 VNNI) are not built on this CPU")
    ops.stream_prefetch(kind, 128)
    on, off = prefetch.measure(kind, huge=True)
    assert on > 0 and off > 0 and ops.stream_prefetch(kind) == 128


def test_a_manager_sets_the_plan_while_it_runs(fresh, llama_model, caplog):
    ops.stream_prefetch("float", 192)
    config = ContinuousBatchingConfig(cpu_kernel_overrides={"prefetch": "none"})
    manager = ContinuousBatchingManager(llama_model, GenerationConfig(max_new_tokens=3, do_sample=False),
                                        config=config)
    assert manager.resolved_config.cpu.prefetch.distances() == {"float": 0}
    assert manager.resolved_config.as_dict()["cpu"]["prefetch"]["float_streams"] == 0
    with caplog.at_level(logging.INFO, "contbatch"):
        manager.start()
    assert "prefetch: one-row weight streams: float none (as asked)" in caplog.text
    try:
        assert ops.stream_prefetch("float") == 0
        out = manager.get_result(manager.add_request([5, 6, 7, 8], max_new_tokens=3), timeout=60)
    finally:
        manager.stop()
    assert ops.stream_prefetch("float") == 192
    reference = generate_batch(llama_model, [[5, 6, 7, 8]], GenerationConfig(max_new_tokens=3, do_sample=False),
                               progress_bar=False)
    assert out.generated_tokens == reference["req_0"].generated_tokens
