"""One rank of a tensor-parallel test run (tests/test_tensor_parallel.py starts N of these).

Every rank loads the model sharded; workers run rank 0's steps; rank 0 runs the scenario
named on the command line and writes what it saw as JSON. Kept out of the test module so each
rank imports nothing of pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, load_model
from contbatch.engine import run_worker


def prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def sharding(model) -> dict:
    from torch.distributed.tensor import DTensor

    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    return {"dtensor": isinstance(q, DTensor), "q_proj_global": list(q.shape), "q_proj_local": list(q.to_local().shape),
            "k_proj_local": list(k.to_local().shape)}


def scenario_generate(manager, model, args) -> dict:
    """A mixed batch (chunked prefills beside decodes, 4-token blocks), a long request cancelled
    mid-way, and a graceful stop right after submitting: everything drains on every rank."""
    ps = prompts(args.requests, model.config.vocab_size)
    victim = manager.add_request(ps[0] * 3, sampling_params=SamplingParams(max_new_tokens=300, ignore_eos=True))
    while not manager.stats()["steps"]:
        time.sleep(0.005)
    ids = manager.add_requests(ps, sampling_params=SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
    manager.cancel_request(victim)
    manager.stop()  # graceful: what was submitted finishes
    outs = [manager.get_result(rid, timeout=5) for rid in ids]
    cancelled = manager.get_result(victim, timeout=5)
    return {"prompts": ps, "tokens": [o.generated_tokens for o in outs], "statuses": [o.status.value for o in outs],
            "cancelled": cancelled.status.value, "cancelled_tokens": len(cancelled.generated_tokens),
            "cached_tokens": [o.cached_tokens for o in outs]}


def scenario_pressure(manager, model, args) -> dict:
    """KV pressure with the CPU offload tier: victims' blocks go to the host and back on every
    rank (rank 0 sends its host copies with the next step), and every token stays exact."""
    import random

    rng = random.Random(21)
    ps = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(10, 30))] for _ in range(20)]
    ids = manager.add_requests(ps, sampling_params=SamplingParams(max_new_tokens=16, ignore_eos=True))
    outs = [manager.get_result(rid, timeout=120) for rid in ids]
    stats = manager.stats()
    return {"prompts": ps, "tokens": [o.generated_tokens for o in outs], "offloads": stats["offloads"],
            "restores": stats["restores"]}


def scenario_speculative(manager, model, args) -> dict:
    """n-gram speculation under TP: verification runs are ordinary steps rank 0 sends whole."""
    ps = [p * 4 for p in prompts(6, model.config.vocab_size)]
    ids = manager.add_requests(ps, sampling_params=SamplingParams(max_new_tokens=16, ignore_eos=True))
    outs = [manager.get_result(rid, timeout=120) for rid in ids]
    stats = manager.stats()
    return {"prompts": ps, "tokens": [o.generated_tokens for o in outs],
            "drafted": stats["spec_decode_num_draft_tokens"], "accepted": stats["spec_decode_num_accepted_tokens"]}


def scenario_hard_stop(manager, model, args) -> dict:
    ps = prompts(3, model.config.vocab_size)
    ids = manager.add_requests(ps, sampling_params=SamplingParams(max_new_tokens=500, ignore_eos=True))
    while not manager.stats()["steps"]:
        time.sleep(0.01)
    manager.stop(hard_stop=True)
    outs = [manager.get_result(rid, timeout=5) for rid in ids]
    return {"statuses": [o.status.value for o in outs], "errors": [o.error for o in outs]}


def scenario_kill(manager, model, args, sig=signal.SIGKILL) -> dict:
    """Kill worker rank 1 mid-generation (or freeze it: `hang`): rank 0 must fail every request,
    with a clear error, within its timeout."""
    ps = prompts(3, model.config.vocab_size)
    ids = manager.add_requests(ps, sampling_params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    while manager.stats()["steps"] < 3:
        time.sleep(0.01)
    worker = int(open(args.worker_pid_file).read())
    os.kill(worker, sig)
    t0 = time.perf_counter()
    outs = [manager.get_result(rid, timeout=60) for rid in ids]
    seconds = time.perf_counter() - t0
    deadline = time.time() + 10
    while manager.is_running() and time.time() < deadline:  # the engine ends itself
        time.sleep(0.01)
    late = None
    try:
        manager.add_request(ps[0])
    except RuntimeError as exc:
        late = str(exc)
    if sig != signal.SIGKILL:
        os.kill(worker, signal.SIGKILL)  # a frozen process is no use to anyone now
    return {"statuses": [o.status.value if o else None for o in outs], "errors": [o.error if o else None for o in outs],
            "seconds": seconds, "late_add": late}


def scenario_kill_driver(manager, model, args) -> dict:
    """Rank 0 dies mid-generation: the worker must notice and end (checked by the test)."""
    manager.add_requests(prompts(3, model.config.vocab_size),
                         sampling_params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    while manager.stats()["steps"] < 3:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_freeze_driver(manager, model, args) -> dict:
    """Rank 0 hangs (SIGSTOP) while idle: the worker hears nothing, not even a heartbeat, for
    the timeout and must end (checked by the test), so that the launcher ends the group."""
    ids = manager.add_requests(prompts(2, model.config.vocab_size),
                               sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    for rid in ids:
        manager.get_result(rid, timeout=60)
    os.kill(os.getpid(), signal.SIGSTOP)


def scenario_hang(manager, model, args) -> dict:
    return scenario_kill(manager, model, args, signal.SIGSTOP)


SCENARIOS = {"generate": scenario_generate, "hard_stop": scenario_hard_stop,
             "kill": scenario_kill, "hang": scenario_hang, "pressure": scenario_pressure,
             "kill_driver": scenario_kill_driver, "freeze_driver": scenario_freeze_driver,
             "speculative": scenario_speculative}
CONFIGS = {"speculative": dict(block_size=4, max_batch_tokens=48, num_blocks=256,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
           "pressure": dict(block_size=4, num_blocks=14, max_batch_tokens=32, safety_margin=0.0, cpu_offload_space=1.0,
                            allow_block_sharing=False)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--worker-pid-file", default=None)
    p.add_argument("--worker-out", default=None, help="a worker writes the steps it ran here")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, tp_plan="auto")
    if dist.get_rank() != 0:
        if args.worker_pid_file:
            open(args.worker_pid_file, "w").write(str(os.getpid()))
        from contbatch.distributed import RankFailure

        try:
            report = {"steps": run_worker(model)}
        except RankFailure as exc:  # rank 0 is gone: say so and end, never hang
            report = {"rank_failure": str(exc)}
        if args.worker_out:
            with open(args.worker_out, "w") as f:
                json.dump(report, f)
        if "steps" not in report:
            raise SystemExit(1)  # as the CLI's worker does: the launcher sees a rank gone
        dist.destroy_process_group()
        return
    config = ContinuousBatchingConfig(**CONFIGS.get(args.scenario, dict(block_size=4, max_batch_tokens=48,
                                                                         num_blocks=256)))
    manager = ContinuousBatchingManager(model, None, config)
    try:
        try:
            result = {"resolved": {k: v for k, v in manager.resolved_config.as_dict().items()
                                   if k in ("tp_size", "tp_rank", "tp_backend", "kv_heads_per_rank", "num_blocks")},
                      "sharding": sharding(model)}
            runner = manager.core.runner
            manager.start()
            result.update(SCENARIOS[args.scenario](manager, model, args))
            result["steps_sent"] = runner.sends
        finally:
            manager.stop()
            manager.destroy()
            manager.destroy()  # idempotent
        result["destroyed_twice"] = True
    except Exception as exc:
        result = {"exception": repr(exc)}
    with open(args.out, "w") as f:
        json.dump(result, f)
    if args.scenario not in ("kill", "hang"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
