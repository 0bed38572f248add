"""The peer benchmarks' plumbing (benchmarks/peers/, serve_launch.py, the offline rows): the
parts that decide what runs and what is posted, checked without the peers installed."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness as H  # noqa: E402
import serve_launch  # noqa: E402
from offline_measure import RowResult, posted  # noqa: E402
from offline_report import scenario_table  # noqa: E402
from offline_systems import Config  # noqa: E402
from offline_workloads import Workload  # noqa: E402
from peers import knobs, paths, servers, setup_peers, ttft  # noqa: E402


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.PEERS_ENV, str(tmp_path))
    return tmp_path


def test_paths_follow_the_environment_and_reject_unknown_names(work):
    assert paths.venv_python() == work / "venv" / "bin" / "python"
    assert paths.gguf_path("smollm2-135m", "q8_0") == work / "models" / "smollm2-135m.Q8_0.gguf"
    assert paths.resolve_model("qwen2.5-0.5b-shape") == work / "models" / "qwen2.5-0.5b-shape"
    assert paths.resolve_model("default") is None and paths.resolve_model("/x/y") == Path("/x/y")
    with pytest.raises(ValueError, match="unknown quant"):
        paths.gguf_path("smollm2-135m", "Q5_K")
    with pytest.raises(ValueError, match="unknown peer model"):
        paths.model_dir("llama-70b")


def test_settings_parse_and_unknown_knobs_are_refused():
    assert knobs.parse_setting("np=8, quant=Q8_0,preload=true") == {"np": 8, "quant": "Q8_0", "preload": True}
    assert knobs.label({"b": 512, "np": 4}) == "b=512,np=4" and knobs.label({}) == "default"
    with pytest.raises(ValueError, match="knob=value"):
        knobs.parse_setting("np8")
    with pytest.raises(ValueError, match="unknown vLLM knobs"):
        knobs.vllm_env({"threads": 2})
    assert servers.parse_spec("llamacpp:np=2") == ("llamacpp", {"np": 2})
    with pytest.raises(ValueError, match="unknown server system"):
        servers.parse_spec("tgi")


def test_vllm_setting_becomes_its_environment_and_arguments(work):
    env = knobs.vllm_env({"bind": "all"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-") and "LD_PRELOAD" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in knobs.vllm_env({})  # vLLM's own default binding
    with pytest.raises(RuntimeError, match="make bench-peers"):  # no Intel OpenMP in an empty work dir
        knobs.vllm_env({"preload": True})
    args = knobs.vllm_engine_args("/m", "float32", {"mbt": 4096, "seqs": 32})
    assert args["max_num_batched_tokens"] == 4096 and args["max_num_seqs"] == 32 and args["dtype"] == "float32"
    argv = knobs.vllm_serve_argv("/m", "float32", {"mbt": 4096}, 8123, "m")
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--max-num-batched-tokens" in argv and "8123" in argv


def test_llama_server_command_needs_its_gguf_and_sizes_context_per_slot(work):
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        knobs.llama_server_argv("smollm2-135m", {"quant": "Q8_0"}, 8124, "m")
    gguf = paths.gguf_path("smollm2-135m", "Q8_0")
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    argv = knobs.llama_server_argv("smollm2-135m", {"quant": "q8_0", "np": 8, "t": 2}, 8124, "m")
    assert argv[argv.index("-m") + 1] == str(gguf)
    assert argv[argv.index("-c") + 1] == str(8 * knobs.MAX_MODEL_LEN) and argv[argv.index("-t") + 1] == "2"
    with pytest.raises(ValueError, match="quant"):
        servers.command("llamacpp", "smollm2-135m", "bfloat16", {}, 8124)
    bf16 = paths.gguf_path("smollm2-135m", "BF16")
    bf16.write_bytes(b"GGUF")  # a bfloat16 run names the file's type: its BF16 GGUF
    server = paths.llama_bin("llama-server")
    server.parent.mkdir(parents=True)
    server.write_bytes(b"")
    argv, _ = servers.command("llamacpp", "smollm2-135m", "bfloat16", {"quant": "BF16"}, 8124)
    assert argv[argv.index("-m") + 1] == str(bf16)


def test_contbatch_quant_knob_serves_the_same_gguf_or_quantizes_at_load(work):
    """`contbatch:quant=Q8_0` serves the GGUF file llama.cpp gets for that type; `quant=int8`
    quantizes the safetensors folder at load; an unknown type is refused."""
    argv, _ = servers.command("contbatch", "smollm2-135m", "float32", {"quant": "q8_0"}, 8125)
    assert argv[argv.index("--model") + 1] == str(paths.gguf_path("smollm2-135m", "Q8_0"))
    assert "--quantization" not in argv
    argv, _ = servers.command("contbatch", "smollm2-135m", "float32", {"quant": "int8"}, 8125)
    assert argv[argv.index("--model") + 1] == str(paths.model_dir("smollm2-135m"))
    assert argv[argv.index("--quantization") + 1] == "int8"
    with pytest.raises(ValueError, match="unknown quant"):
        servers.command("contbatch", "smollm2-135m", "float32", {"quant": "Q3_K"}, 8125)


def test_sweeps_are_small_and_stage_wise():
    assert knobs.vllm_stages("none") == [] and knobs.llama_stages("none", 32) == []
    full = knobs.vllm_stages("full")
    assert full[0] == [{"bind": "all"}] and all(set(c) <= set(knobs.VLLM_KNOBS) for st in full for c in st)
    assert knobs.effective("llamacpp", {"quant": "q8_0"}) == {"np": 4, "quant": "Q8_0"}
    assert knobs.effective("llamacpp", {}) == knobs.effective("llamacpp", {"np": 4})  # one candidate, not two
    slots = [c["np"] for c in knobs.llama_stages("full", 12)[0]]
    assert 12 in slots and slots == sorted(slots)


def test_a_failing_setup_step_names_itself():
    with pytest.raises(setup_peers.SetupError, match="step 'llama.cpp build' failed.*exited 3"):
        setup_peers.sh("llama.cpp build", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    with pytest.raises(SystemExit):  # an unknown step name is refused before anything runs
        setup_peers.main(["--only", "nonsense"])


_FAKE_SERVER = """#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({{"choices": [{{"text": " the"}}]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Handler).handle_request()
"""


def _fake_llama_server(text: str) -> None:
    binary = paths.llama_bin("llama-server")
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(text)
    binary.chmod(0o755)


def test_llama_check_rebuilds_without_amx_after_an_illegal_instruction(work, monkeypatch):
    # A build that dies with SIGILL while loading (as ggml's AMX kernels do on some guests) is
    # rebuilt with AMX off; the rebuilt one answers, and the record says why it is in use.
    _fake_llama_server("#!/bin/sh\nkill -ILL $$\n")
    builds = []

    def rebuild(step, amx=True):
        builds.append((step, amx))
        _fake_llama_server(_FAKE_SERVER.format(python=sys.executable))

    monkeypatch.setattr(setup_peers, "build_llama", rebuild)
    assert not setup_peers.llama_checked()
    setup_peers.check_llama()
    assert builds == [("llama.cpp check", False)]
    assert setup_peers.llama_checked()
    found = json.loads(setup_peers.check_record().read_text())
    assert found["amx"] is False and "SIGILL" in found["reason"] and "-mno-amx-int8" in found["reason"]

    # a binary that fails otherwise is not rebuilt: the step fails with its exit and output
    _fake_llama_server("#!/bin/sh\necho 'no such model' >&2\nexit 1\n")
    assert not setup_peers.llama_checked()  # a new binary makes the record stale
    with pytest.raises(setup_peers.SetupError, match="llama.cpp check.*exited 1.*no such model"):
        setup_peers.check_llama()
    assert len(builds) == 1


def test_ttft_workload_shares_only_the_system_prompt():
    tok = H.default_tokenizer()
    plan = ttft.TtftPlan(prefix_lens=(30, 100), lone=2, concurrent=3)
    built = ttft.build(tok, plan, seed=1)
    assert sorted(built) == [30, 100]
    prime, lone, burst = built[100]
    assert (len(prime), len(lone), len(burst)) == (1, 2, 3)
    prompts = [r.prompt for r in prime + lone + burst]
    system = os.path.commonprefix(prompts)
    assert len(set(prompts)) == len(prompts)
    assert 95 <= len(tok.encode(system, add_special_tokens=False)) <= 105
    again = ttft.build(tok, plan, seed=2)[100][1][0].prompt
    assert not again.startswith(system)  # a later pass draws fresh texts
    assert ttft.level_names(plan)[:2] == ["prefix 30: lone", "prefix 30: 3 concurrent"]
    with pytest.raises(ValueError):
        ttft.TtftPlan(prefix_lens=())


def _level(failed=0, out=100, dur=2.0, ttft_p50=50.0):
    return {"failed": failed, "total_output_tokens": out, "duration_s": dur, "ttft": {"p50_ms": ttft_p50}}


def test_sweep_score_prefers_speed_and_refuses_failures():
    assert serve_launch.score({"a": _level(), "b": _level(out=300, dur=2.0)}, False) == pytest.approx(100.0)
    assert serve_launch.score({"a": _level(ttft_p50=20.0), "b": _level(ttft_p50=30.0)}, True) == pytest.approx(40.0)
    assert serve_launch.score({"a": _level(failed=1)}, False) is None


def test_server_floors_come_from_the_ceilings_measured_in_the_run():
    ceil = {"matmul_gflops": 10.0, "weight_read_gb_s": 2.0, "weight_bytes": 500_000_000, "non_embedding_params": 10**8,
            "weight_reader": "sum"}
    level = {"total_input_tokens": 300, "total_output_tokens": 100}
    matmul, weight_read = serve_launch.floors([ceil, dict(ceil, matmul_gflops=30.0), dict(ceil, matmul_gflops=20.0)],
                                              level)
    assert matmul == pytest.approx(100 / (2e8 * 400 / 20e9))  # the median rate, 20 GFLOP/s
    assert weight_read == pytest.approx(4.0)
    assert "10.0-30.0 GFLOP/s" in serve_launch.ceilings_line([ceil, dict(ceil, matmul_gflops=30.0)])


def test_the_ceiling_probe_reads_again_between_the_passes_and_the_floors_take_the_median(monkeypatch):
    """serve.py reads the ceilings before the rounds, as one more system of the interleaved
    rounds (between the servers' passes) and after them; the floors come from the median of every
    reading, so a drift of the machine's bandwidth during the run moves the floor with it."""
    import torch

    bandwidths = iter([10.0, 40.0, 20.0, 30.0])
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(serve_launch.H, "load", lambda name, dtype: (model, None))
    monkeypatch.setattr(serve_launch.H, "weight_read_bandwidth", lambda m, repeats: (next(bandwidths), 1_000, "sum"))
    monkeypatch.setattr(serve_launch.H, "matmul_rate", lambda dtype, n, seconds: 50.0)
    monkeypatch.setattr(serve_launch.H, "non_embedding_params", lambda m: 20)
    probe = serve_launch.CeilingProbe("ref", "float32")
    probe.measure()
    H = serve_launch.H
    reading = H.ceiling_probe(lambda: probe.measure()["weight_read_gb_s"], "GB/s")
    samples = H.run_interleaved({"server": lambda: H.Sample(1.0, 5.0, None, {}), H.CEILING: reading}, repeats=2,
                                warmup=False, worker=False, log=lambda s: None)
    assert [s.tok_s for s in samples[H.CEILING]] == [40.0, 20.0]
    probe.measure()
    probe.close()
    assert probe.model is None and [c["weight_read_gb_s"] for c in probe.readings] == [10.0, 40.0, 20.0, 30.0]
    level = {"total_input_tokens": 300, "total_output_tokens": 100}
    assert serve_launch.floors(probe.readings, level)[1] == pytest.approx(25e9 / 1_000)  # the median, 25 GB/s
    assert "4 readings" in serve_launch.ceilings_line(probe.readings)


def test_a_quantized_server_is_read_against_the_bytes_of_its_own_file(work):
    """The one-stream floor of a server that loads a GGUF at a quant type is its file's tensor
    bytes, not the float reference's; a float contbatch server keeps the reference's."""
    import numpy as np
    from gguf import GGUFWriter

    path = paths.gguf_path("smollm2-135m", "Q4_0")
    path.parent.mkdir(parents=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.zeros((4, 8), dtype=np.float32))  # 128 bytes
    writer.add_tensor("b", np.zeros(16, dtype=np.float32))  # 64 bytes
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()

    def server(system, **setting):
        return servers.Server(system, setting, "http://127.0.0.1:1/v1", "smollm2-135m", None, work / "log")

    assert serve_launch.read_bytes(server("llamacpp", np=32, quant="Q4_0")) == (192, "the Q4_0 GGUF's tensors")
    assert serve_launch.read_bytes(server("contbatch", quant="q4_0"))[0] == 192
    assert serve_launch.read_bytes(server("contbatch")) is None and serve_launch.read_bytes(server("vllm")) is None
    ceil = {"matmul_gflops": 10.0, "weight_read_gb_s": 2.0, "weight_bytes": 500_000_000, "non_embedding_params": 10**8,
            "weight_reader": "sum"}
    level = {"total_input_tokens": 300, "total_output_tokens": 100}
    assert serve_launch.floors([ceil], level, 100_000_000)[1] == pytest.approx(20.0)  # 2 GB/s over 100 MB
    line = serve_launch.ceilings_line([ceil], {"llamacpp": (90_000_000, "the Q4_0 GGUF's tensors"), "vllm": None})
    assert "llamacpp 90 MB (the Q4_0 GGUF's tensors); the others the reference model's" in line


def test_external_engine_is_posted_with_its_token_check_but_ours_is_not():
    wl = Workload("fixed", "text", [[1, 2, 3]], [2])
    wl.reference = [[5, 6]]
    wrong = [H.Sample(1.0, 2, [[5, 7]])]
    ok_vllm, label = posted(RowResult(Config("vllm", ()), "default", wrong), wl)
    ok_ours, _ = posted(RowResult(Config("contbatch", ()), "default", wrong), wl)
    assert ok_vllm and not ok_ours and "1" in label
    short = [H.Sample(1.0, 1, [[5]])]
    assert not posted(RowResult(Config("vllm", ()), "default", short), wl)[0]  # the count still binds


def test_scenario_table_has_a_ratio_column_per_peer_that_ran():
    sp = H.Spread.of([10.0, 11.0])
    row = {"system": "x", "role": "default", "_spread": sp, "posted": True, "check": "ok", "floor_fraction": 0.5,
           "notes": "", "_vs": {"tf-cb": None, "padded": None, "vllm": None}}
    with_vllm = scenario_table([dict(row, family="contbatch"), dict(row, family="vllm")])
    without = scenario_table([dict(row, family="contbatch"), dict(row, family="padded")])
    assert "vs vLLM (CPU) best" in with_vllm and "vs vLLM (CPU) best" not in without
    assert "vs padded generate best" in without and math.isfinite(sp.median)


def test_offline_leaves_vllm_out_until_set_up_and_refuses_it_when_asked(work, capsys):
    import offline

    args = offline.parse_args(["--quick"])
    assert "vllm" not in args.families and "contbatch" in args.families
    assert "make bench-peers" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        offline.parse_args(["--systems", "contbatch,vllm"])
    assert "run `make bench-peers` first" in capsys.readouterr().err
    assert offline.parse_args(["--model", "smollm2-135m"]).model == str(work / "models" / "smollm2-135m")
