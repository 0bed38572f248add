"""Each launched server at its best: the coordinate sweep of its own knobs (`serve.py --sweep`).

For one system, each candidate setting (`knobs.vllm_stages` / `knobs.llama_stages`, tried on
top of the best so far) is started, measured by one pass of the benchmark's own workload (the
caller's `measure`: output tok/s summed over the load levels, or the inverse of the median
TTFT for the TTFT workload), and stopped; the fastest candidate whose requests all succeeded
wins. What was tried is returned, to be recorded in the report.
"""

from __future__ import annotations

from collections.abc import Callable

from peers import knobs
from peers.servers import Server, launch
from peers.vllm_offline import PeerError


def stages(system: str, mode: str, concurrency: int) -> list[list[dict]]:
    if system == "vllm":
        return knobs.vllm_stages(mode)
    if system == "llamacpp":
        return knobs.llama_stages(mode, concurrency)
    return []  # contbatch is measured at its defaults: its own sweep lives in offline.py


def sweep(system: str, model_name: str, dtype: str, base: dict, mode: str, concurrency: int, port: int,
          measure: Callable[[Server], float | None], log: Callable[[str], None]) -> tuple[dict, list[dict]]:
    """(best setting, what was tried). `measure` returns None when a request failed."""
    tried: dict[str, dict] = {}

    def one(setting: dict) -> None:
        setting = knobs.effective(system, setting)
        key = knobs.label(setting)
        if key in tried:
            return
        try:
            server = launch(system, model_name, dtype, setting, port)
        except (PeerError, ValueError, FileNotFoundError) as exc:
            tried[key] = {"setting": setting, "score": None, "error": str(exc).splitlines()[0]}
            log(f"   sweep {system} {key:<32} failed to start: {tried[key]['error']}")
            return
        try:
            score = measure(server)
        finally:
            server.stop()
        tried[key] = {"setting": setting, "score": score, "startup_s": server.startup_s}
        log(f"   sweep {system} {key:<32} {'failed requests' if score is None else f'{score:10.2f}'}")

    best = knobs.effective(system, base)
    one(best)
    for stage in stages(system, mode, concurrency):
        for change in stage:
            one({**best, **change})
        ok = [t for t in tried.values() if t["score"] is not None]
        if ok:
            best = dict(max(ok, key=lambda t: t["score"])["setting"])
    return best, list(tried.values())
