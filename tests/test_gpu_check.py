"""The GPU check (benchmarks/gpu_check.sh) on the CPU: it refuses to start without its bundle,
its bundle is verified, its verdicts cannot pass an unverified row, and (slow) the whole script
runs end to end in its dry-run mode, passing, and failing when one row is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check_bundle as B  # noqa: E402
import gpu_check_report as R  # noqa: E402
import gpu_check_runs as X  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run_script(tmp_path: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)


def test_refuses_to_start_without_the_bundle(tmp_path):
    r = run_script(tmp_path, 30, GPU_CHECK_BUNDLE=str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "make gpu-bundle" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing else ran


def _bundle(folder: Path, pins: dict[str, str], wheels: list[str]) -> Path:
    (folder / "wheels").mkdir(parents=True)
    for name in wheels:
        (folder / "wheels" / name).write_bytes(b"w")
    (folder / "manifest.json").write_text(json.dumps({"pins": pins, "wheels": wheels}))
    return folder


def test_bundle_verification(tmp_path, capsys):
    pins = {"transformers": "5.24.0", "PyYAML": "6.0.4"}
    good = _bundle(tmp_path / "good", pins, ["transformers-5.24.0-py3-none-any.whl",
                                             "pyyaml-6.0.4-cp311-cp311-manylinux2014_x86_64.whl"])
    assert B.verify(good) == 0
    assert B.verify(tmp_path / "absent") == 2
    partial = _bundle(tmp_path / "partial", pins, ["transformers-5.24.0-py3-none-any.whl"])
    assert B.verify(partial) == 2 and "PyYAML" in capsys.readouterr().out
    with open(good / "big.bin", "wb") as f:  # sparse: counted by size, as the carry limit counts
        f.truncate(B.LIMIT_BYTES + 1)
    assert B.verify(good) == 2 and "over the 64 MiB" in capsys.readouterr().out


def test_bf16_agreement_allows_only_near_ties():
    ref, margins = [[5, 6, 7, 8]], [[1.0, 0.01, 1.0, 1.0]]
    assert X.agreement([[5, 6, 7, 8]], ref, margins, 0.1)["ok"]
    tie = X.agreement([[5, 9, 9, 9]], ref, margins, 0.1)  # first differs where the margin is tiny
    assert tie["ok"] and tie["near_ties"] and tie["tokens_compared"] == 2
    assert not X.agreement([[5, 6, 9, 8]], ref, margins, 0.1)["ok"]  # a real margin: a failure
    assert not X.agreement([[5, 6]], ref, margins, 0.1)["ok"]  # too short
    assert not X.agreement([], ref, margins, 0.1)["ok"]  # nothing to compare


def _results(exact_status: list[str], tp_rows: list[dict]) -> dict:
    rows = [{"model": "m", "block_size": 16, "requested": {}, "status": s} for s in exact_status]
    return {"exactness": {"rows": rows, "promised": 2}, "throughput": {"rows": tp_rows, "promised": 2}}


def _tp_row(system: str, ok: bool = True, checked: bool = True) -> dict:
    row = {"model": "m", "requests": 4, "system": system, "status": "ok"}
    if checked:
        row["tokens_checked"] = {"output_tokens": 8, "expected": 8, "bf16_vs_generate": {"ok": ok}}
    return row


def test_merge_passes_only_verified_rows():
    assert R.unverified(_results(["PASS", "PASS"], [_tp_row("contbatch"), _tp_row("tf", ok=False)])) == []
    assert any("SKIPPED" in m for m in R.unverified(_results(["PASS", "SKIPPED"], [_tp_row("contbatch")] * 2)))
    assert R.unverified(_results(["PASS"], [_tp_row("contbatch")] * 2))  # a promised row missing
    assert R.unverified(_results(["PASS", "PASS"], [_tp_row("contbatch"), _tp_row("contbatch", checked=False)]))
    assert R.unverified(_results(["PASS", "PASS"], [_tp_row("contbatch"), _tp_row("contbatch", ok=False)]))
    assert R.unverified({})


def _read(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "gpu_results.json").read_text())


@pytest.mark.slow
def test_dry_run_passes_end_to_end(tmp_path):
    r = run_script(tmp_path, 1200, GPU_CHECK_DRYRUN="1")
    data = _read(tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert not data["failed"] and data["unverified"] == []
    assert data["exactness"]["rows"] and all(row["status"] == "PASS" for row in data["exactness"]["rows"])
    for row in data["throughput"]["rows"]:
        assert row["tokens_checked"]["output_tokens"] == row["tokens_checked"]["expected"] > 0
        assert row["tokens_checked"]["bf16_vs_generate"]["tokens_compared"] > 0
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0


@pytest.mark.slow
def test_dry_run_fails_when_one_row_is_skipped(tmp_path):
    r = run_script(tmp_path, 1200, GPU_CHECK_DRYRUN="1", GPU_CHECK_SKIP_ROW="3")
    data = _read(tmp_path)
    assert r.returncode != 0
    assert data["failed"] and data["exactness"]["rows"][3]["status"] == "SKIPPED"
    assert any("SKIPPED" in m for m in data["unverified"])


@pytest.mark.slow
def test_host_overhead_builds_no_cpu_kernels(tmp_path):
    """On a fresh machine (an empty cache) the check's host-overhead step compiles nothing."""
    env = {**os.environ, "CONTBATCH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--batches", "4", "--new-tokens", "3",
                        "--repeats", "1", "--cpu-kernels", "off"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| 4 |" in r.stdout
    assert not (tmp_path / "cache" / "ext").exists()
