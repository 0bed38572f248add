"""The measurements behind benchmarks/gpu_check.py: one engine run, one transformers run, the
greedy reference, the copy bandwidth, and a deadline around each of them."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time
from math import ceil
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig

import contbatch

# Keys the engine's stats() gains with the GPU path; missing ones read as 0.0 and are reported.
GPU_STAT_KEYS = ("gpu_busy_seconds", "decode_only_steps", "decode_only_rows", "gpu_decode_seconds",
                 "graph_captures", "graph_replays")
RESOLVED_KEYS = ("attention_backend", "decode_fast_path", "use_cuda_graph", "use_async_batching", "kv_layout",
                 "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "dtype", "device")


class RunTimeout(RuntimeError):
    """A run outlived its deadline; `still_running`: its thread may still be using the device."""

    def __init__(self, msg: str, still_running: bool) -> None:
        super().__init__(msg)
        self.still_running = still_running


def with_deadline(fn, seconds: float, on_timeout=None):
    """Run fn in a daemon thread and wait at most `seconds`. On timeout call `on_timeout()`
    (e.g. hard-stop an engine), wait 15 s more for the thread, then raise RunTimeout."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, name="gpu-check-run", daemon=True)
    t.start()
    seconds = max(1.0, seconds)
    t.join(seconds)
    if t.is_alive():
        if on_timeout is not None:
            try:
                on_timeout()
            except Exception:  # noqa: BLE001 - best effort
                pass
        t.join(15)
        alive = t.is_alive()
        raise RunTimeout(f"run exceeded its {seconds:.0f} s budget" + (" (thread still running)" if alive else ""), alive)
    if "error" in box:
        raise box["error"]
    return box["value"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Ids in [3, vocab): never pad/bos/eos (0, 1, 2 in every model here). Random, so no two
    prompts share a block and prefix caching does nothing."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def copy_bandwidth(device: str, nbytes: int) -> dict:
    """Device-to-device copy of one large tensor: (bytes read + bytes written) / time."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    iters = 10
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    free_memory(device)
    bw = 2 * nbytes * iters / seconds
    return {"bytes": nbytes, "iters": iters, "seconds": seconds, "bytes_per_s": bw}


@torch.inference_mode()
def reference_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """`model.generate` per prompt, unpadded, greedy, EOS disabled; also the top-1/top-2 logit
    margin at every step, so a mismatch can be told apart from a near-tie."""
    device = next(model.parameters()).device
    gc_ = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # generate() fills a None eos from the model's own config
    tokens, margins = [], []
    try:
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
            tokens.append(out.sequences[0, len(p):].tolist())
            margins.append([float(t[0].float().topk(2).values.diff().abs()) for t in out.logits])
    finally:
        model.generation_config.eos_token_id = saved
    return tokens, margins


def blocks_needed(prompts: list[list[int]], new_tokens: int, block_size: int) -> int:
    return sum(ceil((len(p) + new_tokens) / block_size) for p in prompts)


STAT_KEYS = ("steps", "step_seconds", "forward_seconds", *GPU_STAT_KEYS)


def _stats(st: dict) -> dict:
    return {k: st.get(k, 0.0) for k in STAT_KEYS}


def run_contbatch(model, prompts: list[list[int]], new_tokens: int, device: str, budget_s: float,
                  second: list[list[int]] | None = None, **cfg_kwargs) -> dict:
    """One engine run through the manager (what contbatch.generate_batch does, plus stats).
    e2e wall: the manager's start-up, the batch, and its shutdown; gen wall: first add -> last result.
    With `second` (prompts of the same shapes, no shared prefixes), a second batch follows in the
    same manager and `warm` reports it alone: steady state, every CUDA graph already captured.
    Our C++ CPU kernels are off unless asked for: a fresh GPU machine must not spend its time
    building them (they serve CPU models only; in a CPU dry run PyTorch's own ops are exact too)."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cfg = contbatch.ContinuousBatchingConfig(
        max_prompt_length=max(len(p) for p in prompts + (second or [])), max_generated_length=new_tokens,
        max_requests_per_batch=len(prompts), **{"cpu_kernels": "off", **cfg_kwargs})
    box: dict = {}

    def batch(manager, batch_prompts: list[list[int]], tag: str) -> tuple[list, float]:
        ids = [f"{tag}_{i}" for i in range(len(batch_prompts))]
        t = time.perf_counter()
        manager.add_requests(batch_prompts, request_ids=ids)
        outs = [manager.get_result(rid, timeout=None) for rid in ids]
        return outs, time.perf_counter() - t

    def body() -> dict:
        sync(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        warm = None
        with contbatch.continuous_batching(model, gen, cfg) as manager:
            box["manager"] = manager
            startup = time.perf_counter() - t0
            outs, gen_s = batch(manager, prompts, "req")
            first = manager.stats()
            resolved = manager.resolved_config
            if second:
                outs2, gen2 = batch(manager, second, "warm")
                warm = {"outs": outs2, "gen_s": gen2}
        total = time.perf_counter() - t0
        try:
            last = manager.stats()  # after the engine thread joined: every step counted
        except Exception:  # noqa: BLE001 - a destroyed manager may not report; keep the inside reading
            last = first
        if warm is None:
            first = last
        else:
            warm["stats"] = {k: v - first.get(k, 0.0) for k, v in _stats(last).items()}
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        e2e = total - (warm["gen_s"] if warm else 0.0)  # start-up + first batch + shutdown
        return {"outs": outs, "e2e_s": e2e, "gen_s": gen_s, "startup_s": startup, "stats": first,
                "resolved": resolved, "peak_gib": peak, "warm": warm}

    def stop() -> None:
        if "manager" in box:
            box["manager"].stop(hard_stop=True, timeout=10)

    def errors(outs) -> list[str]:
        return sorted({f"{o.status.value}: {o.error}" for o in outs if o.error or o.status.value != "finished"})

    r = with_deadline(body, budget_s, on_timeout=stop)
    outs = r.pop("outs")
    r["tokens"] = [list(o.generated_tokens) for o in outs]
    r["errors"] = errors(outs)
    rc = r.pop("resolved")
    r["resolved"] = {k: getattr(rc, k, None) for k in RESOLVED_KEYS}
    r["resolved"]["warnings"] = list(getattr(rc, "warnings", ()) or ())
    r["resolved"]["notes"] = list(getattr(rc, "notes", ()) or ())
    r["missing_stats"] = [k for k in GPU_STAT_KEYS if k not in r["stats"]]
    r["stats"] = _stats(r["stats"])
    r["output_tokens"] = sum(map(len, r["tokens"]))
    if r["warm"]:
        outs2 = r["warm"].pop("outs")
        r["warm"]["output_tokens"] = sum(len(o.generated_tokens) for o in outs2)
        r["warm"]["errors"] = errors(outs2)
    return r


def tf_attention() -> str:
    """transformers' paged path keeps the model's attention name: 'sdpa' runs its paged SDPA
    (transformers 5.24 rejects the literal 'paged|sdpa'); a flash name runs paged flash."""
    import importlib.util

    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def run_transformers_cb(model, prompts: list[list[int]], new_tokens: int, device: str, budget_s: float,
                        max_batch_tokens: int, num_blocks: int, page_size: int = 256) -> dict:
    """The peer: `model.generate_batch` with its defaults (CUDA graphs, async, warm-up as it
    decides), the same explicit cache size and step budget as ours. eos_token_id=-1 is how it
    spells 'never stop on EOS'. gen wall = first request created -> last request finished."""
    attn = tf_attention()
    if model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    cfg = transformers.ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                                max_batch_tokens=max_batch_tokens, max_requests_per_batch=len(prompts))
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)

    def body() -> dict:
        sync(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cfg,
                                    progress_bar=False)
        sync(device)
        t1 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        return {"outs": list(outs.values()), "e2e_s": t1 - t0, "peak_gib": peak}

    r = with_deadline(body, budget_s)
    outs = r.pop("outs")
    r["tokens"] = [list(o.generated_tokens) for o in outs]
    r["errors"] = sorted({str(o.error) for o in outs if o.error})
    if len(outs) != len(prompts):
        r["errors"].append(f"{len(prompts) - len(outs)} requests missing")
    starts = [o.created_time for o in outs]
    ends = [o.lifespan[1] for o in outs if o.lifespan and o.lifespan[1] > 0]
    r["gen_s"] = (max(ends) - min(starts)) if starts and len(ends) == len(outs) else None
    r["output_tokens"] = sum(map(len, r["tokens"]))
    r["attn"] = f"{attn} (transformers' paged path)"
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    return r


def env_info(device: str) -> dict:
    import importlib.metadata as md
    import importlib.util

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "transformers_path": str(Path(transformers.__file__).parent), "device": device,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None}
    for pkg in ("triton", "tokenizers", "huggingface_hub", "safetensors"):
        try:
            info[pkg] = md.version(pkg)
        except Exception:  # noqa: BLE001
            info[pkg] = None
    # `import contbatch` must not pull in the server stack (fastapi etc. need not be installed to run the engine).
    info["contbatch_server_modules_imported"] = sorted(m for m in sys.modules if m.startswith("contbatch.server"))
    info["fastapi_imported"] = "fastapi" in sys.modules
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["device_name"] = f"CPU ({os.cpu_count()} cores)"
    return info


# bfloat16: greedy output of a batched engine equals `model.generate`'s until a near-tie, where
# the two orders of summation may pick either token (the rule of tests/test_compile.py, with a
# bf16-sized threshold: a few bf16 rounding steps of a logit). Past the first divergence the
# sequences are different texts and are not compared.
BF16_NEAR_TIE = 0.125


def agreement(got: list[list[int]], ref: list[list[int]], margins: list[list[float]], near_tie: float) -> dict:
    """Compare the first len(ref) outputs with the reference: `ok` when each is equal, or first
    differs at a position where the reference's top-2 logit margin is below `near_tie`."""
    compared, bad, ties = 0, [], []
    for i, (g, want) in enumerate(zip(got, ref)):
        k = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), None)
        if k is None:
            compared += min(len(g), len(want))
            if len(g) != len(want):
                bad.append(f"prompt {i}: {len(g)} tokens, reference {len(want)}")
            continue
        compared += k + 1
        m = margins[i][k]
        (ties if m < near_tie else bad).append(f"prompt {i}: first differs at token {k}, reference margin {m:.3g}")
    ok = not bad and len(got) >= len(ref)
    return {"ok": ok, "prompts": len(ref), "tokens_compared": compared, "near_ties": ties, "mismatches": bad,
            "near_tie_threshold": near_tie}
