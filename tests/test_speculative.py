"""Speculative decoding: proposals verified in the batch keep outputs exact (greedy: equal to
`model.generate`; sampled: distributed as the target's), whatever the batch, chunking,
preemption or stop condition, and roll rejected proposals back without a trace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from contbatch import (ContinuousBatchingConfig, SamplingParams, SpeculativeConfig, continuous_batching, generate_batch,
                       load_model)
from contbatch.speculative.ngram import propose_ngram

from conftest import make_tiny_model, random_prompts, reference_generate
from test_server import MODEL, chat_ids, reference_texts, start_server

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)


def _spec(method="ngram", **kw) -> dict:
    return {"method": method, **kw}


def _run(model, prompts, max_new, config, params=None, eos=None):
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
    with continuous_batching(model, gc, config) as m:
        ids = m.add_requests(prompts, sampling_params=params) if params else m.add_requests(prompts)
        outs = [m.get_result(rid, timeout=300) for rid in ids]
        stats = m.stats()
        bm = m.cache.block_manager
        leaked = bm.num_blocks - bm.num_free_blocks
        cached = [bm._keys[b] for b in bm._cached]
    for out in outs:
        assert out.error is None, out.error
    return outs, stats, leaked, cached


def _repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: prompt lookup finds proposals in them."""
    return [p * 4 for p in random_prompts(n, 3, 9, seed=seed)]


# -- the n-gram proposer -----------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # Tail [2, 3] last occurred at 5..6, followed by 7, 8, 5.
    assert propose_ngram(t, 2, 4, 3) == [7, 8, 5]
    # A longer n wins over a more recent shorter match: [1, 2, 3] -> 9 ... vs [2, 3] -> 7.
    t = np.array([1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3])
    assert propose_ngram(t, 2, 3, 2) == [9, 4]
    assert propose_ngram(np.array([1, 2, 3, 4]), 2, 4, 3) == []  # no earlier occurrence
    assert propose_ngram(np.array([5, 5]), 1, 4, 4) == [5]  # the continuation is cut at the end
    assert propose_ngram(np.array([7]), 1, 4, 4) == []


def test_config_is_validated():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="needs `model`"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative must be"):
        SamplingParams(speculative="yes")
    assert ContinuousBatchingConfig(speculative_config={"num_speculative_tokens": 3}).speculative_config == \
        SpeculativeConfig(num_speculative_tokens=3)


def test_proposals_stay_within_the_step_row_budget():
    """Oldest first: three decoding requests and max_step_rows=7 leave 4 rows for proposals."""
    from contbatch import RequestState, RequestStatus
    from contbatch.speculative import Speculator

    states = []
    for i in range(3):
        s = RequestState(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=50, arrival=i, params=SamplingParams(temperature=0))
        s.num_computed_tokens, s.status = 7, RequestStatus.DECODING
        states.append(s)
    Speculator(SpeculativeConfig(num_speculative_tokens=4, max_step_rows=7)).propose(reversed(states))
    assert [s.draft_tokens for s in states] == [[3, 1, 2], [3], []]


# -- greedy: exact ----------------------------------------------------------------------------
def test_ngram_greedy_equals_generate_mixed_chunked(tiny_model):
    """Repetitive and random prompts together, 4-token blocks, chunked prefill beside
    verification runs: every output equals `generate`, and proposals were accepted."""
    prompts = _repetitive(10, seed=3) + random_prompts(10, 1, 60, seed=4)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=48, speculative_config=_spec())
    outs, stats, leaked, _ = _run(tiny_model, prompts, 24, config)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(tiny_model, prompt, 24)
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert leaked == 0


@pytest.mark.parametrize("same_draft,offload", [(True, 0.0), (True, 0.01), (False, 0.0)],
                         ids=["self-draft", "self-draft-offload", "other-draft"])
def test_draft_model_greedy_equals_generate_under_preemption(llama_model, same_draft, offload):
    """A draft model (the target itself: every proposal accepted; another model: nearly all
    rejected), few blocks so requests are preempted mid-speculation: soft reset and
    recomputed, or offloaded to the host tier and copied back."""
    draft = llama_model if same_draft else make_tiny_model("llama", seed=7)
    prompts = random_prompts(12, 4, 30, seed=8)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=40, num_blocks=40, safety_margin=0.0,
                                      cpu_offload_space=offload,
                                      speculative_config=_spec("draft_model", model=draft, num_speculative_tokens=3))
    outs, stats, leaked, _ = _run(llama_model, prompts, 20, config)
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 20)
    assert (stats["offloads"] > 0 and stats["restores"] > 0) if offload else stats["soft_resets"] > 0
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0
    assert accepted == drafted if same_draft else accepted < drafted / 2
    assert leaked == 0


def test_draft_model_runs_on_the_cpu_kernels_of_the_target_and_gives_them_back(llama_model):
    """The draft's forwards are engine steps too: its linear layers take the target's kernel
    choice (native forced here), its norms the fused op, while the manager runs; greedy tokens
    stay `generate`'s, and stopping leaves no trace on the draft's modules."""
    draft = make_tiny_model("llama", seed=7)
    prompts = random_prompts(4, 4, 20, seed=12)
    config = ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "small_linear"},
                                      speculative_config=_spec("draft_model", model=draft, num_speculative_tokens=3))
    gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None)

    def routed():
        return [m for m in draft.modules() if "forward" in m.__dict__]

    with continuous_batching(llama_model, gc, config) as manager:
        ids = manager.add_requests(prompts)
        outs = [manager.get_result(i, timeout=60) for i in ids]
        kinds = {type(m).__name__ for m in routed()}
        assert {"Linear", "LlamaRMSNorm"} <= kinds, kinds
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 10)
    assert not routed()


def test_eos_and_max_new_tokens_inside_accepted_runs(llama_model):
    """With every proposal accepted, runs of 4 cross the EOS token and the length limit:
    each request still ends on the right token."""
    prompts = random_prompts(8, 3, 20, seed=11)
    refs = [reference_generate(llama_model, p, 30) for p in prompts]
    eos = refs[0][5]  # a token the first output reaches mid-run
    config = ContinuousBatchingConfig(block_size=4, speculative_config=_spec("draft_model", model=llama_model,
                                                                             num_speculative_tokens=4))
    outs, stats, leaked, _ = _run(llama_model, prompts, 13, config, eos=eos)
    for prompt, out in zip(prompts, outs):
        expected = reference_generate(llama_model, prompt, 13, eos)
        assert out.generated_tokens == expected
        assert out.finish_reason == ("stop" if expected[-1] == eos else "length")
        assert len(out.generated_tokens) <= 13
    assert outs[0].finish_reason == "stop" and len(outs[0].generated_tokens) == 6
    assert stats["spec_decode_num_accepted_tokens"] > 0 and leaked == 0


def test_rejected_proposals_leave_no_prefix_cache_entry(llama_model):
    """Every block in the prefix cache holds tokens of a real sequence: none of a rejected
    proposal. A later request extending a finished one reuses its blocks and stays exact."""
    prompts = _repetitive(6, seed=13)
    config = ContinuousBatchingConfig(block_size=4, speculative_config=_spec(num_speculative_tokens=4))
    outs, stats, leaked, cached = _run(llama_model, prompts, 24, config)
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    sequences = [tuple(p + o.generated_tokens) for p, o in zip(prompts, outs)]
    for key in cached:  # each cached block's tokens (whole, or a partly filled block's) appear, block-aligned
        n = len(key.tokens)
        assert any(any(seq[i : i + n] == key.tokens for i in range(0, len(seq) - n + 1, 4)) for seq in sequences)
    longer = [p + o.generated_tokens for p, o in zip(prompts, outs)]
    outs2, _, _, _ = _run(llama_model, longer, 8, config)
    for prompt, out in zip(longer, outs2):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 8)


def test_opt_out_logprobs_and_counters(llama_model):
    """A request may opt out; logprobs of accepted runs are the target's (equal to a run
    without speculation); the counters reach outputs and stats."""
    prompts = _repetitive(4, seed=17)
    plain = generate_batch(llama_model, prompts, GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None),
                           progress_bar=False, sampling_params=SamplingParams(temperature=0, logprobs=True))
    config = ContinuousBatchingConfig(block_size=4, speculative_config=_spec("draft_model", model=llama_model))
    outs, stats, _, _ = _run(llama_model, prompts, 16, config, params=SamplingParams(temperature=0, logprobs=True))
    for i, out in enumerate(outs):
        base = plain[f"req_{i}"]
        assert out.generated_tokens == base.generated_tokens
        assert out.spec_accepted_tokens > 0
        np.testing.assert_allclose(out.logprobs, base.logprobs, atol=1e-4)
    assert stats["spec_decode_acceptance_rate"] == 1.0
    outs, stats, _, _ = _run(llama_model, prompts, 16, config, params=SamplingParams(temperature=0, speculative=False))
    assert all(o.spec_draft_tokens == 0 for o in outs) and stats["spec_decode_num_draft_tokens"] == 0


def test_non_repeating_requests_pause_speculation(llama_model):
    """A draft that is always wrong: each request backs off after a few verification steps,
    so most of its tokens are decoded without proposals."""
    draft = make_tiny_model("llama", seed=21)
    config = ContinuousBatchingConfig(speculative_config=_spec("draft_model", model=draft, num_speculative_tokens=4))
    outs, stats, _, _ = _run(llama_model, random_prompts(2, 5, 10, seed=22), 60, config)
    assert stats["spec_decode_num_drafts"] < 15  # of ~60 steps per request
    assert stats["spec_decode_paused_steps"] > 0  # the draft's rounds paused for everyone
    assert all(o.generated_tokens == reference_generate(llama_model, p, 60)
               for p, o in zip(random_prompts(2, 5, 10, seed=22), outs))


def test_resolved_config_says_it_and_async_is_off(llama_model):
    config = ContinuousBatchingConfig(use_async_batching=True, speculative_config=_spec())
    with continuous_batching(llama_model, GREEDY, config) as m:
        r = m.resolved_config
    assert r.speculative == SpeculativeConfig(max_step_rows=24) and not r.use_async_batching  # the CPU's rows
    assert any("speculative decoding" in n for n in r.notes)
    assert any("use_async_batching=True is off" in w for w in r.warnings)


def test_stop_strings_inside_accepted_runs(default_model):
    """On the real tokenizer: a stop string reached inside an accepted run ends the request
    there, with the same text and tokens as without speculation."""
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    params = SamplingParams(temperature=0, stop=["of Fr"], max_new_tokens=12)
    base = generate_batch(model, [prompt], GenerationConfig(do_sample=False), progress_bar=False, tokenizer=tok,
                          sampling_params=params)["req_0"]
    config = ContinuousBatchingConfig(speculative_config=_spec("draft_model", model=model, num_speculative_tokens=6))
    out = generate_batch(model, [prompt], GenerationConfig(do_sample=False), config, progress_bar=False,
                         tokenizer=tok, sampling_params=params)["req_0"]
    assert out.text == base.text == "The capital " and out.generated_tokens == base.generated_tokens
    assert out.spec_accepted_tokens > 0


# -- sampled: the target's distribution ---------------------------------------------------------
def _exact_joint(model, prompt: list[int], steps: int, top_k: int) -> dict[tuple[int, ...], float]:
    """P(first `steps` tokens) under top-k sampling at temperature 1, by enumeration."""
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
            top = logits.topk(top_k)
            q = torch.softmax(top.values, -1)
            for t, pt in zip(top.indices.tolist(), q.tolist()):
                nxt[seq + (t,)] = p * pt
        probs = nxt
    return probs


@pytest.mark.parametrize("same_draft", [True, False], ids=["self-draft", "other-draft"])
def test_sampling_keeps_the_target_distribution(llama_model, same_draft):
    """1500 seeded samples of 3 tokens (top-k 3: 27 outcomes) with speculation, against the
    exact joint probabilities: a chi-square test whose false-failure rate is 1e-4. Seeds make
    the test repeatable; the same seeds give the same tokens at any batch size."""
    prompt = [3, 14, 15, 92, 65]
    draft = llama_model if same_draft else make_tiny_model("llama", seed=5)
    exact = _exact_joint(llama_model, prompt, 3, 3)
    n = 1500
    # Every request proposes every step: no pause, and no row budget (1500 requests decode at once).
    config = ContinuousBatchingConfig(speculative_config=_spec("draft_model", model=draft, num_speculative_tokens=2,
                                                               min_acceptance_rate=0.0, max_step_rows=10**6))
    gc = GenerationConfig(max_new_tokens=3, do_sample=True, eos_token_id=None)
    with continuous_batching(llama_model, gc, config) as m:
        ids = [m.add_request(prompt, sampling_params=SamplingParams(temperature=1.0, top_k=3, seed=s))
               for s in range(n)]
        outs = [m.get_result(rid, timeout=600) for rid in ids]
        stats = m.stats()
        again = m.get_result(m.add_request(prompt, sampling_params=SamplingParams(temperature=1.0, top_k=3, seed=7)),
                             timeout=60)
    assert stats["spec_decode_num_draft_tokens"] > 0
    if same_draft:  # proposals of the target's own argmax: accepted with their probability, or not
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert again.generated_tokens == outs[7].generated_tokens  # seeded: alone equals in a batch of 1500
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.generated_tokens)
        assert key in exact, f"{key} is outside the top-3 support"
        counts[key] = counts.get(key, 0) + 1
    # Pool rare outcomes so every expected count is >= 5 (the chi-square approximation's rule).
    cells = sorted(exact, key=exact.get)
    pooled_e, pooled_o, acc_e, acc_o = [], [], 0.0, 0
    for key in cells:
        acc_e += exact[key] * n
        acc_o += counts.get(key, 0)
        if acc_e >= 5:
            pooled_e.append(acc_e)
            pooled_o.append(acc_o)
            acc_e, acc_o = 0.0, 0
    if acc_e:
        pooled_e[-1] += acc_e
        pooled_o[-1] += acc_o
    chi2 = sum((o - e) ** 2 / e for o, e in zip(pooled_o, pooled_e))
    df = len(pooled_e) - 1
    p_value = 1 - torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)).item()
    assert p_value > 1e-4, f"chi2={chi2:.1f} df={df} p={p_value:.2e}"
    assert not math.isnan(p_value)


# -- over HTTP -------------------------------------------------------------------------------
def test_server_streams_accepted_runs_with_the_same_text(tiny_dir):
    """The server with a draft model (a copy of the served weights: every proposal accepted):
    chat, streamed and not, gives `generate`'s text; a request may opt out in its body; the
    acceptance counters are in /metrics under vLLM's names."""
    model_dir = tiny_dir
    reference = load_model(model_dir)
    srv = start_server(model_dir, speculative_config={"method": "draft_model", "model": str(model_dir),
                                                      "num_speculative_tokens": 4})
    try:
        client = srv.client()
        messages = [{"role": "user", "content": "Count to ten."}]
        expected = reference_texts(reference, [chat_ids(srv.tokenizer, "Count to ten.")], 24)[0]
        body = {"ignore_eos": True}
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                              extra_body=body)
        assert resp.choices[0].message.content == expected and resp.usage.completion_tokens == 24
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                     stream=True, extra_body=body))
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(deltas) == expected
        opted_out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                   extra_body={**body, "speculative": False})
        assert opted_out.choices[0].message.content == expected
        metrics = srv.metrics()
        assert metrics["contbatch:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["contbatch:spec_decode_acceptance_rate"] == 1.0
    finally:
        srv.stop()
