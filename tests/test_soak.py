"""The soak benchmark's short mode, in the default suite: ~15 s of mixed load with faults injected.

`benchmarks/soak.py --short` serves a tiny random-weight Llama (the default model's tokenizer)
in-process with a small KV cache and queue, sends streaming and non-streaming chat and
completions, n > 1, logprobs, stop strings, cancels, killed connections, slow readers,
malformed and over-long bodies from concurrent clients while faults are injected in the engine,
then checks that nothing was lost, no 500 came without a fault behind it, the engine went back
to idle with every KV block free and nothing left in its result store or the server's tables,
and that it still serves. It runs in its own process: the fault injector is global.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_short(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.exists(), f"soak.py wrote no summary (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    evidence = json.dumps({"failed_checks": failed, "problems": report["problems"],
                           "examples": report["problem_examples"][:6], "server_log": report["server_log"],
                           "server_log_examples": report["server_log_examples"]}, indent=1, default=str)
    assert proc.returncode == 0 and report["passed"] and not failed, evidence[:12000]
    # The run did something: requests of every kind went out and most of them got answers.
    assert report["sent"] >= 30 and report["verdicts"].get("ok", 0) >= 1, report["verdicts"]
    assert set(report["per_kind"]) >= {"chat", "completion_stream", "malformed", "raw_kill_stream"}
