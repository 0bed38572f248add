"""The server under soak, in the benchmark's own process, and what is inspected afterwards.

`start_server` builds the engine (a small KV cache, a small queue, host blocks for offload)
and the app of `contbatch.server.app.build_app`, as `contbatch serve` does, under uvicorn in
a background thread on 127.0.0.1 and a free port. `baseline` records a greedy chat and a
greedy streamed completion (compared at the start and the end); `idle_state` reads every
table that must be empty once no request is in flight; `LogTally` counts what the engine and
the server log at WARNING and above.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
import traceback

import httpx
import psutil
import uvicorn

import contbatch
import harness as H
from contbatch.cache.paged_cache import KVLayout
from contbatch.server import ServerSettings, build_app
from soak_outcomes import shape
from soak_requests import MODEL_NAME

BASELINE_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BASELINE_PROMPT = "Once upon a time, in a land far away,"


class LogTally(logging.Handler):
    """Counts what the engine and the server log at WARNING and above, keeping a few examples;
    keeps the expected tracebacks of injected faults off the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = collections.Counter()
        self.examples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name}:{record.levelname}:{shape(record.getMessage().splitlines()[0])}"
        self.counts[key] += 1
        if key not in self.examples and len(self.examples) < 20:
            exc = "".join(traceback.format_exception(*record.exc_info))[-1500:] if record.exc_info else ""
            self.examples[key] = (record.getMessage()[:500] + "\n" + exc).strip()


def load_model(args):
    """The default model, a local one, or `tiny`: a random 2-layer Llama that speaks the
    default model's tokenizer (the CI mode)."""
    if args.model == "default":
        return H.load()
    if args.model != "tiny":
        return H.load(args.model)
    tok = H.default_tokenizer()
    return H.random_llama(seed=args.seed, tokenizer=tok, initializer_range=0.2), tok


def start_server(args):
    model, tok = load_model(args)
    dtype = next(model.parameters()).dtype
    per_block = KVLayout.from_model_config(model.config, dtype).bytes_per_block(args.block_size)
    config = contbatch.ContinuousBatchingConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, max_queue_size=args.max_queue_size,
        cpu_offload_space=args.offload_blocks * per_block / 2**30, max_prompt_length=args.max_model_len,
    )
    manager = contbatch.ContinuousBatchingManager(model, None, config, tokenizer=tok)
    settings = ServerSettings(served_model_names=(MODEL_NAME,), max_model_len=args.max_model_len,
                              max_body_bytes=args.max_body_bytes)
    app = build_app(manager, tok, settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # loopback only
    kw = dict(log_level="warning", log_config=None, lifespan="on", timeout_graceful_shutdown=5)
    try:  # as `contbatch serve` builds it, where the server has its own connection handling
        from contbatch.server.connections import uvicorn_config

        uv_config = uvicorn_config(app, settings.header_timeout_s, **kw)
    except ImportError:
        uv_config = uvicorn.Config(app, **kw)
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="soak-uvicorn")
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", manager, app, server, thread, tok


async def baseline(url: str) -> dict[str, str | None]:
    """A greedy chat and a greedy streamed completion: their texts, or None if they failed."""
    out: dict[str, str | None] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json={"messages": BASELINE_CHAT, "max_tokens": 24,
                                                            "temperature": 0, "ignore_eos": True})
        out["chat"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        async with client.stream("POST", "/v1/completions", json={
                "prompt": BASELINE_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            raw = (await r.aread()).decode()
        if r.status_code == 200 and raw.rstrip().endswith("data: [DONE]"):
            events = [json.loads(line[5:]) for line in raw.split("\n")
                      if line.startswith("data:") and "[DONE]" not in line]
            out["completion_stream"] = "".join(c["text"] for e in events for c in e.get("choices") or [])
        else:
            out["completion_stream"] = None
    return out


def idle_state(manager, app) -> dict:
    """Everything that must be empty once no request is in flight. Beyond `stats()`, this reads
    engine internals; one that is not there (the engine changed) is listed under `not_inspected`."""
    s = manager.stats()
    st = {k: s[k] for k in ("running", "waiting", "free_blocks", "cached_blocks", "offloaded_blocks") if k in s}
    st["num_blocks"] = manager.resolved_config.num_blocks
    missing = []

    def probe(name: str, get) -> None:
        try:
            value = get()
        except AttributeError:
            missing.append(name)
            return
        st[name] = value if isinstance(value, int) else len(value)

    store = getattr(manager, "_results", None)
    probe("block_tables", lambda: manager.cache.block_manager.block_tables)
    probe("referenced_blocks", lambda: sum(1 for r in manager.cache.block_manager._refs if r))
    probe("store_streams", lambda: store._streams)
    probe("store_live", lambda: store.live)
    probe("store_known", lambda: store._known)
    probe("store_finished", lambda: store._finished)
    probe("store_groups", lambda: store._groups)
    probe("manager_samples", lambda: manager._samples)
    probe("inbox", lambda: manager._inbox.qsize())
    if "offloaded_blocks" not in st:
        probe("offloaded_blocks", lambda: manager.scheduler.offloaded_blocks)
    probe("async_engine_live", lambda: app.state.engine.num_live)
    probe("gate_inflight", lambda: app.state.server_state.inflight)
    st["not_inspected"] = missing
    return st


def is_idle(st: dict) -> bool:
    return st["free_blocks"] == st["num_blocks"] and all(
        v == 0 for k, v in st.items() if k not in ("free_blocks", "num_blocks", "cached_blocks", "not_inspected"))


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20

