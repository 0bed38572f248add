"""Start and stop the servers `serve.py` compares: `contbatch serve`, `vllm serve` (the peers'
venv) and `llama-server` (the native build), each on its own loopback port, same weights.

`launch(system, model, dtype, setting, port)` starts one and returns once its `/v1/models`
answers (or raises `PeerError` with the tail of its log); `Server.stop()` ends it (SIGTERM,
then SIGKILL). Logs go to `<work dir>/logs/`. A spec on the command line reads
`SYSTEM[:knob=v,...]`, e.g. `llamacpp:np=8,t=2,quant=F32` (knobs: `knobs.py`; contbatch takes
`mbt`, `block` and `quant`: a GGUF type (Q8_0, Q4_0, ...) serves the peers' GGUF file of that
type at its own quantization, as llama.cpp does; int8 / int4 quantize the safetensors at load).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from contbatch.setup.quantize import METHODS as QUANTIZE_AT_LOAD  # `contbatch serve --quantization`
from peers import knobs, paths
from peers.vllm_offline import PeerError

SYSTEMS = ("contbatch", "vllm", "llamacpp")
CONTBATCH_KNOBS = ("mbt", "block", "quant")
READY_TIMEOUT_S = 900.0


@dataclass
class Server:
    system: str
    setting: dict
    url: str  # .../v1
    name: str  # the model name clients send
    proc: subprocess.Popen
    log: Path
    startup_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.system}:{knobs.label(self.setting)}" if self.setting else self.system

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def parse_spec(spec: str) -> tuple[str, dict]:
    """`SYSTEM[:k=v,...]` -> (system, setting)."""
    system, _, rest = spec.partition(":")
    if system not in SYSTEMS:
        raise ValueError(f"unknown server system {system!r}; one of {', '.join(SYSTEMS)}")
    return system, knobs.parse_setting(rest)


def contbatch_argv(model: str, dtype: str, setting: dict, port: int, name: str) -> list[str]:
    knobs.check(setting, CONTBATCH_KNOBS, "contbatch")
    quant = str(setting.get("quant") or "")
    if quant.lower() in QUANTIZE_AT_LOAD:
        extra = ["--quantization", quant.lower()]
    elif quant:
        model, extra = str(paths.gguf_path(name, quant)), []  # the same file llama.cpp serves
    else:
        extra = []
    exe = shutil.which("contbatch", path=str(Path(sys.executable).parent)) or "contbatch"
    argv = [exe, "serve", "--model", model, "--dtype", dtype, "--port", str(port), "--served-model-name", name,
            "--uvicorn-log-level", "warning"]
    if setting.get("mbt"):
        argv += ["--max-batch-tokens", str(setting["mbt"])]
    if setting.get("block"):
        argv += ["--block-size", str(setting["block"])]
    return argv + extra


def command(system: str, model_name: str, dtype: str, setting: dict, port: int) -> tuple[list[str], dict]:
    """(argv, extra environment) of one server; `model_name` is a peer model (`paths.MODELS`)."""
    folder = str(paths.model_dir(model_name))
    if system == "contbatch":
        return contbatch_argv(folder, dtype, setting, port, model_name), {}
    if system == "vllm":
        if not paths.venv_python().is_file():
            raise PeerError("vLLM is not set up: run `make bench-peers`")
        return knobs.vllm_serve_argv(folder, dtype, setting, port, model_name), knobs.vllm_env(setting)
    if dtype != "float32" and not setting.get("quant"):  # its type is the file's: say which with quant=
        raise ValueError(f"llama.cpp runs the GGUF's own type: beside --dtype {dtype}, name it with quant=... "
                         "(e.g. quant=BF16)")
    if not paths.llama_bin("llama-server").is_file():
        raise PeerError("llama-server is not built: run `make bench-peers`")
    return knobs.llama_server_argv(model_name, setting, port, model_name), {}


def wait_ready(server: Server, timeout: float) -> None:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if not server.alive():
            raise PeerError(f"{server.label} exited {server.proc.returncode} while starting:\n"
                            f"{server.log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(server.url + "/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise PeerError(f"{server.label} not ready after {timeout:.0f} s; log: {server.log}")


def launch(system: str, model_name: str, dtype: str, setting: dict, port: int,
           timeout: float = READY_TIMEOUT_S, extra_argv: tuple[str, ...] = ()) -> Server:
    """Start one server and wait until it answers; its process group is its own (stop() ends all of it).
    `extra_argv`: more flags of that system's own command line (e.g. its LoRA adapters)."""
    argv, extra = command(system, model_name, dtype, setting, port)
    argv = [*argv, *extra_argv]
    env = {**os.environ, **extra}
    if system == "vllm":
        env.pop("PYTHONPATH", None)
    log = paths.work_dir() / "logs" / f"serve-{system}-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=str(paths.work_dir()))
    server = Server(system, setting, f"http://127.0.0.1:{port}/v1", model_name, proc, log)
    t = time.perf_counter()
    wait_ready(server, timeout)
    server.startup_s = time.perf_counter() - t
    return server
