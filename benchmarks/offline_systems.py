"""The systems `offline.py` compares, and the one run of each it times.

- `contbatch`: through `contbatch.continuous_batching` (what `generate_batch` does), with the
  workload hints `generate_batch` fills in; knobs `max_batch_tokens`, `block_size`, compile level.
- `tf-cb`: transformers' own continuous batching (`ContinuousBatchingConfig`, what its
  `generate_batch` uses), `num_blocks` sized for the workload; knobs `max_batch_tokens`, `page_size`.
- `padded`: `model.generate` with left padding; knobs batch size and length sorting.
- `vllm`: vLLM's CPU engine, `vllm.LLM(...).generate` on the same token ids in a fresh process
  of the peers' venv (`peers/vllm_offline.py`), on the same weights (the loaded model's folder);
  knobs in `peers/knobs.py` (thread binding, preloads, max_num_batched_tokens, max_num_seqs).
  Its start-up is paid once per setting (as a `vllm.LLM` user pays it) and each run times
  `generate` alone on that process's main thread. Left out when `make bench-peers` has not run.

A `Config` is a family and its non-default knobs; `runner()` returns the timed run of one.
Wall times include each system's start-up, because that is what a user pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from math import ceil
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig

import contbatch
import harness as H
from offline_workloads import Workload
from peers import knobs, paths, vllm_offline

FAMILIES = ("contbatch", "tf-cb", "padded", "vllm")
PEERS = ("tf-cb", "padded", "vllm")
EXTERNAL = ("vllm",)  # other engines: posted with their token check shown, not held to our exactness rule
FAMILY_TITLE = {"contbatch": "contbatch", "tf-cb": "transformers generate_batch", "padded": "padded generate",
                "vllm": "vLLM (CPU)"}
ATTENTION = {
    "contbatch": "torch backend with our C++ kernels: every prompt chunk of a step in one call, every decode row in "
                 "another, both reading K/V in place through the block tables",
    "tf-cb": "sdpa: a dense [batch tokens x (cache tokens + batch tokens)] mask built every step, attention over the "
             "whole batch's keys",
    "padded": "sdpa over the padded batch, [B, 1, q, k] mask",
    "vllm": "vLLM's CPU attention backend over its own paged KV cache (prefix caching on, chunked prefill)",
}
TF_DEFAULT_PAGE = 256  # transformers' default page_size


@dataclass(frozen=True)
class Config:
    family: str
    params: tuple  # sorted (knob, value) pairs; () = the family's default

    @property
    def label(self) -> str:
        if not self.params:
            return f"{self.family} (default)"
        return f"{self.family} " + " ".join(f"{k}={v}" for k, v in self.params)

    def get(self, key, default=None):
        return dict(self.params).get(key, default)

    def with_(self, **kw) -> "Config":
        d = dict(self.params)
        d.update(kw)
        return Config(self.family, tuple(sorted(d.items())))


def run_contbatch(model, wl: Workload, cfg: Config) -> H.Sample:
    """Through the manager (what `contbatch.generate_batch` does), so step/forward stats can be read."""
    gen = GenerationConfig(max_new_tokens=max(wl.max_new), do_sample=False, eos_token_id=None)
    sps = [contbatch.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wl.max_new]
    kw = dict(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.max_new),
              max_requests_per_batch=len(wl.prompts))  # the workload hints generate_batch fills in
    if cfg.get("mbt"):
        kw["max_batch_tokens"] = cfg.get("mbt")
    if cfg.get("block"):
        kw["block_size"] = cfg.get("block")
    if cfg.get("level") is not None:
        kw["default_compile_level"] = cfg.get("level")
    ids = [f"req_{i}" for i in range(len(wl.prompts))]
    start = time.perf_counter()
    with contbatch.continuous_batching(model, gen, contbatch.ContinuousBatchingConfig(**kw)) as manager:
        manager.add_requests(wl.prompts, request_ids=ids, sampling_params=sps)
        outs = [manager.get_result(rid, timeout=None) for rid in ids]
        stats, rc = manager.stats(), manager.resolved_config
    wall = time.perf_counter() - start
    tokens = [list(o.generated_tokens) for o in outs]
    return H.Sample(wall, sum(map(len, tokens)), tokens, {
        "steps": stats["steps"], "step_seconds": stats["step_seconds"],
        "resolved": f"mbt={rc.max_batch_tokens} blocks={rc.num_blocks}x{rc.block_size} attn={rc.attention_backend}"})


def run_tf_cb(model, wl: Workload, cfg: Config) -> H.Sample:
    """The peer: transformers' continuous batching, through the context manager `generate_batch`
    uses, so each request gets its own max_new_tokens. num_blocks is sized for the workload (left
    unset on the CPU, it zero-fills a cache sized from most of free RAM). eos_token_id=-1 is how
    it spells 'never stop on EOS'."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page = cfg.get("page", TF_DEFAULT_PAGE)
    blocks = sum(ceil((len(p) + n + 1) / page) for p, n in zip(wl.prompts, wl.max_new)) + 2
    cb = transformers.ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=cfg.get("mbt"),
                                               max_requests_per_batch=len(wl.prompts))
    gen = GenerationConfig(max_new_tokens=max(wl.max_new), do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.max_new),
                          num_requests=len(wl.prompts))
    ids = [f"req_{i}" for i in range(len(wl.prompts))]
    results: dict = {}
    resolved = ""
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                   timeout=5, workload_hints=hints) as manager:
        for rid, p, n in zip(ids, wl.prompts, wl.max_new):
            manager.add_request(input_ids=p, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None:
                if out.is_finished():
                    results[out.request_id] = out
            elif not manager.is_running():
                break
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        if cache is not None:
            resolved = f"mbt={getattr(cache, 'max_batch_tokens', '?')} blocks={blocks}x{page}"
    wall = time.perf_counter() - start
    tokens = [list(results[r].generated_tokens) if r in results else [] for r in ids]
    extra = {"resolved": resolved or f"blocks={blocks}x{page}"}
    if len(results) < len(ids):
        extra["missing"] = len(ids) - len(results)
    return H.Sample(wall, sum(map(len, tokens)), tokens, extra)


def padded_order(wl: Workload, sort: str) -> list[int]:
    idx = list(range(len(wl.prompts)))
    if sort == "prompt":
        return sorted(idx, key=lambda i: len(wl.prompts[i]))
    if sort == "new":  # requested length first, prompt length second: the least wasted decode steps
        return sorted(idx, key=lambda i: (wl.max_new[i], len(wl.prompts[i])))
    return idx


@torch.inference_mode()
def run_padded(model, tok, wl: Workload, cfg: Config) -> H.Sample:
    """Static batching with left padding: each batch runs to its longest request; only the
    requested tokens of each request count. eos_token_id=-1 rather than min_new_tokens: the
    latter masks the EOS logit and changes greedy tokens."""
    batch_size = cfg.get("batch") or len(wl.prompts)
    order = padded_order(wl, cfg.get("sort", "none"))
    tok.padding_side = "left"
    tokens: list[list[int] | None] = [None] * len(wl.prompts)
    positions = decode_slots = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        steps = max(wl.max_new[i] for i in idx)
        gen = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id)
        batch = tok.pad({"input_ids": [wl.prompts[i] for i in idx]}, return_tensors="pt", padding=True)
        out = model.generate(**batch, generation_config=gen)
        width = batch["input_ids"].shape[1]
        positions += width * len(idx)
        decode_slots += steps * len(idx)
        for row, i in enumerate(idx):
            tokens[i] = out[row, width:width + wl.max_new[i]].tolist()
    wall = time.perf_counter() - start
    return H.Sample(wall, sum(map(len, tokens)), tokens, {
        "padding": 1 - wl.prompt_tokens / positions, "wasted_decode": 1 - wl.generated_tokens / decode_slots})


def model_folder(model) -> str:
    """The folder the loaded model came from: the peers load the same weights from it."""
    folder = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"the model was not loaded from a safetensors folder ({folder}): peers need one "
                         f"(--model smollm2-135m or qwen2.5-0.5b-shape after `make bench-peers`)")
    return str(folder)


def peers_ready() -> bool:
    """Whether `make bench-peers` has set up the peers' venv."""
    return paths.venv_python().is_file()


def run_vllm(model, wl: Workload, cfg: Config) -> H.Sample:
    """`LLM.generate` in the kept worker of this setting; a fresh worker first runs one untimed
    two-token request (the rest of its start-up), so every timed run is a warm engine's."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    w = vllm_offline.worker(model_folder(model), dtype, dict(cfg.params))
    if w.proc is None:
        w.run([wl.prompts[0]], [2])
    wall, tokens = w.run(wl.prompts, list(wl.max_new))
    return H.Sample(wall, sum(map(len, tokens)), tokens,
                    {"resolved": f"{knobs.label(dict(cfg.params))}; start-up {w.startup_s:.0f} s (not in the wall)"})


def runner(model, tok, wl: Workload, cfg: Config) -> Callable[[], H.Sample]:
    if cfg.family == "vllm":
        return lambda: run_vllm(model, wl, cfg)
    if cfg.family == "contbatch":
        return lambda: run_contbatch(model, wl, cfg)
    if cfg.family == "tf-cb":
        return lambda: run_tf_cb(model, wl, cfg)
    return lambda: run_padded(model, tok, wl, cfg)

