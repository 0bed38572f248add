"""How the few-row kernels ask for their streams ahead (cpu/prefetch.py): it never changes a
value, the machine's verdict is measured once and kept, a forced choice is taken as asked, and a
manager sets it for the process while it runs and puts it back at its stop."""

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
    """No verdict in this process or on disk; the settings put back afterwards."""
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(prefetch, "_verdicts", {})
    before = {kind: ops.stream_prefetch(kind) for kind in ops.STREAM_KINDS}
    yield tmp_path
    for kind, setting in before.items():
        ops.stream_prefetch(kind, setting)


def test_the_setting_never_changes_a_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    # tiled where this CPU runs the tiled kernels (AVX-512 VNNI), the row layout elsewhere
    layout = tile if ops.quant_tiles_available() else (lambda p: p)
    packed = [layout(quantize(w, QuantFormat(bits, group, "test"))) for bits, group in ((4, 32), (8, 256))]
    # decode attention: three rows of 40, 300 and 700 keys over shuffled blocks of 64 slots
    key, value = torch.randn(2, 36 * 64, 32, generator=g), torch.randn(2, 36 * 64, 32, generator=g)
    table = torch.randperm(36, generator=g)[:33].to(torch.int32).view(3, 11)
    lens = torch.tensor([40, 300, 700], dtype=torch.int32)
    query = torch.randn(3, 6, 32, generator=g)
    before = {kind: ops.stream_prefetch(kind) for kind in ops.STREAM_KINDS}
    try:
        for rows in (1, 2):
            x = torch.randn(rows, 256, generator=g)
            outs = []
            for setting in ((0, 1), (4096, 1), (64, 1), (4096, 2), (64, 2)):
                for kind in ops.STREAM_KINDS:
                    ops.stream_prefetch(kind, setting)
                outs.append([ops.small_linear(x, w, None)] + [
                    ops.quant_linear(x, p.codes, p.scales, p.mins, None, p.fmt.op_bits, p.fmt.group) for p in packed]
                    + [ops.paged_decode(query, key, value, table, lens, None, 64, 0.2, None, None)])
            assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    finally:
        for kind, setting in before.items():
            ops.stream_prefetch(kind, setting)
    for bad in ((3, 0, 1), (0, 100, 1), (1, -64, 1), (2, 4096, 3)):
        with pytest.raises(RuntimeError, match="stream_prefetch"):
            torch.ops.contbatch_cpu.stream_prefetch(*bad)


@pytest.mark.parametrize("times, chosen", [
    ({"none": 1.0, "l1": 1.30, "l2": 1.10}, "none"),  # the fastest, well ahead of the kernels' own
    ({"none": 1.0, "l1": 0.90, "l2": 1.20}, "l1"),
    ({"none": 1.0, "l1": 1.01, "l2": 0.99}, "l1"),  # within the margin: the kernels' own stays
    ({"none": 1.0, "l1": 1.00, "l2": 0.80}, "l2"),
])
def test_the_machine_verdict_is_measured_once_and_kept(fresh, monkeypatch, times, chosen):
    calls = []
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: calls.append(kind) or dict(times))
    plan = prefetch.plan_prefetch(("float", "packed", "kv"), "auto", huge=False)
    assert plan.settings == {"float": chosen, "packed": chosen, "kv": chosen}
    assert calls == ["float", "packed", "kv"]
    assert "measured" in plan.summary and f"{times['l1'] / times['l2']:.2f}x" in plan.summary
    stored = json.loads(next(fresh.glob("linear_probe/*.prefetch.json")).read_text())
    assert stored == {"float": times, "packed": times, "kv": times}
    monkeypatch.setattr(prefetch, "_verdicts", {})  # a later process: the file answers
    again = prefetch.plan_prefetch(("packed",), "auto", huge=False)
    assert again.settings == {"packed": chosen} and calls == ["float", "packed", "kv"]
    assert "from the probe file" in again.summary


def test_a_damaged_file_is_measured_again_and_a_loaded_machine_not_saved(fresh, monkeypatch, caplog):
    times = {"none": 1.0, "l1": 2.0, "l2": 1.5}
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: dict(times))
    path = prefetch._path()
    path.parent.mkdir(parents=True)
    damaged = '{"float": {"none": 1.0, "l1": "x", "l2": 1.0}, "packed": 3, "kv": [1.0, 2.0]}'
    path.write_text(damaged)
    monkeypatch.setattr(prefetch.ForeignLoad, "cores", lambda self: 1.5)
    with caplog.at_level(logging.WARNING, "contbatch"):
        assert prefetch.plan_prefetch(("float", "kv"), "auto", huge=False).settings == {"float": "none", "kv": "none"}
    assert "not saved" in caplog.text and path.read_text() == damaged  # the file is left as it was
    assert prefetch.verdict("float", huge=False) == (times, False)  # this process keeps it


def test_a_forced_choice_measures_nothing(fresh, monkeypatch):
    monkeypatch.setattr(prefetch, "measure", lambda kind, huge: pytest.fail("measured"))
    none = prefetch.plan_prefetch(("float", "packed"), "none", huge=False)
    assert none.settings == {"float": "none", "packed": "none"}
    l2 = prefetch.plan_prefetch(("kv",), "l2", huge=False)
    assert l2.settings == {"kv": "l2"} and l2.summary == "streams: kv into L2 (as asked)"
    assert prefetch.plan_prefetch((), "auto", huge=False).summary == "no streams of our few-row kernels"


@pytest.mark.parametrize("kind", ops.STREAM_KINDS)
def test_measuring_times_every_setting_and_leaves_the_one_in_force(fresh, kind):
    if kind == "packed" and not ops.quant_tiles_available():
        pytest.skip("the tiled packed kernels (AVX-512 VNNI) are not built on this CPU")
    ops.stream_prefetch(kind, (128, 2))
    times = prefetch.measure(kind, huge=True)
    assert set(times) == set(prefetch.SETTINGS) and all(t > 0 for t in times.values())
    assert ops.stream_prefetch(kind) == (128, 2)


def test_a_manager_sets_the_plan_while_it_runs(fresh, llama_model, caplog):
    ops.stream_prefetch("float", (192, 1))
    ops.stream_prefetch("kv", (256, 2))
    config = ContinuousBatchingConfig(cpu_kernel_overrides={"prefetch": "none"})
    manager = ContinuousBatchingManager(llama_model, GenerationConfig(max_new_tokens=3, do_sample=False),
                                        config=config)
    assert manager.resolved_config.cpu.prefetch.settings == {"float": "none", "kv": "none"}
    assert manager.resolved_config.as_dict()["cpu"]["prefetch"]["settings"] == {"float": "none", "kv": "none"}
    with caplog.at_level(logging.INFO, "contbatch"):
        manager.start()
    assert "prefetch: streams: float none (as asked), kv none (as asked)" in caplog.text
    try:
        assert ops.stream_prefetch("float")[0] == 0 and ops.stream_prefetch("kv")[0] == 0
        out = manager.get_result(manager.add_request([5, 6, 7, 8], max_new_tokens=3), timeout=60)
    finally:
        manager.stop()
    assert ops.stream_prefetch("float") == (192, 1) and ops.stream_prefetch("kv") == (256, 2)
    reference = generate_batch(llama_model, [[5, 6, 7, 8]], GenerationConfig(max_new_tokens=3, do_sample=False),
                               progress_bar=False)
    assert out.generated_tokens == reference["req_0"].generated_tokens
