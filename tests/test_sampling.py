"""Sampling: every processor matches transformers', seeds are stable, logprobs are right."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from contbatch import ContinuousBatchingConfig, RequestStatus, SamplingParams, continuous_batching, generate_batch
from contbatch.sampling.sampler import (
    SampleRequest,
    Sampler,
    apply_logit_bias,
    apply_min_new_tokens,
    apply_presence_frequency,
    apply_repetition_penalty,
    warp,
)

from conftest import random_prompts, reference_generate

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)


def _req(params: SamplingParams, prompt=(1, 2, 3), generated=(), stop=frozenset()):
    return SampleRequest(params.resolve(GREEDY, 8), list(prompt), list(generated), stop)


# -- each processor equals transformers' namesake ------------------------------------------
@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(3, 50) * 3


@pytest.mark.parametrize(
    "params, reference",
    [
        (dict(temperature=0.7), TemperatureLogitsWarper(0.7)),
        (dict(temperature=1.0, top_k=5), TopKLogitsWarper(5)),
        (dict(temperature=1.0, top_p=0.8), TopPLogitsWarper(0.8)),
        (dict(temperature=1.0, min_p=0.1), MinPLogitsWarper(0.1)),
    ],
)
def test_warpers_match_transformers(logits, params, reference):
    ours = warp(logits.clone(), [_req(SamplingParams(**params))] * 3)
    theirs = reference(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(theirs)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-5)


def test_repetition_penalty_matches_transformers(logits):
    ids = torch.tensor([[1, 4, 4, 9], [0, 2, 3, 7], [5, 5, 5, 5]])
    reqs = [_req(SamplingParams(repetition_penalty=1.3), prompt=row[:2].tolist(), generated=row[2:].tolist()) for row in ids]
    ours = logits.clone()
    apply_repetition_penalty(ours, reqs)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_presence_frequency_and_bias(logits):
    reqs = [_req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 2.0}), generated=[7, 7, 9])]
    ours = logits[:1].clone()
    apply_logit_bias(ours, reqs)
    apply_presence_frequency(ours, reqs)
    expected = logits[:1].clone()
    expected[0, 3] += 2.0
    expected[0, 7] -= 0.5 + 2 * 0.25
    expected[0, 9] -= 0.5 + 0.25
    assert torch.allclose(ours, expected, atol=1e-6)


def test_mixed_rows_only_touch_their_own(logits):
    """Different parameters in one batch: a greedy row stays the plain argmax."""
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0.5, top_k=3)), _req(SamplingParams(temperature=0))]
    result = Sampler(seed=0)(logits.clone(), reqs)
    assert result.tokens[0] == logits[0].argmax() and result.tokens[2] == logits[2].argmax()
    assert result.tokens[1] in logits[1].topk(3).indices


# -- distributions ---------------------------------------------------------------------------
def _frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    sampler = Sampler(seed=1234)
    counts = torch.zeros(logits_row.shape[0])
    batch = 500
    for _ in range(draws // batch):
        tokens = sampler(logits_row.repeat(batch, 1), [_req(params)] * batch).tokens
        counts += torch.bincount(tokens, minlength=logits_row.shape[0])
    return counts / draws


def _chi_square_ok(freq: torch.Tensor, probs: torch.Tensor, draws: int = 4000) -> bool:
    support = probs > 0
    expected = probs[support] * draws
    observed = freq[support] * draws
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return stat < dof + 5 * math.sqrt(2 * max(dof, 1))  # ~5 sigma above the mean


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
    ],
)
def test_sampling_distribution(params):
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    expected = torch.softmax(warp(row[None].clone(), [_req(params)])[0], dim=-1)
    freq = _frequencies(row, params)
    assert torch.all(freq[expected == 0] == 0), "a filtered token was drawn"
    assert _chi_square_ok(freq, expected)


# -- through the engine ----------------------------------------------------------------------
def test_neutral_processors_stay_greedy_exact(llama_model):
    neutral = SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                             presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, max_new_tokens=8)
    prompts = random_prompts(12, 1, 30, seed=51)
    results = generate_batch(llama_model, prompts, GREEDY, ContinuousBatchingConfig(block_size=4, max_batch_tokens=32),
                             progress_bar=False, sampling_params=neutral)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(llama_model, prompt, 8)


def test_seed_is_stable_alone_in_a_crowd_and_after_soft_resets(llama_model):
    prompt = random_prompts(1, 12, 12, seed=52)[0]
    seeded = SamplingParams(temperature=1.0, seed=7, max_new_tokens=12)
    alone = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False, sampling_params=seeded)["req_0"]
    others = random_prompts(50, 1, 40, seed=53)
    crowd_params = [SamplingParams(temperature=0.9, top_k=20, max_new_tokens=12)] * 50 + [seeded]
    config = ContinuousBatchingConfig(block_size=4, num_blocks=40, max_batch_tokens=48, safety_margin=0.0)
    with continuous_batching(llama_model, GREEDY, config) as m:
        ids = m.add_requests(others + [prompt], sampling_params=crowd_params)
        crowd = m.get_result(ids[-1], timeout=120)
        for rid in ids[:-1]:
            m.get_result(rid, timeout=120)
        assert m.stats()["soft_resets"] > 0
    assert crowd.generated_tokens == alone.generated_tokens
    different = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False,
                               sampling_params=SamplingParams(temperature=1.0, seed=8, max_new_tokens=12))["req_0"]
    assert different.generated_tokens != alone.generated_tokens


def test_logprobs_equal_log_softmax_of_model_logits(llama_model):
    prompt = random_prompts(1, 9, 9, seed=54)[0]
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=5, max_new_tokens=6)
    out = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False, sampling_params=params)["req_0"]
    seq = torch.tensor([prompt + out.generated_tokens])
    with torch.inference_mode():
        ref = torch.log_softmax(llama_model(seq).logits[0].float(), dim=-1)
    for i, token in enumerate(out.generated_tokens):
        row = ref[len(prompt) - 1 + i]
        assert abs(out.logprobs[i] - float(row[token])) < 1e-4
        top = row.topk(5)
        assert list(out.top_logprobs[i]) == top.indices.tolist()
        assert all(abs(out.top_logprobs[i][t] - float(v)) < 1e-4 for t, v in zip(top.indices.tolist(), top.values))


def test_n_samples_share_prompt_blocks(llama_model):
    prompt = random_prompts(1, 33, 33, seed=55)[0]  # 4 full blocks of 8 + 1 token
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_new_tokens=5)
    with continuous_batching(llama_model, GREEDY, ContinuousBatchingConfig(block_size=8)) as m:
        rid = m.add_request(prompt, request_id="fan", sampling_params=params)
        out = m.get_result(rid, timeout=60)
        stats = m.stats()
    assert out.request_id == "fan" and len(out.samples) == 4
    assert [s.index for s in out.samples] == [0, 1, 2, 3]
    assert all(len(s.generated_tokens) == 5 for s in out.samples)
    assert len({tuple(s.generated_tokens) for s in out.samples}) > 1
    assert stats["prefix_cache_hits"] == 3 * 32  # samples 1..3 reuse the 4 prompt blocks


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(top_logprobs=21), dict(n=0),
     dict(stop=5), dict(stop=[""]), dict(min_p=2.0), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
     dict(logit_bias={1: 500.0}), dict(max_new_tokens=0), dict(min_new_tokens=5, max_new_tokens=2),
     # not finite, not a number, or a bool where a count is meant
     dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
     dict(repetition_penalty=float("nan")), dict(repetition_penalty=1e-300), dict(presence_penalty=float("nan")),
     dict(logit_bias={1: float("nan")}), dict(logit_bias={True: 1.0}), dict(logit_bias={1.5: 1.0}),
     dict(stop_token_ids=[1.0]), dict(stop_token_ids=[True]), dict(top_k=True), dict(top_k=2.5), dict(n=2.0),
     dict(seed=1.5), dict(max_new_tokens=4.0), dict(temperature="1"),
     # sizes that would make every step slow for everybody
     dict(logit_bias={i: 1.0 for i in range(2000)}), dict(stop_token_ids=list(range(1_500_000)))],
)
def test_invalid_parameters_rejected(kwargs):
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-300).resolve(GREEDY, 8).temperature == 0.0


def test_stop_token_ids_must_be_in_the_vocabulary(llama_model):
    with continuous_batching(llama_model, GREEDY) as m:
        with pytest.raises(ValueError, match="stop_token_ids token ids outside the vocabulary"):
            m.add_request([1, 2, 3], sampling_params=SamplingParams(stop_token_ids=[10**6]))


def test_nan_logits_fail_only_their_request(llama_model):
    """A row whose logits are NaN (numerical overflow) fails its request with a clear error;
    its neighbours in the same steps finish exactly."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    expected = reference_generate(llama_model, prompts[1], 8)
    poison = {"on": True}
    original = Sampler.sample_states

    def poisoned(self, logits, states):  # the first request's row turns NaN
        if poison["on"]:
            logits = logits.clone()
            rows = [i for i, s in enumerate(states) if s.prompt_ids == prompts[0]]
            logits[rows] = float("nan")
        return original(self, logits, states)

    Sampler.sample_states = poisoned
    try:
        out = generate_batch(llama_model, prompts, GREEDY, progress_bar=False)
    finally:
        Sampler.sample_states = original
    assert out["req_0"].status == RequestStatus.FAILED and "non-finite logits" in out["req_0"].error
    assert out["req_1"].generated_tokens == expected


def test_top_logprobs_never_list_masked_tokens(llama_model):
    params = SamplingParams(temperature=1.0, top_k=3, seed=0, logprobs=True, top_logprobs=10, max_new_tokens=6)
    out = generate_batch(llama_model, [[5, 6, 7]], GREEDY, progress_bar=False, sampling_params=params)["req_0"]
    assert len(out.top_logprobs) == 6
    assert all(len(top) == 3 and all(math.isfinite(v) for v in top.values()) for top in out.top_logprobs)
    assert all(math.isfinite(v) for v in out.logprobs)


def test_large_logit_bias_and_stop_lists_are_vectorized(logits):
    """Bias and min-token masks are applied as one tensor op per step: the result equals a
    per-token reference, for the largest lists the parameters allow."""
    bias = {t: (t % 7) - 3.0 for t in range(0, 50, 2)}
    reqs = [_req(SamplingParams(logit_bias=bias)), _req(SamplingParams()), _req(SamplingParams(logit_bias={49: 5.0}))]
    ours = logits.clone()
    apply_logit_bias(ours, reqs)
    expected = logits.clone()
    for t, b in bias.items():
        expected[0, t] += b
    expected[2, 49] += 5.0
    assert torch.equal(ours, expected)
    big = SamplingParams(stop_token_ids=list(range(1024)), min_new_tokens=2)
    rows = [_req(big, stop=frozenset(range(0, 50, 3))), _req(SamplingParams())]
    masked = logits[:2].clone()
    apply_min_new_tokens(masked, rows)
    assert torch.isinf(masked[0, ::3]).all() and not torch.isinf(masked[0, 1::3]).any()
    assert torch.equal(masked[1], logits[1])


def test_stop_string_needs_tokenizer(llama_model):
    with continuous_batching(llama_model, GREEDY) as m:
        with pytest.raises(ValueError, match="need a tokenizer"):
            m.add_request([1, 2, 3], sampling_params=SamplingParams(stop=["x"]))


def test_min_new_tokens_and_stop_token_ids(llama_model):
    prompt = [5, 6, 7]
    expected = reference_generate(llama_model, prompt, 8)
    stop_at = expected[1]
    params = SamplingParams(temperature=0, stop_token_ids=[stop_at], max_new_tokens=8)
    out = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False, sampling_params=params)["req_0"]
    assert out.generated_tokens == expected[:2] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, stop_token_ids=[stop_at], min_new_tokens=4, max_new_tokens=8)
    out = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False, sampling_params=params)["req_0"]
    assert len(out.generated_tokens) >= 4 and stop_at not in out.generated_tokens[:4]


# -- text: stop strings and streaming on the real tokenizer ------------------------------------
def test_stop_strings_span_tokens_and_streaming_text(default_model):
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    base = generate_batch(model, [prompt], GenerationConfig(max_new_tokens=12, do_sample=False), progress_bar=False,
                          tokenizer=tok)["req_0"]
    assert base.text.startswith("The capital of France is Paris")
    # "of Fr" spans a token boundary ("of", " France"): matched on text, cut from the output.
    params = SamplingParams(temperature=0, stop=["of Fr"], max_new_tokens=12)
    with continuous_batching(model, GenerationConfig(do_sample=False), tokenizer=tok) as m:
        rid = m.add_request(prompt, streaming=True, sampling_params=params)
        chunks = list(m.request_id_iter(rid, timeout=60))
    final = chunks[-1]
    assert final.finish_reason == "stop" and final.text == "The capital "
    assert "".join(c.delta_text for c in chunks) == final.text
    assert sum(len(c.new_tokens) for c in chunks) == len(final.generated_tokens)


def test_streaming_never_splits_a_utf8_character(default_model):
    model, tok = default_model
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with only these emoji: 🌍🚀🎉 and the word café"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    with continuous_batching(model, GenerationConfig(do_sample=False, max_new_tokens=24), tokenizer=tok) as m:
        rid = m.add_request(prompt, streaming=True)
        chunks = list(m.request_id_iter(rid, timeout=60))
    assert any(tok.decode(c.new_tokens).endswith("\ufffd") for c in chunks), "no character was split: test is moot"
    assert all("\ufffd" not in c.delta_text for c in chunks)
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert chunks[-1].text == tok.decode(chunks[-1].generated_tokens, skip_special_tokens=True)
    assert chunks[-1].status == RequestStatus.FINISHED


@pytest.mark.parametrize(
    "params, warpers",
    [
        (dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
        (dict(temperature=1.3, top_k=12), [TemperatureLogitsWarper(1.3), TopKLogitsWarper(12)]),
        (dict(temperature=0.9, top_p=0.8), [TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.8)]),
    ],
)
def test_sampled_logprobs_are_log_softmax_of_processed_logits(llama_model, params, warpers):
    """Under temperature, top-k and top-p, each logprob is the log-softmax of the logits the
    token was drawn from, processed as transformers' warpers do: masked tokens never appear,
    and the chosen token was a candidate."""
    prompt = random_prompts(1, 7, 7, seed=56)[0]
    sp = SamplingParams(**params, seed=5, logprobs=True, top_logprobs=5, max_new_tokens=8)
    out = generate_batch(llama_model, [prompt], GREEDY, progress_bar=False, sampling_params=sp)["req_0"]
    seq = torch.tensor([prompt + out.generated_tokens])
    with torch.inference_mode():
        logits = llama_model(seq).logits[0].float()
    assert len(out.logprobs) == len(out.top_logprobs) == 8
    for i, token in enumerate(out.generated_tokens):
        row = logits[len(prompt) - 1 + i][None].clone()
        for warper in warpers:
            row = warper(seq[:, : len(prompt) + i], row)
        ref = torch.log_softmax(row[0], dim=-1)
        assert math.isfinite(out.logprobs[i]) and abs(out.logprobs[i] - float(ref[token])) < 1e-4
        top = ref.topk(5)
        finite = [(t, v) for t, v in zip(top.indices.tolist(), top.values.tolist()) if math.isfinite(v)]
        assert list(out.top_logprobs[i]) == [t for t, _ in finite]
        assert all(abs(out.top_logprobs[i][t] - v) < 1e-4 for t, v in finite)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152])
def test_argmax_rows_is_atens_argmax(dtype, vocab):
    """The CPU kernel's choice equals aten's: first index of the maximum (ties, -0.0 and 0.0,
    rows of -inf), the first NaN where a row holds one, any row stride."""
    from contbatch.cpu import native
    from contbatch.cpu.ops import argmax_rows

    gen = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = torch.randint(-3, 3, (rows, vocab + 5), generator=gen).to(dtype)[:, :vocab]  # many ties, row stride
    logits[1] = float("-inf")
    logits[2, vocab // 2 :] = float("nan")
    logits[3, vocab - 1] = float("nan")
    logits[4, -1] = float("inf")
    logits[5] = 0.0
    logits[5, vocab // 3] = -0.0
    logits[6] = torch.randn(vocab, generator=gen).to(dtype)
    assert not logits.is_contiguous()  # rows of a wider tensor
    want = logits.argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), want)
    assert torch.equal(argmax_rows(logits[:0]), want[:0])
    if native.load()[0]:
        assert torch.equal(torch.ops.contbatch_cpu.argmax_rows(logits.contiguous()), want)
