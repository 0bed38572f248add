"""KV pressure (offload, soft reset), prefix caching, admission reserve, resolved config."""

from __future__ import annotations

from dataclasses import replace as dataclasses_replace

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, PagedAttentionCache, continuous_batching, generate_batch
from contbatch.cache import BlockManager, KVLayout
from contbatch.setup.resolve import blocks_from_hint
from contbatch.requests import RequestState
from contbatch.scheduling import FIFOScheduler

from conftest import random_prompts, reference_generate

GREEDY16 = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None)


# -- the seeds' numbers ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_block_size_below_4_raises(bad):
    with pytest.raises(ValueError, match="Block size must be at least 4"):
        ContinuousBatchingConfig(block_size=bad)
    with pytest.raises(ValueError, match="Block size must be at least 4"):
        PagedAttentionCache(KVLayout(1, 1, 4, torch.float32), num_blocks=2, block_size=bad)


def test_block_size_4_and_reserved_blocks():
    ContinuousBatchingConfig(block_size=4)
    cache = PagedAttentionCache(KVLayout(2, 2, 8, torch.float32), num_blocks=64, block_size=4)
    assert cache.key_cache[0].shape == (2, (64 + 2) * 4, 8)
    assert (cache.read_trash_slot, cache.sentinel_slot, cache.write_trash_slot) == (256, 257, 260)
    assert cache.block_manager.num_free_blocks == 64  # the two reserved blocks are never handed out


def test_hint_formula():
    assert blocks_from_hint(30_000, 2_000, 256) == 126
    assert blocks_from_hint(4_000, 500, 256) == 20


@pytest.mark.parametrize("bad", [-0.01, 1.01, 2.0])
def test_safety_margin_out_of_range_raises(bad):
    with pytest.raises(ValueError, match="safety_margin"):
        ContinuousBatchingConfig(safety_margin=bad)


def test_margin_one_admits_only_into_an_idle_pool():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = FIFOScheduler(bm, max_batch_tokens=64, max_requests_per_batch=8, safety_margin=1.0)
    for i in range(3):
        sched.add(RequestState(f"r{i}", [5] * 6, max_new_tokens=4, arrival=i))
    plan = sched.schedule()
    assert [c.state.request_id for c in plan.chunks] == ["r0"]  # liveness: one into the idle pool
    assert plan.held_by_margin == 2


def test_fallback_table_addresses_8192_tokens(llama_model):
    with continuous_batching(llama_model, GREEDY16, ContinuousBatchingConfig(block_size=256)) as m:
        r = m.resolved_config
    assert r.max_blocks_per_request * r.block_size >= 8192


def test_stats_keys(llama_model):
    with continuous_batching(llama_model, GREEDY16) as m:
        stats = m.stats()
    for key in ("soft_resets", "offloads", "restores", "prefix_cache_queries", "prefix_cache_hits",
                "free_blocks", "cached_blocks", "running", "waiting"):
        assert key in stats


# -- exactness under pressure ------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_exact_under_pressure(llama_model, scheduler, offload):
    """A cache of 14 four-token blocks for 20 requests of up to 46 tokens: most are evicted
    (offloaded or soft reset) several times, yet every output is token-identical."""
    prompts = random_prompts(20, 10, 30, seed=21)
    config = ContinuousBatchingConfig(
        block_size=4, num_blocks=14, max_batch_tokens=32, scheduler_type=scheduler,
        safety_margin=0.0, cpu_offload_space=offload, allow_block_sharing=False,
    )
    with continuous_batching(llama_model, GREEDY16, config) as m:
        ids = m.add_requests(prompts)
        outs = [m.get_result(rid, timeout=120) for rid in ids]
        stats = m.stats()
        assert (m.resolved_config.cpu_offload_blocks > 0) == bool(offload)
    evictions = stats["offloads"] + stats["soft_resets"]
    assert evictions >= len(prompts), stats
    if offload:
        assert stats["offloads"] > 0 and stats["restores"] == stats["offloads"]
    else:
        assert stats["offloads"] == 0
    unconstrained = generate_batch(llama_model, prompts, GREEDY16, ContinuousBatchingConfig(block_size=4), progress_bar=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = reference_generate(llama_model, prompt, 16)
        assert out.generated_tokens == expected
        assert unconstrained[f"req_{i}"].generated_tokens == expected


def test_offload_resumes_without_recompute(llama_model):
    """With room on the host for every victim, nobody is ever soft reset."""
    prompts = random_prompts(12, 10, 30, seed=22)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=14, max_batch_tokens=32, safety_margin=0.0,
                                      cpu_offload_space=1.0, allow_block_sharing=False)
    with continuous_batching(llama_model, GREEDY16, config) as m:
        outs = [m.get_result(rid, timeout=120) for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["offloads"] > 0 and stats["soft_resets"] == 0
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 16)


# -- prefix caching ---------------------------------------------------------------------------
def _shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    system = random_prompts(1, 37, 37, seed=seed)[0]
    return [system + tail for tail in random_prompts(n, 1, 12, seed=seed + 1)]


def test_prefix_cache_on_off_identical_with_hits(llama_model):
    prompts = _shared_prefix_prompts(110, seed=31)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    results = {}
    for sharing in (False, True):
        config = ContinuousBatchingConfig(block_size=8, max_batch_tokens=128, allow_block_sharing=sharing)
        with continuous_batching(llama_model, gen, config) as m:
            ids = m.add_requests(prompts)
            results[sharing] = [m.get_result(rid, timeout=120).generated_tokens for rid in ids]
            stats = m.stats()
            bm = m.cache.block_manager
            # Idle: every block free or cached, no reference held, no table left.
            assert stats["free_blocks"] == m.resolved_config.num_blocks
            assert not any(bm._refs) and not bm.block_tables
        if sharing:
            # 37 shared tokens = 4 full blocks of 8; most requests find all 4 cached.
            assert stats["prefix_cache_hits"] >= 32 * 90, stats
            assert stats["prefix_cache_hit_rate"] > 0.5
            assert stats["cached_blocks"] > 0
        else:
            assert stats["prefix_cache_hits"] == 0
    assert results[True] == results[False]
    for prompt, out in list(zip(prompts, results[True]))[:10]:
        assert out == reference_generate(llama_model, prompt, 6)


@pytest.mark.parametrize("async_flat", [False, True])
def test_burst_sharing_a_prefix_computes_it_once(llama_model, async_flat):
    """16 requests sharing a 40-token prefix, submitted at once and admitted together: one
    computes the prefix, the others wait for it instead of recomputing it (without the hold,
    0 of their lookups hit). Outputs stay exact."""
    system = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [system + tail for tail in random_prompts(16, 3, 6, seed=6)]
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    flat = dict(attention_backend="reference", use_async_batching=True) if async_flat else {}
    hits = {}
    for hold in (False, True):
        # one step takes all 16 prompts (~720 tokens): admitted together
        config = ContinuousBatchingConfig(block_size=4, hold_shared_prefixes=hold, max_batch_tokens=2048, **flat)
        with continuous_batching(llama_model, gen, config) as m:
            ids = m.add_requests(prompts)
            outs = [m.get_result(rid, timeout=120).generated_tokens for rid in ids]
            hits[hold] = m.stats()["prefix_cache_hits"], m.stats()["held_for_prefix"]
        for prompt, out in list(zip(prompts, outs))[:4]:
            assert out == reference_generate(llama_model, prompt, 4)
    assert hits[False] == (0, 0)
    assert hits[True][0] == 15 * 40 and hits[True][1] >= 1  # 10 shared blocks of 4 for each follower


def test_burst_sharing_less_than_a_block_computes_it_once(llama_model):
    """16 requests sharing a 40-token prefix inside one block of 64, submitted at once: one
    computes it, the others wait a step and copy its 40 tokens (a partial hit) instead of
    computing them again. Outputs stay exact."""
    system = random_prompts(1, 40, 40, seed=15)[0]
    prompts = [system + tail for tail in random_prompts(16, 3, 6, seed=16)]
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    with continuous_batching(llama_model, gen, ContinuousBatchingConfig(block_size=64)) as m:
        outs = [m.get_result(rid, timeout=120).generated_tokens for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["prefix_cache_hits"] >= 15 * 40 and stats["held_for_prefix"] >= 1, stats
    for prompt, out in list(zip(prompts, outs))[:4]:
        assert out == reference_generate(llama_model, prompt, 4)


def test_fully_cached_prompt_still_computes_last_token(llama_model):
    prompt = random_prompts(1, 16, 16, seed=41)[0]  # exactly two 8-token blocks
    config = ContinuousBatchingConfig(block_size=8)
    with continuous_batching(llama_model, GREEDY16, config) as m:
        first = m.get_result(m.add_request(prompt), timeout=60)
        second = m.get_result(m.add_request(prompt), timeout=60)
        stats = m.stats()
    # The first block whole, then 7 of the second block's 8 positions copied: only the last
    # token is computed again (it gives the logits).
    assert stats["prefix_cache_hits"] == 15
    assert first.generated_tokens == second.generated_tokens == reference_generate(llama_model, prompt, 16)


def test_soft_reset_reuses_its_own_cached_blocks(llama_model):
    prompts = random_prompts(16, 20, 30, seed=42)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=24, max_batch_tokens=32, safety_margin=0.0)
    with continuous_batching(llama_model, GREEDY16, config) as m:
        outs = [m.get_result(rid, timeout=120) for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["soft_resets"] > 0 and stats["prefix_cache_hits"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 16)


def test_resolved_config_reports_everything(llama_model, caplog):
    caplog.set_level("INFO", logger="contbatch")
    config = ContinuousBatchingConfig(scheduler_type="prefill_first", cpu_offload_space=0.5)
    with continuous_batching(llama_model, GREEDY16, config) as m:
        r = m.resolved_config
    assert r.safety_margin == 0.0 and r.scheduler_type == "prefill_first"
    assert r.allow_block_sharing and r.cpu_offload_blocks > 0 and 0 < r.cpu_offload_gib <= 0.5
    line = next(rec.message for rec in caplog.records if "contbatch engine:" in rec.message)
    for fragment in ("blocks=", "max_batch_tokens=", "max_requests_per_batch=",
                     "max_blocks_per_request=", "allow_block_sharing=True", "decode_fast_path=", "scheduler=prefill_first",
                     "safety_margin=0.0", "cpu_offload="):
        assert fragment in line


@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_prefix_shorter_than_a_block_is_reused(llama_model, offload):
    """A shared system prompt of 37 tokens, blocks of 16: each later request reuses the two
    full blocks and the 5 tokens of the third (copied into a block of its own); a chat's next
    turn reuses the whole previous turn, answer included, up to the token before its end.
    Outputs stay exact, also when the pool is small enough that requests preempt each other."""
    system = random_prompts(1, 37, 37, seed=81)[0]
    prompts = [system + tail for tail in random_prompts(4, 2, 9, seed=82)]
    config = ContinuousBatchingConfig(block_size=16, num_blocks=12 if offload else None, max_batch_tokens=64,
                                      cpu_offload_space=offload, safety_margin=0.0)
    with continuous_batching(llama_model, GREEDY16, config) as m:
        outs = [m.get_result(m.add_request(p), timeout=120) for p in prompts]  # one after the other
        hits = m.stats()["prefix_cache_hits"]
        turn = prompts[0] + outs[0].generated_tokens + random_prompts(1, 5, 5, seed=83)[0]
        second = m.get_result(m.add_request(turn), timeout=120)
        turn_hits = m.stats()["prefix_cache_hits"] - hits
        burst = [m.get_result(rid, timeout=120) for rid in m.add_requests(prompts)]
    assert hits >= 3 * 37, hits
    assert turn_hits >= len(prompts[0]) + 16 - 1, turn_hits  # the previous turn's computed tokens
    assert all(o.cached_tokens >= 37 for o in outs[1:]), [o.cached_tokens for o in outs]
    for prompt, out, again in zip(prompts, outs, burst):
        assert out.generated_tokens == again.generated_tokens == reference_generate(llama_model, prompt, 16)
    assert second.generated_tokens == reference_generate(llama_model, turn, 16)


# -- sliding windows with real prefix hits ------------------------------------------------------
def test_sliding_window_models_share_prefixes_exactly(sliding_model):
    """Prompts sharing a 37-token prefix (4x the window of 8): followers find its blocks in the
    prefix cache, and a windowed model's output stays exact (our cache keeps every layer's KV)."""
    prompts = _shared_prefix_prompts(8, seed=71)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=48)
    with continuous_batching(sliding_model, gen, config) as m:
        assert m.resolved_config.sliding_window_layers > 0 and m.resolved_config.allow_block_sharing
        outs = [m.get_result(rid, timeout=120) for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["prefix_cache_hits"] >= 7 * 36, stats  # 9 shared blocks of 4 for each follower
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(sliding_model, prompt, 6)


# -- prefix-cache eviction order ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "mru"])
def test_prefix_cache_eviction_order(policy):
    """Released blocks stay cached in release order (a request's tail first, so its head is
    the more recent). "lru" evicts the least recently released, "mru" the most recent."""
    bm = BlockManager(6, 4, allow_block_sharing=True, eviction=policy)
    a, b = list(range(10, 19)), list(range(30, 39))  # 9 tokens: 2 full blocks each (+1 computed on reuse)
    for rid, toks in (("a", a), ("b", b)):
        assert bm.ensure(rid, 8)
        bm.commit(rid, toks, 8)
        bm.free(rid)  # released order: a's tail, a's head, b's tail, b's head
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    assert bm.ensure("c", 4 * 3)  # 2 content-free blocks, then one eviction
    assert bm.evictions == 1
    bm.free("c")
    hit_a, hit_b = bm.match_prefix("qa", a), bm.match_prefix("qb", b)
    if policy == "lru":
        assert (hit_a, hit_b) == (4, 8)  # a's tail went first: a's head still matches
    else:
        assert (hit_a, hit_b) == (8, 0)  # b's head went first: b's chain is broken at its start


def test_prefix_cache_eviction_reaches_the_block_manager(llama_model):
    for policy in ("lru", "mru"):
        with continuous_batching(llama_model, GREEDY16, ContinuousBatchingConfig(prefix_cache_eviction=policy)) as m:
            assert m.resolved_config.prefix_cache_eviction == policy
            assert m.cache.block_manager.eviction == policy
    with pytest.raises(ValueError, match="prefix_cache_eviction"):
        ContinuousBatchingConfig(prefix_cache_eviction="fifo")


# -- resolution: the offload clamp, the CPU memory share, the batch-token floor -----------------
class _Memory:
    def __init__(self, available: int) -> None:
        self.available = available


def test_cpu_offload_space_is_clamped_to_available_ram(llama_model, monkeypatch):
    import psutil

    from contbatch.setup import resolve

    per_block = KVLayout.from_model_config(llama_model.config, torch.float32).bytes_per_block(4)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(2**30))  # 1 GiB available
    config = ContinuousBatchingConfig(block_size=4, num_blocks=64, cpu_offload_space=100.0,
                                      cpu_offload_space_safety_threshold=0.5)
    r, _ = resolve.resolve_config(config, llama_model)
    assert r.cpu_offload_blocks == 2**29 // per_block and r.cpu_offload_gib == 0.5
    assert any("cpu_offload_space clamped from 100.0 to 0.50 GiB" in n for n in r.notes), r.notes
    # Within the cap: as asked, and no note.
    r, _ = resolve.resolve_config(dataclasses_replace(config, cpu_offload_space=0.25), llama_model)
    assert r.cpu_offload_blocks == 2**28 // per_block and r.cpu_offload_gib == 0.25
    assert not any("clamped" in n for n in r.notes), r.notes
    # The scheduler gets the clamped capacity.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(2**20))  # 1 MiB: a few blocks
    with continuous_batching(llama_model, GREEDY16, dataclasses_replace(config, cpu_offload_space=1.0)) as m:
        sched = m.scheduler
        capacity = sched.host.capacity_blocks if hasattr(sched, "host") else sched.offload_capacity_blocks
        assert capacity == m.resolved_config.cpu_offload_blocks == 2**19 // per_block


def test_offload_space_rounding_is_not_called_a_clamp(llama_model, monkeypatch):
    import psutil

    from contbatch.setup import resolve

    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(2**34))  # 16 GiB: no clamp
    config = ContinuousBatchingConfig(block_size=12, num_blocks=64, cpu_offload_space=0.25)  # 6 KiB blocks
    r, _ = resolve.resolve_config(config, llama_model)
    assert r.cpu_offload_blocks == int(0.25 * 2**30) // (6 * 1024)
    assert not any("clamped" in n for n in r.notes), r.notes


def test_max_memory_percent_caps_the_cpu_cache(llama_model, monkeypatch):
    import psutil

    from contbatch.setup import resolve

    per_block = KVLayout.from_model_config(llama_model.config, torch.float32).bytes_per_block(4)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(100 * 2**20))  # 100 MiB available
    for share in (None, 0.5):
        r, _ = resolve.resolve_config(ContinuousBatchingConfig(block_size=4, max_memory_percent=share), llama_model)
        expected = share or 0.2  # the CPU's default share
        assert r.num_blocks == int(100 * 2**20 * expected) // per_block - 2  # two reserved blocks
        assert r.num_blocks_rule.startswith(f"cpu: capped at {expected:.0%}")
    with pytest.warns(DeprecationWarning, match="max_cpu_memory_percent"):
        old = ContinuousBatchingConfig(block_size=4, max_cpu_memory_percent=0.5)
    assert old.max_memory_percent == 0.5
    # Never below one full request (the model's context of 512 tokens = 128 blocks of 4).
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(64 * 2**10))
    r, _ = resolve.resolve_config(ContinuousBatchingConfig(block_size=4), llama_model)
    assert r.num_blocks == 128 and "raised to 128 blocks" in r.num_blocks_rule
    with pytest.raises(ValueError, match="max_memory_percent"):
        ContinuousBatchingConfig(max_memory_percent=0.0)


def test_max_batch_tokens_default_and_explicit_value(llama_model):
    from contbatch.setup import resolve

    r, _ = resolve.resolve_config(ContinuousBatchingConfig(num_blocks=64), llama_model)
    assert r.max_batch_tokens == 512  # the CPU default
    r, _ = resolve.resolve_config(ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=7), llama_model)
    assert r.max_batch_tokens == 7 and r.max_requests_per_batch <= 7  # explicit: honoured as given
    # ... and by the scheduler: no step computes more than 7 tokens.
    prompts = random_prompts(4, 5, 20, seed=72)
    sizes = []
    with continuous_batching(llama_model, GREEDY16, ContinuousBatchingConfig(block_size=4, max_batch_tokens=7)) as m:
        schedule = m.scheduler.schedule

        def spy():
            plan = schedule()
            sizes.append(plan.num_tokens)
            return plan

        m.scheduler.schedule = spy
        outs = [m.get_result(rid, timeout=60) for rid in m.add_requests(prompts, max_new_tokens=4)]
    assert max(sizes) == 7
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 4)
