"""The CPU kernels' user surface (cpu/knobs.py, cpu/plan.py): one knob, per-kernel overrides,
the deprecated fields and flags, and the one plan the resolver reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import pytest

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.cli.options import add_device_arguments, gpu_config
from contbatch.cpu import knobs, native
from contbatch.cpu.knobs import CpuKnobs


def test_one_knob_replaces_the_six_fields():
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert len(names) <= 33, len(names)  # 31 after the CPU knobs were merged, plus the two LoRA budgets
    assert {"cpu_kernels", "cpu_kernel_overrides"} <= names and not names & set(knobs.DEPRECATED_FIELDS)
    config = ContinuousBatchingConfig()
    assert config.cpu_kernels == "auto" and config.cpu_kernel_overrides is None


@pytest.mark.parametrize("bad", [dict(cpu_kernels="on"), dict(cpu_kernels=None),
                                 dict(cpu_kernel_overrides={"lienar": "aten"}),
                                 dict(cpu_kernel_overrides={"linear": "mkl"}),
                                 dict(cpu_kernel_overrides={"linear_prepack": 1}),
                                 dict(cpu_kernel_overrides={"layer": True}),
                                 dict(cpu_kernel_overrides={"prefetch": "off"}),
                                 dict(cpu_kernel_overrides=["linear"])])
def test_bad_knobs_are_refused_when_the_config_is_built(bad):
    with pytest.raises(ValueError, match="cpu_kernel"):
        ContinuousBatchingConfig(**bad)


def test_overrides_apply_on_top_of_the_mode():
    allowed = {key: values[-1] for key, values in knobs.OVERRIDES.items()}
    assert ContinuousBatchingConfig(cpu_kernel_overrides=allowed).cpu_kernel_overrides == allowed
    assert CpuKnobs.from_config("auto") == CpuKnobs()
    off = CpuKnobs.from_config("off", {"norm": "auto"})
    assert (off.linear, off.norm, off.rotary, off.layer, off.prefill) == ("aten", "auto", "off", "off", "off")
    assert off.describe() == "off (norm=auto)"
    assert CpuKnobs.from_config("auto", {"linear": "small_linear"}).describe() == "auto (linear=small_linear)"


def test_deprecated_fields_map_into_the_overrides_with_one_warning_each(caplog):
    with caplog.at_level(logging.WARNING, "contbatch"), pytest.warns(DeprecationWarning) as warned:
        config = ContinuousBatchingConfig(cpu_linear_kernel="native", cpu_linear_prepack=False,
                                          cpu_kernel_overrides={"norm": "off"})
    # The old spellings: "native" is now "small_linear", "aten" for a fused kernel "off".
    assert config.cpu_kernel_overrides == {"norm": "off", "linear": "small_linear", "linear_prepack": False}
    assert len(warned) == 2 and all("cpu_kernel_overrides" in str(w.message) for w in warned)
    assert all(w.filename == __file__ for w in warned)  # the warning points at the caller
    assert sum("is deprecated" in r.getMessage() for r in caplog.records) == 2
    with pytest.warns(DeprecationWarning):
        again = dataclasses.replace(ContinuousBatchingConfig(), cpu_prefill_kernel="aten")
    assert again.cpu_kernel_overrides == {"prefill": "off"}
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="contradicts"):
        ContinuousBatchingConfig(cpu_layer_kernel="layer", cpu_kernel_overrides={"layer": "off"})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"cpu_kernel_overrides\['rotary'\]"):
        ContinuousBatchingConfig(cpu_rotary_kernel="fused")


def test_tensor_parallel_turns_the_routers_off_and_keeps_the_prefill_kernel():
    overrides = knobs.without_routers({"prefill": "off", "linear": "small_linear"})
    assert overrides == {"prefill": "off", "linear": "aten", "norm": "off", "rotary": "off", "layer": "off"}
    assert CpuKnobs.from_config("auto", knobs.without_routers(None)).prefill == "auto"


def test_off_plans_pytorch_ops_everywhere_and_says_so(llama_model):
    r = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig(cpu_kernels="off")).resolved_config
    plan = r.cpu
    assert plan.knobs.mode == "off" and not plan.linear.routes_anything and not plan.prefill
    assert plan.norm.classes == () and plan.rotary.modules == () and plan.layer.layers == ()
    assert "as asked" in plan.linear.summary and "as asked" in plan.layer.summary
    assert not plan.pages.move and plan.pages.nbytes == 0  # no kernel of ours streams a weight
    # only the attention backend's decode kernel (not a cpu_kernels choice) streams K/V rows
    assert set(plan.prefetch.settings) <= {"kv"}
    assert plan.describe().startswith("cpu_kernels=off: prefill_kernel=False; linear: aten (as asked)")
    cpu = r.as_dict()["cpu"]
    json.dumps(cpu)  # resolved_config.as_dict() is printed as JSON by `contbatch serve`
    assert set(cpu) == {"knobs", "linear", "norm", "rotary", "layer", "prefill", "pages", "prefetch"}


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_an_override_turns_one_kernel_back_on(llama_model):
    config = ContinuousBatchingConfig(cpu_kernels="off", cpu_kernel_overrides={"norm": "auto", "layer": "auto"})
    plan = ContinuousBatchingManager(llama_model, config=config).resolved_config.cpu
    assert plan.norm.classes == ("LlamaRMSNorm",) and plan.rotary.modules == () and not plan.prefill
    assert plan.layer.layers == () and "the rotary is not fused" in plan.layer.summary
    auto = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig()).resolved_config.cpu
    assert auto.prefill and auto.layer.layers and auto.describe().startswith("cpu_kernels=auto: prefill_kernel=True")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_flags(caplog, capsys):
    assert gpu_config(_parse())["cpu_kernels"] == "auto" and gpu_config(_parse())["cpu_kernel_overrides"] is None
    args = _parse("--cpu-kernels", "off", "--cpu-kernel-override", "layer=layer",
                  "--cpu-kernel-override", "linear_prepack=false")
    assert gpu_config(args)["cpu_kernels"] == "off"
    assert gpu_config(args)["cpu_kernel_overrides"] == {"layer": "layer", "linear_prepack": False}
    ContinuousBatchingConfig(**gpu_config(args))
    with caplog.at_level(logging.WARNING, "contbatch"):
        old = gpu_config(_parse("--cpu-linear-kernel", "native", "--no-cpu-linear-prepack",
                                "--cpu-kernel-override", "linear=onednn"))
    assert old["cpu_kernel_overrides"] == {"linear": "onednn", "linear_prepack": False}  # the new flag wins
    assert sum("is deprecated" in r.getMessage() for r in caplog.records) == 2
    for bad in ("linear", "linear=mkl", "speed=fast", "linear_prepack=1"):
        with pytest.raises(SystemExit):
            _parse("--cpu-kernel-override", bad)
    assert "--cpu-kernel-override" in capsys.readouterr().err
