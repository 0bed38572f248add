"""The GPU path's logic, on the CPU: backend choice, buckets and padding, the graph LRU,
carry-over, stream ordering, and greedy exactness of the flat layout (sync and async,
padded as for graphs) through the PyTorch reference kernels."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, SamplingParams
from contbatch.attention import select as backend_mod
from contbatch.attention.select import choose_backend
from contbatch.runtime.buckets import Bucketing, StepShape, decode_bucket, pad_batch
from contbatch.runtime import step_batch as step_batch_mod
from contbatch.runtime.step_batch import apply_carry, build_step_batch
from contbatch.runtime.step_runner import Streams
from contbatch.runtime.graphs import GraphCache, eager_capture
from contbatch.requests import PLACEHOLDER, RequestState
from contbatch.scheduling.scheduler import ScheduledChunk, StepPlan

from capture_guard import forbid_host_syncs, guarded_capture, opaque
from conftest import NEAR_TIE, greedy_margins, random_prompts, reference_generate


# -- backend choice ----------------------------------------------------------------------
def test_cpu_defaults_to_torch_with_nothing_claimed():
    """On the CPU the torch backend's decode fast path is our C++ kernel: on wherever it builds."""
    from contbatch.cpu import ops as cpu_ops

    c = choose_backend("auto", "cpu", 256, None, None, None)
    built = cpu_ops.load_attention()[0]
    assert (c.name, c.decode_fast_path, c.use_cuda_graph, c.use_async_batching) == ("torch", built, False, False)
    assert not c.warnings if built else "C++ CPU decode kernel" in c.warnings[0]


def _no_cpu_kernel(monkeypatch):
    from contbatch.cpu import ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "load_attention", lambda: (False, "unavailable (no compiler)"))


def test_impossible_requests_are_warnings_and_resolved_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _no_cpu_kernel(monkeypatch)
    c = choose_backend("triton", "cpu", 16, True, True, True)
    assert c.name == "torch" and not (c.decode_fast_path or c.use_cuda_graph or c.use_async_batching)
    text = " ".join(c.warnings)
    for what in ("attention_backend='triton'", "decode_fast_path=True", "use_cuda_graph=True", "use_async_batching=True"):
        assert what in text
    assert "flash-attn" in " ".join(choose_backend("flash", "cpu", 256, None, None, None).warnings)


def test_cuda_auto_choice(monkeypatch):
    monkeypatch.setattr(backend_mod, "_importable", lambda name: name == "triton")
    c = choose_backend("auto", "cuda", 16, None, None, None)
    assert (c.name, c.decode_fast_path, c.use_cuda_graph, c.use_async_batching) == ("triton", True, True, True)
    assert c.kv_layout == "heads-first" and not c.warnings
    off = choose_backend("auto", "cuda", 16, False, False, None)
    assert not off.decode_fast_path and not off.use_cuda_graph and not off.use_async_batching

    monkeypatch.setattr(backend_mod, "_importable", lambda name: True)
    flash = choose_backend("auto", "cuda", 256, None, None, None)
    assert flash.name == "flash" and flash.kv_layout == "token-major"
    assert choose_backend("auto", "cuda", 16, None, None, None).name == "triton"  # flash cannot take 16
    rounded = choose_backend("flash", "cuda", 100, None, None, None)
    assert rounded.block_size == 256 and "rounded up from 100 to 256" in rounded.warnings[0]


def test_manager_logs_warnings_at_start_and_reports_them(llama_model, caplog, monkeypatch):
    _no_cpu_kernel(monkeypatch)
    config = ContinuousBatchingConfig(block_size=4, use_cuda_graph=True, decode_fast_path=True)
    manager = ContinuousBatchingManager(llama_model, config=config)
    r = manager.resolved_config
    assert r.attention_backend == "torch" and not r.use_cuda_graph and not r.decode_fast_path
    assert len(r.warnings) == 3  # the two asked for, and the prefill kernel's absence (SDPA instead)
    assert any("prefill chunks run SDPA" in w for w in r.warnings)
    with caplog.at_level(logging.WARNING, logger="contbatch"):
        manager.start()
        manager.stop()
    assert sum("use_cuda_graph=True" in m or "decode_fast_path=True" in m or "prefill kernel" in m
               for m in caplog.messages) == 3


# -- buckets, padding, graph LRU ---------------------------------------------------------
def test_decode_buckets_are_powers_of_two_capped():
    assert [decode_bucket(n, 48) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    assert decode_bucket(64, 64) == 64


def _state(rid: str, tokens: list[int], computed: int) -> RequestState:
    state = RequestState(rid, tokens, max_new_tokens=8)
    state.num_computed_tokens = computed
    return state


def _plan(*specs) -> StepPlan:
    return StepPlan(chunks=[ScheduledChunk(_state(rid, toks, comp), n) for rid, toks, comp, n in specs])


class _Tables:
    """The two things `build_step_batch` asks a block manager: tables, and the block size."""

    def __init__(self, block_size: int, **tables: list[int]) -> None:
        self.block_size, self.tables = block_size, tables

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def test_step_batch_and_padding_point_padding_at_trash():
    bs = 4
    plan = _plan(("a", [5, 6, 7, 8, 9], 4, 1), ("b", [1, 2, 3], 0, 3))
    batch = build_step_batch(plan, _Tables(bs, a=[3, 7], b=[2]))
    assert batch.input_ids.tolist() == [9, 1, 2, 3]
    assert batch.positions.tolist() == [4, 0, 1, 2]
    assert batch.write_slots.tolist() == [7 * bs + 0, 2 * bs, 2 * bs + 1, 2 * bs + 2]
    assert batch.cu_seqlens_q.tolist() == [0, 1, 4] and batch.kv_lens.tolist() == [5, 3]
    assert batch.logits_indices.tolist() == [0, 3] and not batch.decode_only

    bucketing = Bucketing(max_requests=16, q_interval=8, kv_interval=32, tiles_for=lambda t, b: t // 4 + b, kv_keyed=True)
    shape = bucketing.padded(batch)
    assert shape == StepShape(False, 8, 8, 10, 32, 8)
    padded = pad_batch(batch, shape, table_width=3, trash_block=10, write_trash_slot=11 * bs)
    assert padded["write_slots"].tolist()[4:] == [11 * bs] * 4
    assert padded["cu_seqlens_q"].tolist() == [0, 1, 4] + [4] * 6  # padding requests own no tokens
    assert padded["kv_lens"].tolist() == [5, 3] + [0] * 6
    assert padded["block_table"][0].tolist() == [3, 7, 10] and padded["block_table"][5].tolist() == [10, 10, 10]
    assert padded["cu_seqlens_k"].tolist() == [0, 5, 8] + [8] * 6
    assert bucketing.exact(batch) == StepShape(False, 4, 2, 3, 5, 2)
    small = Bucketing(16, 8, 32, tiles_for=None, kv_keyed=False, graph_max_tokens=8)
    assert small.graphable(batch)  # 4 tokens pad to 8
    assert not small.graphable(build_step_batch(_plan(("c", list(range(9)), 0, 9)), _Tables(bs, c=[1, 2, 3])))

    decode = build_step_batch(_plan(("a", [5, 6, 7], 2, 1), ("b", [1, 2], 1, 1), ("c", [4], 0, 1)),
                              _Tables(bs, a=[1], b=[2], c=[3]))
    assert [c.state.request_id for c in decode.chunks] == ["c", "b", "a"]  # single-token rows, shortest first
    dshape = bucketing.padded(decode)
    assert dshape == StepShape(True, 4, 4, 0, 0, 4)
    padded = pad_batch(decode, dshape, 2, trash_block=10, write_trash_slot=44)
    assert padded["kv_lens"].tolist() == [1, 2, 3, 1]  # padding reads one zero key from the read-trash block
    assert padded["block_table"][3].tolist() == [10, 10] and padded["write_slots"][3] == 44
    with pytest.raises(ValueError):
        pad_batch(decode, StepShape(True, 2, 2, 0, 0, 2), 2, 10, 44)
    # Without the fast path a decode-only step runs the varlen kernel: it needs its tiles.
    slow = Bucketing(16, 8, 32, tiles_for=lambda t, b: t // 4 + b, kv_keyed=True, fast_decode=False)
    assert slow.padded(decode) == StepShape(True, 4, 4, 5, 32, 4) and slow.exact(decode).num_tiles == 3


def test_token_major_cache_is_the_same_cache():
    """flash-attn's token-major layout: same logical `[H_kv, slots, D]` contents after
    writes, and offload copies round-trip into other blocks, as in the heads-first layout."""
    from contbatch.cache.paged_cache import KVLayout, PagedAttentionCache

    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32)
    caches = [PagedAttentionCache(layout, 6, 4, token_major=tm) for tm in (False, True)]
    key, value = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    slots = torch.tensor([4, 5, 6, 7, 12])
    for cache in caches:
        cache.write(1, slots, key, value)
        k, v = cache.kv(1)
        assert k.shape == (3, cache.num_rows, 8)
        assert torch.equal(k[:, slots], key) and torch.equal(v[:, slots], value)
        keys, values = cache.copy_out([1, 3], 5)
        cache.copy_in([2, 5], 5, keys, values)
        moved = torch.tensor([8, 9, 10, 11, 20])
        assert torch.equal(cache.kv(1)[0][:, moved], key) and torch.equal(cache.kv(1)[1][:, moved], value)


def test_graph_cache_lru_shares_one_pool():
    runs: list[str] = []
    cache = GraphCache(2, eager_capture, pool="pool")

    def runner(name):
        def run():
            runs.append(name)
            return torch.tensor([float(len(runs))])
        return run

    cache.add("a", runner("a"))
    cache.add("b", runner("b"))
    assert cache.replay("a").item() == 3.0  # replays write into the captured output
    cache.add("c", runner("c"))  # evicts b, the least recently used
    assert cache.keys() == ["a", "c"] and cache.replay("b") is None
    assert (cache.captures, cache.replays, cache.evictions) == (3, 1, 1) and cache.pool == "pool"
    with pytest.raises(ValueError):
        GraphCache(0, eager_capture)


# -- carry-over --------------------------------------------------------------------------
def test_carry_over_fills_placeholders_from_the_step_in_flight():
    a = _state("a", [5, 6], 2)
    a.reserve_token()  # sampled by the step in flight: not known on the host yet
    b = _state("b", [1, 2, 3], 0)
    plan = StepPlan(chunks=[ScheduledChunk(a, 1), ScheduledChunk(b, 3)])
    batch = build_step_batch(plan, _Tables(4, a=[0], b=[1]), prev_rows={"a": 2})
    assert batch.input_ids.tolist() == [0, 1, 2, 3] and batch.carry.tolist() == [2, -1, -1, -1]
    ids = batch.input_ids.clone()
    apply_carry(ids, batch.carry, torch.tensor([40, 41, 42]))
    assert ids.tolist() == [42, 1, 2, 3]
    with pytest.raises(RuntimeError, match="placeholder"):
        build_step_batch(plan, _Tables(4, a=[0], b=[1]), prev_rows={})


_BATCH_FIELDS = ("input_ids", "carry", "positions", "write_slots", "cu_seqlens_q", "kv_lens", "block_table",
                 "logits_indices")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_one_token_plans_batch_is_the_general_paths(data):
    """A plan whose every chunk computes one token (decode rows, a prompt's one-token chunk
    mid-way or at its end, placeholders of a step in flight, LoRA rows) is built by its own
    short path: the batch equals the general path's, field by field and in request order."""
    bs = data.draw(st.sampled_from([1, 4, 16]))
    n = data.draw(st.integers(1, 9))
    chunks, tables, prev_rows = [], {}, {}
    for i in range(n):
        length = data.draw(st.integers(1, 40))
        computed = data.draw(st.integers(0, length - 1))
        state = RequestState(f"r{i}", data.draw(st.lists(st.integers(0, 999), min_size=length, max_size=length)),
                             max_new_tokens=8)
        state.num_computed_tokens = computed
        if computed == length - 1 and data.draw(st.booleans()):  # its last token is still being sampled
            state.all_token_ids[-1] = PLACEHOLDER
            prev_rows[state.request_id] = data.draw(st.integers(0, 8))
        state.lora_slot = data.draw(st.sampled_from([-1, -1, 0, 2]))
        tables[state.request_id] = data.draw(st.lists(st.integers(0, 99), min_size=computed // bs + 1,
                                                      max_size=computed // bs + 3))
        chunks.append(ScheduledChunk(state, 1))
    plan, manager = StepPlan(chunks=chunks), _Tables(bs, **tables)
    fast, general = build_step_batch(plan, manager, prev_rows), step_batch_mod._any_batch(plan, manager, prev_rows)
    for name in _BATCH_FIELDS:
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert [c.state for c in fast.chunks] == [c.state for c in general.chunks]
    assert fast.sampled == general.sampled and fast.drafts is None and general.drafts is None
    assert (fast.lora_slots is None) == (general.lora_slots is None)
    if fast.lora_slots is not None:
        assert fast.lora_slots.tolist() == general.lora_slots.tolist()
    assert fast.decode_only


def test_placeholders_stay_internal():
    s = RequestState("r", [1, 2], max_new_tokens=3, eos_token_ids=frozenset({9}))
    first, second = s.reserve_token(), s.reserve_token()
    assert s.all_token_ids == [1, 2, PLACEHOLDER, PLACEHOLDER] and s.known_tokens == []
    assert s.to_output().generated_tokens == []
    s.set_token(first, 9)  # a stop token: the later placeholder is dropped with it
    assert s.status == RequestStatus.FINISHED and s.generated_tokens == [9] and s.all_token_ids == [1, 2, 9]
    assert second == 1


# -- the device ---------------------------------------------------------------------------
# Graphs on the CPU are captured by `capture_guard.guarded_capture`: host syncs and host-to-
# device copies raise inside the captured forward, as they fail under a real CUDA capture.
@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The flat layout on the CPU (reference kernels, graphs replayed eagerly), and on CUDA when
    present: Triton kernels, real CUDA graphs and streams."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


def on_device(model, device):
    return model if device.type == "cpu" else copy.deepcopy(model).to(device)


def generate_on(model, prompt, max_new, eos=None):
    """`reference_generate` on whatever device the model is on."""
    if next(model.parameters()).device.type == "cpu":
        return reference_generate(model, prompt, max_new, eos)
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


# -- the flat layout end to end ------------------------------------------------------------
class RecordingStreams(Streams):
    """Streams that log what they are asked, so the ordering is checkable without a GPU."""

    def __init__(self) -> None:
        self.asynchronous = True
        self.log: list[tuple] = []
        self._events = 0

    @contextmanager
    def on(self, name):
        yield

    def record(self, name, timing=False):
        self._events += 1
        self.log.append(("record", name, self._events))
        return self._events

    def wait(self, name, event):
        if event is not None:
            self.log.append(("wait", name, event))

    def synchronize(self, event):
        if event is not None:
            self.log.append(("sync", "host", event))

    def elapsed(self, start, end):
        return 0.0

    def to_host(self, t):
        return t


def _flat_run(model, prompts, max_new, config, graphs=False, streams=None, eos=None, params=None, cancel=None,
              capture=guarded_capture):
    """One engine run; with `graphs`, every step shape that graphs would capture runs through
    `capture` (guarded: a host sync inside the captured forward raises and fails the request)."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
    manager = ContinuousBatchingManager(model, gc, config)
    with forbid_host_syncs():
        return _run_started(manager, prompts, graphs, streams, params, cancel, capture)


def _run_started(manager, prompts, graphs, streams, params, cancel, capture):
    manager.start()
    try:
        if graphs:  # the padded, fixed-buffer path of CUDA graphs, replayed eagerly
            manager.core.runner.graphs = GraphCache(3, capture)
            kernels = manager.core.runner.backend
            if kernels.name == "reference":  # stands in for one kernel launch each; never captured on a GPU
                manager.core.runner.backend = dataclasses.replace(
                    kernels, decode=kernels.decode and opaque(kernels.decode), varlen=opaque(kernels.varlen))
        if streams is not None:
            manager.core.runner.streams = streams
        ids = manager.add_requests(prompts, sampling_params=params)
        if cancel is not None:
            manager.cancel_request(ids[cancel])
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
        stats = manager.stats()
        bm = manager.cache.block_manager
        idle = bm.num_free_blocks  # cached blocks included: nobody holds a reference
    finally:
        manager.stop()
    assert idle == bm.num_blocks, "blocks leaked"
    return outs, stats


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_flat_layout_is_exact(tiny_model, device, use_async, graphs):
    """Chunked prefill, decode fast path and varlen steps, padded to graph buckets or not,
    with carry-over or not: token-identical to `model.generate`. On CUDA: our Triton kernels,
    real CUDA graphs (captured, an LRU of 3 so some are evicted) and the three streams."""
    model = on_device(tiny_model, device)
    prompts = random_prompts(16, 1, 50, seed=31)
    cuda = device.type == "cuda"
    config = ContinuousBatchingConfig(
        block_size=4, max_batch_tokens=40, attention_backend="triton" if cuda and graphs else "reference",
        use_async_batching=use_async, q_padding_interval_size=16, use_cuda_graph=graphs if cuda else None,
        max_cached_graphs=3,
    )
    outs, stats = _flat_run(model, prompts, 9, config, graphs=graphs and not cuda)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == generate_on(model, prompt, 9)
    assert stats["decode_only_steps"] > 0
    if graphs:
        assert stats["graph_captures"] > 3 and stats["graph_replays"] > 0  # evictions happened too


def test_flat_layout_sliding_windows_and_softcap_on_cuda(sliding_model):
    """The sliding-window models through real CUDA graphs and streams (skipped without CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = on_device(sliding_model, torch.device("cuda"))
    prompts = random_prompts(10, 1, 40, seed=32)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=32, attention_backend="triton",
                                      use_async_batching=True, use_cuda_graph=True, q_padding_interval_size=16)
    outs, stats = _flat_run(model, prompts, 8, config)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == generate_on(model, prompt, 8)
    assert stats["graph_replays"] > 0


def test_flat_layout_sliding_windows_and_softcap(sliding_model):
    """Windows (Mistral, Gemma 2/3 alternating) and Gemma 2's soft-capping reach the flat
    kernels per layer: exact through both the decode fast path and varlen steps."""
    prompts = random_prompts(10, 1, 40, seed=32)
    config = ContinuousBatchingConfig(
        block_size=4, max_batch_tokens=32, attention_backend="reference", use_async_batching=True,
        q_padding_interval_size=16,
    )
    outs, stats = _flat_run(sliding_model, prompts, 8, config, graphs=True)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(sliding_model, prompt, 8)
    assert stats["decode_only_steps"] > 0


def test_speculative_verification_through_graphs_is_exact(tiny_model):
    """N-gram proposals verified in padded steps captured as graphs (guarded: no host sync in
    the captured forward), beside chunked prefill: every output equals `model.generate`. The
    workload of tests/test_speculative.py, where proposals are accepted."""
    prompts = [p * 4 for p in random_prompts(10, 3, 9, seed=3)] + random_prompts(10, 1, 60, seed=4)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=48, attention_backend="reference",
                                      q_padding_interval_size=16, speculative_config={"method": "ngram"})
    outs, stats = _flat_run(tiny_model, prompts, 24, config, graphs=True)
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        assert out.generated_tokens == reference_generate(tiny_model, prompt, 24)
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["graph_captures"] > 0, stats


def test_async_early_stops_and_pressure_stay_exact(llama_model):
    """Requests that stop on a token in step N were already planned into N+1; under KV
    pressure (offload and soft reset) and with shared prefixes, nobody's cache is hurt."""
    shared = random_prompts(1, 12, 12, seed=41)[0]
    prompts = [shared + p for p in random_prompts(14, 1, 20, seed=42)] + random_prompts(6, 5, 30, seed=43)
    probe = [reference_generate(llama_model, p, 12) for p in prompts]
    eos = max({t for out in probe for t in out[2:8]}, key=lambda t: sum(t in o[2:8] for o in probe))
    for offload in (0.0, 1.0):
        config = ContinuousBatchingConfig(
            block_size=4, num_blocks=24, max_batch_tokens=32, attention_backend="reference",
            use_async_batching=True, safety_margin=0.0, cpu_offload_space=offload,
            cuda_graph_max_tokens=16,  # larger varlen steps run eagerly, between replayed graphs
        )
        outs, stats = _flat_run(llama_model, prompts, 12, config, graphs=True, eos=eos)
        assert stats["offloads"] + stats["soft_resets"] > 0
        stopped = 0
        for prompt, out in zip(prompts, outs):
            assert out.generated_tokens == reference_generate(llama_model, prompt, 12, eos)
            stopped += out.finish_reason == "stop"
        assert stopped >= 3


def test_async_sampling_matches_sync(llama_model):
    """Seeded sampling with penalties reads each request's history: with carry-over the
    history is complete by the time a step samples, so tokens equal the synchronous run."""
    prompts = random_prompts(8, 3, 20, seed=44)
    params = [SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3, seed=i) for i in range(7)]
    params.append(SamplingParams(temperature=0.8, presence_penalty=0.5, seed=7, n=3))  # siblings share a prompt
    runs = []
    for use_async in (False, True):
        config = ContinuousBatchingConfig(block_size=4, attention_backend="reference", use_async_batching=use_async)
        outs, _ = _flat_run(llama_model, prompts, 10, config, params=params)
        runs.append([o.generated_tokens for o in outs] + [[s.generated_tokens for s in outs[-1].samples]])
    assert runs[0] == runs[1]
    assert len(runs[1][-1]) == 3


_GENERATE_MEMO: dict = {}


def _generate_memo(model, prompt: list[int], max_new: int, stop: int) -> list[int]:
    """`model.generate` (greedy, stopping on `stop`), memoized per (prompt, length, stop):
    hypothesis examples share seeds' prompts, and the reference is the slow part."""
    key = (id(model), tuple(prompt), max_new, stop)
    if key not in _GENERATE_MEMO:
        _GENERATE_MEMO[key] = reference_generate(model, prompt, max_new, stop)
    return _GENERATE_MEMO[key]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.sampled_from([16, 24, 200]),
    offload=st.sampled_from([0.0, 1.0]),
    scheduler=st.sampled_from(["fifo", "prefill_first"]),
    budget=st.sampled_from([8, 24, 64]),
)
def test_async_and_sync_equal_generate_on_random_workloads(llama_model, seed, num_blocks, offload, scheduler, budget):
    """Whatever the pressure, budget and scheduler, both the carry-over pipeline (padded as for
    graphs) and the one-step-at-a-time loop produce exactly what `model.generate` does, token
    for token, stopping where it stops. Workloads whose reference holds a rounding-level near
    tie (conftest.NEAR_TIE) are set aside: there any summation order may pick either token."""
    rng = random.Random(seed)
    prompts = random_prompts(rng.randint(2, 10), 1, 30, seed=seed)
    lengths = [rng.randint(1, 12) for _ in prompts]
    stops = [rng.randrange(3, 512) for _ in prompts]
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=[t]) for n, t in zip(lengths, stops)]
    expected = [_generate_memo(llama_model, p, n, t) for p, n, t in zip(prompts, lengths, stops)]
    assume(all(min(greedy_margins(llama_model, p, want), default=1.0) >= NEAR_TIE
               for p, want in zip(prompts, expected)))
    for use_async in (False, True):
        config = ContinuousBatchingConfig(
            block_size=4, num_blocks=num_blocks, max_batch_tokens=budget, attention_backend="reference",
            use_async_batching=use_async, scheduler_type=scheduler, cpu_offload_space=offload,
            q_padding_interval_size=8,
        )
        outs, _ = _flat_run(llama_model, prompts, 12, config, graphs=use_async, params=params)
        for out, want, stop in zip(outs, expected, stops):
            assert out.error is None, out.error
            assert out.generated_tokens == want, f"async={use_async}"
            assert out.finish_reason == ("stop" if want[-1] == stop else "length")


def test_async_cancel_in_flight(llama_model):
    prompts = random_prompts(6, 5, 20, seed=45)
    config = ContinuousBatchingConfig(block_size=4, attention_backend="reference", use_async_batching=True)
    outs, _ = _flat_run(llama_model, prompts, 30, config, cancel=2)
    assert outs[2].status == RequestStatus.CANCELLED and PLACEHOLDER not in outs[2].generated_tokens
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i != 2:
            assert out.generated_tokens == reference_generate(llama_model, prompt, 30)


def test_a_failing_kernel_fails_only_its_step(llama_model):
    """A kernel error in one async step fails that step's requests with a clear error (and
    the step in flight behind it skips them); later requests run and stay exact."""
    config = ContinuousBatchingConfig(block_size=4, attention_backend="reference", use_async_batching=True)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(llama_model, gc, config)
    manager.start()
    try:
        kernels = manager.core.runner.backend
        calls = {"n": 0}

        def flaky(*args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected kernel fault")
            return kernels.decode(*args)

        manager.core.runner.backend = dataclasses.replace(kernels, decode=flaky)
        first = [manager.get_result(rid, timeout=60) for rid in manager.add_requests(random_prompts(3, 4, 9, seed=48))]
        later = random_prompts(3, 4, 9, seed=49)
        again = [manager.get_result(rid, timeout=60) for rid in manager.add_requests(later)]
    finally:
        manager.stop()
    assert all(o.status == RequestStatus.FAILED and "injected kernel fault" in o.error for o in first)
    for prompt, out in zip(later, again):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 6)


def test_stream_ordering(llama_model):
    """Each step: inputs copied on the h2d stream, the forward waits for them, the copy back
    waits for sampling; a slot's inputs are rewritten only after its last forward (two
    slots: step k waits for step k-2), and the host waits for every copy it reads."""
    streams = RecordingStreams()
    prompts = random_prompts(5, 3, 12, seed=46)
    config = ContinuousBatchingConfig(block_size=4, attention_backend="reference", use_async_batching=True)
    outs, _ = _flat_run(llama_model, prompts, 6, config, graphs=True, streams=streams)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 6)
    recorded: dict[int, str] = {}
    h2d, compute_done = [], []
    for kind, stream, event in streams.log:
        if kind == "record":
            recorded[event] = stream
            if stream == "h2d":
                h2d.append(event)
        else:
            assert event in recorded, f"{kind} on event {event} before it was recorded"
            if kind == "wait" and stream == "compute":
                assert recorded[event] == "h2d" and event == h2d[-1]  # this step's own inputs
            if kind == "wait" and stream == "d2h":
                assert recorded[event] == "compute"
                compute_done.append(event)
            if kind == "wait" and stream == "h2d":
                assert compute_done.index(event) == len(compute_done) - 2  # two slots: step k-2
    assert len(h2d) > 4 and len(compute_done) == len(h2d)


@pytest.mark.parametrize("fast_path", [True, False])
def test_triton_kernels_in_the_engine(llama_model, fast_path):
    """Our Triton kernels (in the interpreter here, compiled on a GPU) drive the engine:
    varlen steps, decode steps on the fast path or the varlen kernel, padding to graph
    buckets (with the fast path) or exact shapes, and carry-over. Graphs are captured with
    host syncs forbidden, as a CUDA graph forbids them."""
    pytest.importorskip("triton")
    prompts = random_prompts(4, 1, 20, seed=47)
    config = ContinuousBatchingConfig(
        block_size=4, max_batch_tokens=24, attention_backend="triton", use_async_batching=True,
        q_padding_interval_size=8, decode_fast_path=fast_path,
    )
    outs, stats = _flat_run(llama_model, prompts, 5, config, graphs=fast_path)
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        assert out.generated_tokens == reference_generate(llama_model, prompt, 5)
    assert stats["decode_only_steps"] > 0
    if fast_path:
        assert stats["graph_captures"] > 0 and stats["graph_replays"] > 0


def test_flash_backend_wiring_with_a_stand_in(llama_model, monkeypatch):
    """flash-attn is not installed here; a stand-in with its paged calling convention
    (token-major `[blocks, block_size, H_kv, D]` caches, `cu_seqlens_k`, `(left, right)`
    windows, softcap 0.0 for none) checks our adapters, the token-major cache and the
    key-length buckets end to end. Its arithmetic is the reference kernels'."""
    import sys
    import types

    from contbatch.attention import varlen_reference as ref
    from contbatch.attention.select import BackendChoice
    from contbatch.setup import resolve

    calls = {"varlen": 0, "decode": 0}

    def logical(cache):  # [blocks, bs, H_kv, D] -> [H_kv, slots, D]
        return cache.reshape(-1, cache.shape[2], cache.shape[3]).transpose(0, 1)

    def window(size):
        assert size[1] in (0, -1)
        return None if size[0] < 0 else size[0] + 1

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap,
                               block_table):
        calls["varlen"] += 1
        assert causal and max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
        kv_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        return ref.reference_varlen_attention(
            q, logical(k), logical(v), block_table, kv_lens, cu_q, scale=softmax_scale,
            sliding_window=window(window_size), softcap=softcap or None, block_size=k.shape[1],
        )

    def flash_attn_with_kvcache(q, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap):
        calls["decode"] += 1
        out = ref.reference_decode_attention(
            q[:, 0], logical(k), logical(v), block_table, cache_seqlens, softmax_scale, window(window_size),
            softcap or None, block_size=k.shape[1],
        )
        return out.unsqueeze(1)

    fake = types.ModuleType("flash_attn")
    # Each stand-in is one device kernel launch: its own host reads are not the engine's.
    fake.flash_attn_varlen_func = opaque(flash_attn_varlen_func)
    fake.flash_attn_with_kvcache = opaque(flash_attn_with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.delitem(sys.modules, "contbatch.attention.flash", raising=False)
    choice = BackendChoice("flash", 8, True, False, True, "token-major")
    monkeypatch.setattr(resolve, "choose_backend", lambda *args: choice)

    prompts = random_prompts(8, 1, 40, seed=33)
    config = ContinuousBatchingConfig(block_size=8, max_batch_tokens=32, kv_padding_interval_size=16)
    try:
        outs, stats = _flat_run(llama_model, prompts, 7, config, graphs=True)
    finally:
        sys.modules.pop("contbatch.attention.flash", None)  # it was bound to the stand-in
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 7)
    assert calls["varlen"] > 0 and calls["decode"] > 0 and stats["decode_only_steps"] > 0
