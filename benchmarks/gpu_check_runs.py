"""The measurements behind benchmarks/gpu_check.py: one engine run, one transformers run, the
greedy reference, the copy bandwidth, and a deadline around each of them."""

from __future__ import annotations

import gc
import random
import threading
import time
from math import ceil

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
    """A run outlived its deadline; its thread may still be using the device."""


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
    t.join(max(1.0, seconds))
    if t.is_alive():
        if on_timeout is not None:
            try:
                on_timeout()
            except Exception:  # noqa: BLE001 - best effort
                pass
        t.join(15)
        raise RunTimeout(f"run exceeded its {seconds:.0f} s budget" + (" (thread still running)" if t.is_alive() else ""))
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


def run_contbatch(model, prompts: list[list[int]], new_tokens: int, device: str, budget_s: float, **cfg_kwargs) -> dict:
    """One engine run through the manager (what contbatch.generate_batch does, plus stats):
    e2e wall includes the manager's start-up and shutdown, gen wall is first add -> last result."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cfg = contbatch.ContinuousBatchingConfig(
        max_prompt_length=max(len(p) for p in prompts), max_generated_length=new_tokens,
        max_requests_per_batch=len(prompts), **cfg_kwargs)
    ids = [f"req_{i}" for i in range(len(prompts))]
    box: dict = {}

    def body() -> dict:
        sync(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with contbatch.continuous_batching(model, gen, cfg) as manager:
            box["manager"] = manager
            t1 = time.perf_counter()
            manager.add_requests(prompts, request_ids=ids)
            outs = [manager.get_result(rid, timeout=None) for rid in ids]
            t2 = time.perf_counter()
            stats_inside = manager.stats()
            resolved = manager.resolved_config
        t3 = time.perf_counter()
        try:
            stats = manager.stats()  # after the engine thread joined: every step counted
        except Exception:  # noqa: BLE001 - a destroyed manager may not report; keep the inside reading
            stats = stats_inside
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        return {"outs": outs, "e2e_s": t3 - t0, "gen_s": t2 - t1, "startup_s": t1 - t0, "stats": stats,
                "resolved": resolved, "peak_gib": peak}

    def stop() -> None:
        if "manager" in box:
            box["manager"].stop(hard_stop=True, timeout=10)

    r = with_deadline(body, budget_s, on_timeout=stop)
    outs = r.pop("outs")
    r["tokens"] = [list(o.generated_tokens) for o in outs]
    r["errors"] = sorted({f"{o.status.value}: {o.error}" for o in outs if o.error or o.status.value != "finished"})
    rc = r.pop("resolved")
    r["resolved"] = {k: getattr(rc, k, None) for k in RESOLVED_KEYS}
    r["resolved"]["warnings"] = list(getattr(rc, "warnings", ()) or ())
    r["resolved"]["notes"] = list(getattr(rc, "notes", ()) or ())
    st = r["stats"]
    r["missing_stats"] = [k for k in GPU_STAT_KEYS if k not in st]
    r["stats"] = {k: st.get(k, 0.0) for k in ("steps", "step_seconds", "forward_seconds", *GPU_STAT_KEYS)}
    r["output_tokens"] = sum(map(len, r["tokens"]))
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
