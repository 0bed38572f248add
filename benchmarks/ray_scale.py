"""Ray Serve: 1 vs 2 replicas behind one endpoint, and prefix-aware vs random routing.

Part 1, scale: the same closed-loop load (`--requests` completions of `--new-tokens` greedy
tokens, `--concurrency` clients) against one replica with all the CPUs and two replicas with
half each, the two deployments interleaved over `--repeats` rounds (redeployed between runs;
deploying is not timed). Reported: output tok/s and request latency p50, medians [min, max],
and the 2-vs-1 ratio. On a 2-core machine expect little: two replicas split the same two
cores that one replica's engine already uses, so this measures the overhead of the front and
of a second engine more than any gain; the gain needs more machines (or cores) per replica.

Part 2, routing: on the 2-replica deployment, `--systems` long system prompts x
`--per-system` user turns, sent one at a time, with the replicas' prefix caches reset before
each policy: prefix-aware routing (ours), Serve's default power-of-two-choices, and random
pins (seeded). Reported from the replicas' own /metrics counters: prefix-cache hit rate (hit
tokens / prompt tokens looked up) and each replica's share of the requests.

    python benchmarks/ray_scale.py [--model DIR] [--requests 32] [--new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import concurrent.futures
import random
import socket
import statistics
import time

import httpx

import harness as H

REPLICA_HEADER = "x-contbatch-replica"
QUESTIONS = ["How do I renew a book?", "When do you open on Sunday?", "Can I print in colour?",
             "How much is a late fee?", "Can I book a room?", "Do you lend laptops?",
             "How do interlibrary loans work?", "Are there events for children?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(model: str | None, replicas: int, port: int, prefix_routing: bool = True):
    from contbatch import ContinuousBatchingConfig
    from contbatch.ray import EngineSpec, ServeOptions, replica_actors, run_serve
    from contbatch.server import ServerSettings

    from ray import serve

    # Serve's rolling update starts the new replicas before it stops the old ones, and the 2
    # CPUs cannot hold both: delete the previous deployment first (not timed).
    if serve.status().applications:
        serve.delete("contbatch")
    cpus = 2.0 / replicas * 0.9  # the front takes 0.1 CPU of the 2
    spec = EngineSpec(model=model, config=ContinuousBatchingConfig(block_size=16, max_prompt_length=512,
                                                                   max_generated_length=64),
                      torch_threads=max(1, 2 // replicas))
    run_serve(spec, ServerSettings(served_model_names=("m",)),
              ServeOptions(num_replicas=replicas, num_cpus=cpus, port=port, prefix_routing=prefix_routing))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        ids = list(replica_actors())
        if len(ids) == replicas and all(
                httpx.get(url + "/health", headers={REPLICA_HEADER: r}, timeout=30).status_code == 200 for r in ids):
            return url, sorted(ids)
        time.sleep(0.5)
    raise RuntimeError("replicas did not become healthy")


def load_run(url: str, prompts: list[str], new_tokens: int, concurrency: int) -> dict:
    def one(prompt: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(n for _, n in results) / wall, "p50_s": statistics.median(t for t, _ in results)}


def counters(url: str, replica: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", headers={REPLICA_HEADER: replica}, timeout=30).text
    out = {}
    for line in text.splitlines():
        for name in ("contbatch:prefix_cache_hits_total", "contbatch:prefix_cache_queries_total"):
            if line.startswith(name):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out["contbatch:prefix_cache_hits_total"], out["contbatch:prefix_cache_queries_total"]


def routing_run(url: str, replicas: list[str], requests: list[dict], pins: list[str | None]) -> dict:
    for r in replicas:
        httpx.post(url + "/reset_prefix_cache", headers={REPLICA_HEADER: r}, timeout=60).raise_for_status()
    before = {r: counters(url, r) for r in replicas}
    served: dict[str, int] = {r: 0 for r in replicas}
    for body, pin in zip(requests, pins):
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600,
                          headers={REPLICA_HEADER: pin} if pin else {})
        resp.raise_for_status()
        served[resp.headers[REPLICA_HEADER]] = served.get(resp.headers[REPLICA_HEADER], 0) + 1
    after = {r: counters(url, r) for r in replicas}
    hits = sum(after[r][0] - before[r][0] for r in replicas)
    queries = sum(after[r][1] - before[r][1] for r in replicas)
    return {"hit_rate": hits / max(queries, 1), "share": [served[r] for r in replicas]}


def chat_workload(systems: int, per_system: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    base = ("You are the assistant of library branch {i}. Opening hours, fees, rooms, printing and loans "
            "differ per branch; answer for branch {i} only, briefly, and say when you do not know. ")
    reqs = [{"model": "m", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": base.format(i=i) * 4},
        {"role": "user", "content": rng.choice(QUESTIONS)}]} for _ in range(per_system) for i in range(systems)]
    rng.shuffle(reqs)
    return reqs


def main() -> None:
    ap = H.parser(__doc__, whole_doc=True)
    ap.add_argument("--model", default=None, help="local HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--per-system", type=int, default=6)
    args = H.parse(ap)

    import ray
    from ray import serve

    load = H.LoadRange()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = free_port()
    prompts = [f"Write a short note number {i} about the weather in a small town:" for i in range(args.requests)]
    runs: dict[int, list[dict]] = {1: [], 2: []}
    current = None
    try:
        for rnd, n in H.rounds([1, 2], args.repeats):  # 1, 2 / 2, 1 / ...
            if current != n:
                url, ids = deploy(args.model, n, port)
                current = n
                load_run(url, prompts[:4], 4, 4)  # warm-up, untimed
            runs[n].append(load_run(url, prompts, args.new_tokens, args.concurrency))
            print(f"round {rnd} replicas={n}: {runs[n][-1]}", flush=True)
        if current != 2:
            url, ids = deploy(args.model, 2, port)
        reqs = chat_workload(args.systems, args.per_system)
        rng = random.Random(1)
        routing = {"prefix-aware (ours)": routing_run(url, ids, reqs, [None] * len(reqs)),
                   "random pins": routing_run(url, ids, reqs, [rng.choice(ids) for _ in reqs])}
        url, ids = deploy(args.model, 2, port, prefix_routing=False)
        routing["Serve default (power of two)"] = routing_run(url, ids, reqs, [None] * len(reqs))
    finally:
        serve.shutdown()
        ray.shutdown()
    load.sample()

    tok = {n: H.Spread.of([r["tok_s"] for r in runs[n]]) for n in runs}
    p50 = {n: H.Spread.of([r["p50_s"] for r in runs[n]]) for n in runs}
    print(f"\nMachine: {H.machine_line(H.machine_info())}; {load.line()} before and after\n")
    print(H.md_table(["replicas", "output tok/s", "latency p50 (s)"],
                     [[n, tok[n].fmt(".1f"), p50[n].fmt(".2f")] for n in (1, 2)]))
    print(f"\n2 vs 1 replicas, throughput: {H.fmt_ratio(H.ratio(tok[2], tok[1]))}\n")
    print(H.md_table(["routing", "prefix hit rate", "requests per replica"],
                     [[k, f"{v['hit_rate']:.1%}", " / ".join(map(str, v["share"]))] for k, v in routing.items()]))


if __name__ == "__main__":
    main()
