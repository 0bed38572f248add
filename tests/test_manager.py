"""The manager's contract: bad input gets a clear error, nothing is lost, lifecycles work."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from contbatch import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    RequestStatus,
    continuous_batching,
    generate_batch,
)

from conftest import TINY_VOCAB, random_prompts, reference_generate

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)


@pytest.fixture
def manager(llama_model):
    m = ContinuousBatchingManager(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4))
    m.start()
    yield m
    m.destroy()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=[]), "empty prompt"),
        (dict(input_ids=[1, TINY_VOCAB]), "outside the vocabulary"),
        (dict(input_ids=[-1, 5]), "outside the vocabulary"),
        (dict(input_ids=[5] * 500, max_new_tokens=20), "exceeds the model's context of 512"),
        (dict(input_ids=[5], max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(input_ids=[5.0, 6]), "must be integers"),
        (dict(input_ids=[True, 6]), "must be integers"),
        (dict(input_ids=torch.tensor([5.0, 6.0])), "must be integers"),
        (dict(input_ids="hello"), "not text"),
        (dict(input_ids=[[5, 6], [7, 8]]), "must be integers"),
    ],
)
def test_bad_input_is_rejected_and_engine_survives(manager, llama_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        manager.add_request(**kwargs)
    rid = manager.add_request([5, 6, 7], max_new_tokens=3)
    out = manager.get_result(rid, timeout=30)
    assert out.status == RequestStatus.FINISHED
    assert out.generated_tokens == reference_generate(llama_model, [5, 6, 7], 3)


def test_duplicate_live_id_rejected(manager):
    manager.add_request([5, 6, 7], request_id="dup", max_new_tokens=50)
    with pytest.raises(ValueError, match="already in use"):
        manager.add_request([8, 9], request_id="dup")
    assert manager.get_result("dup", timeout=30).status == RequestStatus.FINISHED
    manager.add_request([8, 9], request_id="dup", max_new_tokens=2)  # free again once retrieved
    assert manager.get_result("dup", timeout=30).generated_tokens


def test_call_on_stopped_manager_raises(llama_model):
    m = ContinuousBatchingManager(llama_model, GREEDY)
    with pytest.raises(RuntimeError, match="not running"):
        m.add_request([1, 2, 3])
    m.start()
    m.stop()
    with pytest.raises(RuntimeError, match="not running"):
        m.add_request([1, 2, 3])
    m.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        m.start()


def test_request_longer_than_block_table_rejected(llama_model):
    config = ContinuousBatchingConfig(block_size=4, max_blocks_per_request=3)
    with continuous_batching(llama_model, GREEDY, config) as m:
        with pytest.raises(ValueError, match="max_blocks_per_request=3 addresses 12 tokens"):
            m.add_request([5] * 10, max_new_tokens=5)
        assert m.get_result(m.add_request([5] * 6, max_new_tokens=6), timeout=30).status == RequestStatus.FINISHED


def test_get_result_is_a_real_lookup(manager):
    slow = manager.add_request([5, 6, 7], max_new_tokens=40)
    fast = manager.add_request([8, 9], max_new_tokens=1)
    out = manager.get_result(slow, timeout=60)  # waits for *this* id, even though `fast` ends first
    assert out.request_id == slow and len(out.generated_tokens) == 40
    assert manager.get_result(fast, timeout=60).request_id == fast
    with pytest.raises(KeyError):
        manager.get_result(fast)  # already retrieved
    with pytest.raises(KeyError):
        manager.get_result("never-submitted")


def test_get_result_timeout_returns_none(manager):
    rid = manager.add_request([5, 6, 7], max_new_tokens=200)
    assert manager.get_result(rid, timeout=0.001) is None
    manager.cancel_request(rid)
    assert manager.get_result(rid, timeout=30).status == RequestStatus.CANCELLED


def test_cancel_mid_generation_frees_blocks_and_spares_others(manager, llama_model):
    free_at_start = manager.stats()["free_blocks"]
    # Cancelled once its first tokens are out (a fixed sleep raced a faster engine: the tiny
    # model's 400 tokens were done within 0.3 s); streamed chunks are deltas.
    victim = manager.add_request([5] * 20, max_new_tokens=400, streaming=True)
    others = manager.add_requests(random_prompts(5, 3, 20, seed=7), max_new_tokens=8)
    stream = manager.request_id_iter(victim, timeout=30)
    chunks = [next(stream)]
    manager.cancel_request(victim)
    chunks += list(stream)
    out = chunks[-1]
    assert out.status == RequestStatus.CANCELLED and out.finish_reason == "cancelled"
    assert sum(len(c.generated_tokens) for c in chunks) < 400
    for rid, prompt in zip(others, random_prompts(5, 3, 20, seed=7)):
        assert manager.get_result(rid, timeout=60).generated_tokens == reference_generate(llama_model, prompt, 8)
    deadline = time.time() + 5
    while manager.stats()["free_blocks"] != free_at_start and time.time() < deadline:
        time.sleep(0.01)
    assert manager.stats()["free_blocks"] == free_at_start


def test_streaming_yields_incremental_outputs(manager, llama_model):
    rid = manager.add_request([5, 6, 7, 8], max_new_tokens=6, streaming=True)
    chunks = list(manager.request_id_iter(rid, timeout=30))
    assert len(chunks) >= 6 and len(chunks[-1].generated_tokens) == 6
    assert chunks[-1].status == RequestStatus.FINISHED
    assert chunks[-1].generated_tokens == reference_generate(llama_model, [5, 6, 7, 8], 6)
    assert all(c.status == RequestStatus.DECODING for c in chunks[:-1])
    # Chunks carry deltas, not copies: together they are the output, and the prompt is shared.
    assert all(c.generated_tokens == c.new_tokens and len(c.new_tokens) <= 1 for c in chunks[:-1])
    assert sum((c.new_tokens for c in chunks), []) == chunks[-1].generated_tokens
    assert all(c.prompt_ids is chunks[0].prompt_ids for c in chunks[:-1])
    assert manager.stats()["stream_queues"] == 0


def test_iteration_and_result_handler(manager):
    seen: list[str] = []
    manager.register_result_handler(lambda out: seen.append(out.request_id) if out.is_finished else None)
    manager.register_result_handler(lambda out: 1 / 0)  # a broken handler must not stop the engine
    ids = set(manager.add_requests(random_prompts(6, 1, 10, seed=8), max_new_tokens=3))
    got = {out.request_id for out in manager}
    assert got == ids
    assert set(seen) == ids


def test_graceful_stop_drains_then_restart(llama_model):
    m = ContinuousBatchingManager(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4))
    m.start()
    ids = m.add_requests(random_prompts(8, 2, 20, seed=9), max_new_tokens=10)
    m.stop()
    outs = [m.get_result(rid, timeout=0) for rid in ids]
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == 10 for o in outs)
    m.start()
    rid = m.add_request([5, 6], max_new_tokens=2)
    assert m.get_result(rid, timeout=30).status == RequestStatus.FINISHED
    assert m.stats()["free_blocks"] == m.resolved_config.num_blocks
    m.destroy()


def test_hard_stop_fails_pending_requests(llama_model):
    m = ContinuousBatchingManager(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4))
    m.start()
    ids = m.add_requests(random_prompts(8, 2, 20, seed=10), max_new_tokens=300)
    time.sleep(0.2)
    m.stop(hard_stop=True)
    outs = [m.get_result(rid, timeout=0) for rid in ids]
    assert all(o is not None for o in outs)
    failed = [o for o in outs if o.status == RequestStatus.FAILED]
    assert failed and all("hard stop" in o.error for o in failed)
    m.destroy()


def test_exception_in_a_step_fails_that_step_only(llama_model):
    calls = {"n": 0}
    with continuous_batching(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4)) as m:
        original = m.core.runner.launch

        def flaky(batch, prev):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return original(batch, prev)

        m.core.runner.launch = flaky
        first = m.add_request([5, 6, 7], max_new_tokens=5)
        out = m.get_result(first, timeout=30)
        assert out.status == RequestStatus.FAILED and "boom" in out.error and out.finish_reason == "error"
        later = m.add_request([5, 6, 7], max_new_tokens=5)
        assert m.get_result(later, timeout=30).generated_tokens == reference_generate(llama_model, [5, 6, 7], 5)
        assert m.stats()["free_blocks"] == m.resolved_config.num_blocks


def test_concurrent_submitters(manager, llama_model):
    prompts = random_prompts(16, 1, 15, seed=11)
    ids: dict[int, str] = {}

    def submit(i):
        ids[i] = manager.add_request(prompts[i], max_new_tokens=4)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        assert manager.get_result(ids[i], timeout=60).generated_tokens == reference_generate(llama_model, prompt, 4)


def test_resolved_config_is_logged_and_readable(llama_model, caplog):
    caplog.set_level("INFO", logger="contbatch")
    config = ContinuousBatchingConfig(block_size=16, max_prompt_length=100, max_generated_length=28)
    with continuous_batching(llama_model, GREEDY, config) as m:
        r = m.resolved_config
    assert r.block_size == 16 and r.max_blocks_per_request == 10  # ceil(128/16)+1 = 9 -> even 10
    assert r.max_batch_tokens == 512 and r.scheduler_type == "fifo" and r.safety_margin == 0.15
    assert r.num_blocks >= 8 and r.num_blocks_rule.startswith("cpu:")
    lines = [rec.message for rec in caplog.records if "contbatch engine:" in rec.message]
    assert len(lines) == 1 and f"blocks={r.num_blocks}x16" in lines[0]


def _prompt_with_eos_at(model, k: int, max_new: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation (no EOS) has at position k a token seen nowhere
    before it: made the model's EOS, generation really meets it at k."""
    for prompt in random_prompts(40, 2, 12, seed=60):
        out = reference_generate(model, prompt, max_new)
        if out[k] not in out[:k] and out[k] not in out[k + 1 :]:
            return prompt, out
    raise AssertionError("no prompt with a fresh token at position k")


def test_generation_config_defaults(llama_model, monkeypatch):
    with pytest.raises(ValueError, match="beam search"):
        ContinuousBatchingManager(llama_model, GenerationConfig(num_beams=4))
    k = 3
    prompt, full = _prompt_with_eos_at(llama_model, k, 8)
    eos = full[k]
    expected_stop = reference_generate(llama_model, prompt, 8, eos)
    assert expected_stop == full[: k + 1]  # generate itself stops there
    monkeypatch.setattr(llama_model.generation_config, "eos_token_id", eos)
    # An explicit config with eos None never stops on EOS, though the model's config names one
    # and it is generated at position k.
    results = generate_batch(llama_model, [prompt], GenerationConfig(max_new_tokens=8, eos_token_id=None),
                             progress_bar=False)
    out = results["req_0"]
    assert out.generated_tokens == full and eos in out.generated_tokens and out.finish_reason == "length"
    # Without a config the model's generation config supplies EOS: it stops at k, like generate.
    with continuous_batching(llama_model, None, ContinuousBatchingConfig(block_size=4)) as m:
        out = m.get_result(m.add_request(prompt, max_new_tokens=8), timeout=30)
        fallback = m.get_result(m.add_request([5, 6, 7]), timeout=30)  # max_new_tokens from the model's config
    assert out.generated_tokens == expected_stop and out.finish_reason == "stop"
    limit = llama_model.generation_config.max_new_tokens or 20
    assert len(fallback.generated_tokens) <= limit
    assert fallback.generated_tokens == reference_generate(llama_model, [5, 6, 7], limit, eos)


def test_tensor_input_and_eos_override(manager, llama_model):
    expected = reference_generate(llama_model, [5, 6, 7], 8)
    rid = manager.add_request(torch.tensor([[5, 6, 7]]), max_new_tokens=8, eos_token_id=expected[2])
    out = manager.get_result(rid, timeout=30)
    assert out.generated_tokens == expected[:3] and out.finish_reason == "stop"


def test_batch_encoding_and_batch_of_one_are_prompts(manager, llama_model):
    """What tokenizers return (`BatchEncoding`, a [1, T] tensor) is accepted as one prompt."""
    from transformers import BatchEncoding

    expected = reference_generate(llama_model, [5, 6, 7], 3)
    for prompt in (BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
                   BatchEncoding({"input_ids": torch.tensor([[5, 6, 7]])}), [[5, 6, 7]]):
        rid = manager.add_request(prompt, max_new_tokens=3)
        assert manager.get_result(rid, timeout=30).generated_tokens == expected


def test_generate_batch_takes_batch_encodings(llama_model):
    from transformers import BatchEncoding

    out = generate_batch(llama_model, [BatchEncoding({"input_ids": [5, 6, 7]})], GREEDY, progress_bar=False)
    assert out["req_0"].generated_tokens == reference_generate(llama_model, [5, 6, 7], 8)


def test_stream_read_with_get_result_frees_its_queue(manager):
    rid = manager.add_request([5, 6, 7], max_new_tokens=6, streaming=True)
    assert manager.get_result(rid, timeout=30).status == RequestStatus.FINISHED
    assert manager.stats()["stream_queues"] == 0
    rid = manager.add_request([5, 6, 7], max_new_tokens=6, streaming=True)
    assert [out.request_id for out in manager] == [rid]  # iterating the manager reads it too
    assert manager.stats()["stream_queues"] == 0


def test_request_id_iter_timeout_says_so(llama_model):
    with continuous_batching(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4)) as m:
        rid = m.add_request([5, 6, 7], max_new_tokens=400, streaming=True)
        with pytest.raises(TimeoutError, match="still running"):
            for _ in m.request_id_iter(rid, timeout=1e-6):
                pass
        m.cancel_request(rid)
        plain = m.add_request([5, 6, 7], max_new_tokens=400)
        with pytest.raises(TimeoutError, match="still running"):
            list(m.request_id_iter(plain, timeout=1e-6))
        m.cancel_request(plain)


def test_queue_limit_counts_sequences(llama_model):
    """max_queue_size counts samples: n=4 fills four places; a submission larger than the
    limit can never fit and is a ValueError (HTTP 400), a full queue a RuntimeError (429)."""
    from contbatch import SamplingParams

    config = ContinuousBatchingConfig(block_size=4, max_queue_size=6)
    with continuous_batching(llama_model, GREEDY, config) as m:
        with pytest.raises(ValueError, match="can never be accepted"):
            m.add_requests([[5, 6]] * 7)
        with pytest.raises(ValueError, match="can never be accepted"):
            m.add_request([5, 6], sampling_params=SamplingParams(n=7, temperature=1.0, seed=1))
        first = m.add_request([5, 6], max_new_tokens=300, sampling_params=SamplingParams(n=4, temperature=1.0, seed=1))
        assert m.stats()["live_sequences"] == 4
        with pytest.raises(RuntimeError, match="queue full"):
            m.add_requests([[5, 6]] * 3)
        m.add_requests([[5, 6]] * 2, max_new_tokens=2)  # exactly fills it
        m.cancel_request(first)
    assert m.stats()["live_sequences"] == 0


def test_result_handler_may_stop_the_manager_and_it_restarts(llama_model):
    m = ContinuousBatchingManager(llama_model, GREEDY, ContinuousBatchingConfig(block_size=4))
    m.register_result_handler(lambda out: out.is_finished and m.stop())
    m.start()
    rid = m.add_request([5, 6, 7], max_new_tokens=3)
    assert m.get_result(rid, timeout=30).status == RequestStatus.FINISHED
    deadline = time.time() + 10
    while m.is_running() and time.time() < deadline:
        time.sleep(0.01)
    assert not m.is_running()
    m.start()  # the model was detached on the way out: it attaches again
    rid = m.add_request([5, 6, 7], max_new_tokens=3)
    assert m.get_result(rid, timeout=30).generated_tokens == reference_generate(llama_model, [5, 6, 7], 3)
    m.destroy()


# -- promises the README makes that had no test of their own -----------------------------------
def test_request_larger_than_the_whole_cache_is_refused_at_submission(llama_model):
    """prompt + max_new_tokens beyond the cache (not the context, not the block table) raises
    at submission instead of waiting forever for blocks that cannot exist."""
    config = ContinuousBatchingConfig(block_size=4, num_blocks=4)  # 16 tokens of KV in all
    with continuous_batching(llama_model, GREEDY, config) as m:
        assert m.resolved_config.max_blocks_per_request * 4 >= 20  # the table would address it
        with pytest.raises(ValueError, match="whole cache holds 16"):
            m.add_request([5] * 10, max_new_tokens=7)  # 17 tokens: 5 blocks
        with pytest.raises(ValueError, match="whole cache holds 16"):
            m.add_requests([[5, 6], [5] * 16], max_new_tokens=1)  # all or nothing
        assert m.stats()["live_sequences"] == 0
        out = m.get_result(m.add_request([5] * 10, max_new_tokens=6), timeout=30)  # exactly 16 fits
    assert out.generated_tokens == reference_generate(llama_model, [5] * 10, 6)


def test_a_failing_step_spares_a_request_outside_it(llama_model, monkeypatch):
    """One request per step: A (its prompt chunked over several steps) runs alone while B is
    queued. A forward of A's fails (at the engine's own fault-injection site) and fails A
    only; B, outside that step, is untouched and finishes exact."""
    from contbatch import faults

    config = ContinuousBatchingConfig(block_size=4, max_requests_per_batch=1, max_batch_tokens=4,
                                      scheduler_type="prefill_first")
    prompt_a, prompt_b = random_prompts(2, 9, 14, seed=61)
    failed_steps = []
    with continuous_batching(llama_model, GREEDY, config) as m:

        class FailAsStep:
            def check(self, site):
                running = m.scheduler.running
                if site == "forward" and not failed_steps and list(running) == ["a"] \
                        and running["a"].num_computed_tokens >= 8:
                    failed_steps.append([s.request_id for s in m.scheduler.waiting])
                    raise RuntimeError("boom in a's step")

        monkeypatch.setattr(faults, "_active", FailAsStep())
        m.add_request(prompt_a, request_id="a", max_new_tokens=8)
        m.add_request(prompt_b, request_id="b", max_new_tokens=8)
        a, b = m.get_result("a", timeout=60), m.get_result("b", timeout=60)
        free = m.stats()["free_blocks"]
        num_blocks = m.resolved_config.num_blocks
    assert failed_steps == [["b"]]  # one step failed, with b waiting outside it
    assert a.status == RequestStatus.FAILED and "boom in a's step" in a.error
    assert b.status == RequestStatus.FINISHED and b.generated_tokens == reference_generate(llama_model, prompt_b, 8)
    assert free == num_blocks


def test_get_result_without_an_id_returns_each_finished_request_once(manager, llama_model):
    prompts = random_prompts(3, 2, 9, seed=62)
    lengths = [30, 1, 6]
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    outs = [manager.get_result(timeout=60) for _ in ids]
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert outs[0].request_id == ids[1]  # the next *finished* one: the 1-token request first
    for o in outs:
        i = ids.index(o.request_id)
        assert o.status == RequestStatus.FINISHED
        assert o.generated_tokens == reference_generate(llama_model, prompts[i], lengths[i])
    assert manager.get_result(timeout=0.2) is None  # nothing left: None, at once
    with pytest.raises(KeyError):
        manager.get_result(ids[0])  # already retrieved through get_result()


def test_do_sample_generation_config_supplies_sampling_parameters(llama_model, monkeypatch):
    """Fields left None come from a do_sample=True GenerationConfig: temperature, top_k, top_p,
    min_p reach the sampler, and give the tokens of the same values passed explicitly."""
    from contbatch import SamplingParams
    from contbatch.sampling.sampler import Sampler

    gc = GenerationConfig(do_sample=True, temperature=0.7, top_k=7, top_p=0.85, min_p=0.05, max_new_tokens=8,
                          eos_token_id=None)
    resolved = SamplingParams(seed=1).resolve(gc, 8)
    assert (resolved.temperature, resolved.top_k, resolved.top_p, resolved.min_p) == (0.7, 7, 0.85, 0.05)
    off = SamplingParams(seed=1).resolve(GenerationConfig(do_sample=False, temperature=0.7, top_k=7), 8)
    assert (off.temperature, off.top_k, off.top_p, off.min_p) == (0.0, -1, 1.0, 0.0)  # greedy config: ignored
    assert SamplingParams(top_k=3, seed=1).resolve(gc, 8).top_k == 3  # an explicit value wins

    seen = []
    original = Sampler.__call__

    def spy(self, logits, reqs):
        seen.extend(r.params for r in reqs)
        return original(self, logits, reqs)

    monkeypatch.setattr(Sampler, "__call__", spy)
    prompts = random_prompts(4, 3, 10, seed=63)
    seeds = [SamplingParams(seed=i) for i in range(4)]
    from_gc = generate_batch(llama_model, prompts, gc, progress_bar=False, sampling_params=seeds)
    assert seen and all((p.temperature, p.top_k, p.top_p, p.min_p) == (0.7, 7, 0.85, 0.05) for p in seen)
    explicit = [SamplingParams(temperature=0.7, top_k=7, top_p=0.85, min_p=0.05, seed=i) for i in range(4)]
    direct = generate_batch(llama_model, prompts, GREEDY, progress_bar=False, sampling_params=explicit)
    assert [from_gc[f"req_{i}"].generated_tokens for i in range(4)] == [
        direct[f"req_{i}"].generated_tokens for i in range(4)
    ]
    # top_k=1 from the config: greedy whatever the temperature, so the config's top_k is applied.
    hot = GenerationConfig(do_sample=True, temperature=5.0, top_k=1, max_new_tokens=8, eos_token_id=None)
    out = generate_batch(llama_model, prompts, hot, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == reference_generate(llama_model, prompt, 8)


def test_users_own_generate_while_a_manager_runs(manager, llama_model):
    """While the engine is attached (the model's attention swapped for ours) and stepping, a
    user's `model.generate` on another thread still gives generate's own tokens."""
    prompts = random_prompts(3, 4, 12, seed=64)
    before = [reference_generate(llama_model, p, 10) for p in prompts]
    busy = manager.add_requests(random_prompts(4, 5, 20, seed=65), max_new_tokens=400)
    assert manager.is_running()
    start = manager.stats()
    during = [reference_generate(llama_model, p, 10) for p in prompts]
    # the engine held work when generate began and stepped while it ran (whether or not it has
    # finished since: how far it got depends on the machine, that it overlapped does not)
    assert start["running"] + start["waiting"] + start["live_sequences"] > 0, "the engine was idle: test is moot"
    assert manager.stats()["steps"] > start["steps"], "the engine did not step during generate: test is moot"
    assert during == before
    for rid in busy:
        manager.cancel_request(rid)
        manager.get_result(rid, timeout=30)


def test_result_handlers_receive_streamed_chunks(manager, llama_model):
    """A handler sees every streamed chunk (deltas, DECODING) and then the final result; the
    chunks add up to the output. Read through the handler alone (queue_chunks=False) nothing is
    queued for a reader who never comes."""
    prompt = [5, 6, 7, 8]
    expected = reference_generate(llama_model, prompt, 6)
    seen: dict[str, list] = {"s": [], "q": []}
    manager.register_result_handler(lambda out: seen[out.request_id].append(out) if out.request_id in seen else None)
    manager.add_request(prompt, request_id="s", max_new_tokens=6, streaming=True, queue_chunks=False)
    assert manager.stats()["stream_queues"] == 0
    final = manager.get_result("s", timeout=30)
    chunks = seen["s"]
    assert chunks[-1].is_finished and chunks[-1].generated_tokens == expected == final.generated_tokens
    partial = chunks[:-1]
    assert len(partial) >= 5 and all(c.status == RequestStatus.DECODING for c in partial)
    assert all(c.generated_tokens == c.new_tokens and len(c.new_tokens) == 1 for c in partial)
    assert sum((c.new_tokens for c in chunks), []) == expected
    # queued as well: the handler and request_id_iter see the same chunks
    manager.add_request(prompt, request_id="q", max_new_tokens=6, streaming=True)
    iterated = list(manager.request_id_iter("q", timeout=30))
    assert [c.new_tokens for c in seen["q"]] == [c.new_tokens for c in iterated]
