"""RL rollouts: pause/resume, weights updated in place, stale KV never served, logprobs flag."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams

from conftest import make_tiny_model, random_prompts, reference_generate

GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=10)


@pytest.fixture
def models():
    """W0 (the engine's model, a fresh copy per test) and W1 (other weights, same shapes)."""
    return copy.deepcopy(make_tiny_model("llama")), make_tiny_model("llama", seed=1)


def _manager(model, **kw) -> ContinuousBatchingManager:
    return ContinuousBatchingManager(model, GC, ContinuousBatchingConfig(block_size=4, **kw))


def _run(manager, prompt, n=10) -> list[int]:
    rid = manager.add_request(prompt, max_new_tokens=n)
    out = manager.get_result(rid, timeout=60)
    assert out.error is None, out.error
    return out


def test_stale_prefix_kv_is_never_served(models):
    w0, w1 = models
    prompt = random_prompts(1, 30, 30, seed=2)[0]
    ref0, ref1 = reference_generate(w0, prompt, 10), reference_generate(w1, prompt, 10)
    assert ref0 != ref1
    manager = _manager(w0)
    manager.start()
    try:
        first = _run(manager, prompt)
        assert first.generated_tokens == ref0 and first.weight_version == 0 and first.weight_versions is None
        hits = manager.stats()["prefix_cache_hits"]
        assert manager.stats()["cached_blocks"] > 0
        assert manager.update_weights(w1.state_dict()) == 1 == manager.weight_version
        assert manager.stats()["cached_blocks"] == 0
        second = _run(manager, prompt)
        assert second.generated_tokens == ref1 and second.weight_version == 1
        assert manager.stats()["prefix_cache_hits"] == hits  # nothing computed under W0 was reused
        third = _run(manager, prompt)  # W1's own blocks are cached and reused again
        assert third.generated_tokens == ref1 and manager.stats()["prefix_cache_hits"] > hits
    finally:
        manager.stop(timeout=30)
    for name, tensor in w1.state_dict().items():
        assert torch.equal(w0.state_dict()[name], tensor), name


def _paused_mid_request(manager, prompt, after: int, n: int = 12) -> str:
    """Submit a streaming request and pause the engine (from its own thread) once `after`
    tokens exist: the update then lands at a known point."""
    def handler(out):
        if out.request_id == rid and not out.is_finished and len(tokens) < after:
            tokens.extend(out.generated_tokens)
            if len(tokens) >= after:
                manager.pause()

    tokens: list[int] = []
    manager.register_result_handler(handler)
    rid = "mid"
    manager.add_request(prompt, request_id=rid, max_new_tokens=n, streaming=True, queue_chunks=False)
    deadline = time.time() + 60
    while not manager.is_paused():
        assert time.time() < deadline
        time.sleep(0.01)
    return rid


@pytest.mark.parametrize("inflight", ["keep", "recompute", "abort"])
def test_update_with_requests_in_flight(models, inflight):
    w0, w1 = models
    prompt = random_prompts(1, 9, 9, seed=4)[0]
    manager = _manager(w0, allow_block_sharing=False)
    manager.start()
    try:
        rid = _paused_mid_request(manager, prompt, after=4)
        manager.update_weights(list(w1.named_parameters()), inflight=inflight)
        assert manager.is_paused()  # an update leaves the engine as paused as it found it
        manager.resume()
        out = manager.get_result(rid, timeout=60)
    finally:
        manager.stop(timeout=30)
    kept = out.generated_tokens[:4]
    assert kept == reference_generate(make_tiny_model("llama"), prompt, 4)
    if inflight == "abort":
        assert out.finish_reason == "cancelled" and "weights were updated" in out.error
        assert out.weight_versions == [0] * 4
        assert manager.stats()["free_blocks"] == manager.resolved_config.num_blocks
        return
    assert out.weight_versions == [0] * 4 + [1] * 8 and out.weight_version == 1
    if inflight == "recompute":  # W1 run on the prompt plus the tokens kept
        assert out.generated_tokens[4:] == reference_generate(w1, prompt + kept, 8)
        assert manager.stats()["soft_resets"] >= 1
    else:  # W0's KV of prompt + kept[:-1], then W1 from there
        w0_again = make_tiny_model("llama")
        cache = DynamicCache(config=w0_again.config)
        with torch.inference_mode():
            w0_again(torch.tensor([prompt + kept[:-1]]), past_key_values=cache, use_cache=True)
            w1_on_w0 = w1.generate(torch.tensor([prompt + kept]), past_key_values=cache, max_new_tokens=8,
                                   do_sample=False, eos_token_id=None, pad_token_id=0,
                                   attention_mask=torch.ones(1, len(prompt) + 4, dtype=torch.long))
        assert out.generated_tokens[4:] == w1_on_w0[0, len(prompt) + 4:].tolist()


def test_bad_update_changes_nothing(models):
    w0, w1 = models
    before = {k: v.clone() for k, v in w0.state_dict().items()}
    manager = _manager(w0)
    sd = w1.state_dict()
    name = next(iter(sd))
    with pytest.raises(ValueError, match="shape"):
        manager.update_weights({**sd, name: sd[name][:-1]})
    with pytest.raises(ValueError, match="unknown weight"):
        manager.update_weights({"model.nope.weight": sd[name], **sd})
    with pytest.raises(ValueError, match="inflight"):
        manager.update_weights(sd, inflight="later")
    assert manager.weight_version == 0 and not manager.is_paused()
    for k, v in w0.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_pause_resume_under_load_loses_nothing(models):
    w0, _ = models
    prompts = random_prompts(16, 2, 30, seed=8)
    manager = _manager(w0, max_batch_tokens=24)
    manager.start()
    stop = threading.Event()

    def flapper():
        while not stop.is_set():
            manager.pause()
            manager.pause()  # idempotent
            time.sleep(0.005)
            manager.resume()
            manager.resume()
            time.sleep(0.005)

    thread = threading.Thread(target=flapper)
    thread.start()
    try:
        ids = manager.add_requests(prompts, max_new_tokens=6)
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    finally:
        stop.set()
        thread.join()
        manager.stop(timeout=30)
    assert [o.request_id for o in outs] == ids
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(w0, prompt, 6)


def test_requests_submitted_while_paused_wait_and_reset_prefix_cache(models):
    w0, _ = models
    prompt = random_prompts(1, 20, 20, seed=9)[0]
    manager = _manager(w0)
    manager.start()
    try:
        _run(manager, prompt)
        manager.pause()
        rid = manager.add_request(prompt, max_new_tokens=5)
        time.sleep(0.3)
        assert manager.get_result(rid, timeout=0.01) is None and manager.stats()["waiting"] == 1
        assert manager.reset_prefix_cache() > 0 and manager.stats()["cached_blocks"] == 0
        manager.resume()
        assert manager.get_result(rid, timeout=60).generated_tokens == reference_generate(w0, prompt, 5)
    finally:
        manager.stop(timeout=30)


def test_return_logprobs_config_and_training_while_attached():
    """`return_logprobs=True` gives every request its chosen tokens' logprobs; a model put in
    train mode (dropout on) while attached still generates as in eval mode, and its own
    training step sees dropout and gradients as without a manager."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                     resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    twin = copy.deepcopy(model)
    prompts = random_prompts(3, 4, 12, seed=3)
    refs = [reference_generate(model, p, 6) for p in prompts]
    manager = ContinuousBatchingManager(model, GC, ContinuousBatchingConfig(block_size=4, return_logprobs=True))
    manager.start()
    try:
        model.train()
        manager.pause()
        ids = torch.tensor([prompts[0]])
        torch.manual_seed(5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        manager.resume()
        outs = [manager.get_result(r, timeout=60) for r in manager.add_requests(prompts, max_new_tokens=6)]
        plain = manager.get_result(manager.add_request(prompts[0], sampling_params=SamplingParams(max_new_tokens=6)),
                                   timeout=60)
    finally:
        manager.stop(timeout=30)
    assert [o.generated_tokens for o in outs] == refs
    assert all(len(o.logprobs) == 6 and all(lp <= 0 for lp in o.logprobs) for o in outs)
    assert plain.logprobs is not None and len(plain.logprobs) == 6
    twin.train()
    torch.manual_seed(5)
    twin_loss = twin(ids, labels=ids).loss
    twin_loss.backward()
    assert torch.equal(loss, twin_loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_admin_commands_raced_from_threads_never_expose_partial_weights(models, monkeypatch):
    """Pause, resume, update and prefix resets raced from four threads while requests run:
    every step sees one whole version of the weights (each update fills every tensor with its
    version number; the copy is slowed down, a tensor at a time, to leave room for a race)."""
    from contbatch.engine import control

    def slow_copy(pairs):
        for target, source in pairs:
            time.sleep(0.002)
            with torch.no_grad():
                target.copy_(source)

    monkeypatch.setattr(control, "copy_weights", slow_copy)
    w0, _ = models
    params = [p for _, p in w0.named_parameters()]
    names = [n for n, _ in w0.named_parameters()]
    seen: list[set[float]] = []

    def probe(module, args):  # the engine thread, at the start of every step's forward
        seen.append({float(params[0].flatten()[0]), float(params[len(params) // 2].flatten()[-1]),
                     float(params[-1].flatten()[-1])})

    w0.register_forward_pre_hook(probe)
    manager = _manager(w0, max_batch_tokens=24)
    manager.start()
    stop = threading.Event()
    errors: list[BaseException] = []

    def racer(seed: int) -> None:
        import random

        rng = random.Random(seed)
        try:
            while not stop.is_set():
                op = rng.choice(["pause", "resume", "update", "reset"])
                if op == "update":
                    version = float(rng.randint(1, 1000))
                    manager.update_weights({n: torch.full_like(p, version) for n, p in zip(names, params)},
                                           inflight=rng.choice(["recompute", "keep"]))
                elif op == "reset":
                    manager.reset_prefix_cache()
                else:
                    getattr(manager, op)()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        ids = manager.add_requests(random_prompts(12, 2, 20, seed=4), max_new_tokens=6)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        manager.pause()
        manager.resume()
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    finally:
        stop.set()
        manager.stop(timeout=30)
    assert not errors, errors
    assert all(o.error is None for o in outs)
    updated = [v for v in seen if any(x == int(x) and x >= 1 for x in v)]  # the random W0 has no integers
    mixed = [v for v in updated if len(v) > 1]
    assert updated and mixed == [], f"{len(mixed)} steps saw weights of two versions at once: {mixed[:3]}"


def test_an_admin_command_that_waits_too_long_is_told_which_one_runs(models, monkeypatch):
    from contbatch.engine import control
    from contbatch.engine.control import AdminBusy

    w0, _ = models
    started = threading.Event()
    real = control.copy_weights

    def slow(pairs):
        started.set()
        time.sleep(0.6)
        real(pairs)

    monkeypatch.setattr(control, "copy_weights", slow)
    manager = _manager(w0)
    manager.start()
    try:
        updater = threading.Thread(target=manager.update_weights, args=(w0.state_dict(),))
        updater.start()
        assert started.wait(30)
        with pytest.raises(AdminBusy, match=r"\(weights\)"):
            manager.pause(wait=0.05)
        assert manager.admin_operation() == "weights"
        manager.pause(wait=30)  # waits its turn, then pauses
        updater.join(30)
        assert manager.is_paused() and manager.weight_version == 1 and manager.admin_operation() is None
        manager.resume()
    finally:
        manager.stop(timeout=30)
