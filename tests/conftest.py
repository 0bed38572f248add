"""Shared fixtures: tiny random-weight models of several architectures, and the default model."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU our Triton kernels run in Triton's interpreter; it must be chosen before
# anything (torch._dynamo, transformers) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)

TINY_VOCAB = 512


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # Wider weights than the default 0.02 make logits peaked, so greedy argmax is decided
        # by real margins rather than float-rounding noise.
        initializer_range=0.2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    # Sliding-window models, with a window far shorter than the prompts.
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8)
    alternating = ["sliding_attention", "full_attention"] * 2
    common.update(num_hidden_layers=4, head_dim=16)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, sliding_window=8, layer_types=alternating)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, sliding_window=8, layer_types=alternating)
    raise ValueError(arch)


def make_tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_config(arch)
    # Gemma 2 soft-caps its scores, which SDPA cannot: its reference runs eager.
    attn = "eager" if arch == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session", params=["mistral", "gemma2", "gemma3"])
def sliding_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_model():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def default_model():
    from contbatch import load_model

    return load_model()


TINY_SERVER_CONTEXT = 1024


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer Llama with random weights and the default model's tokenizer (49152 tokens),
    saved to a folder: what the server, browser, Ray and CLI tests serve."""
    import transformers
    from transformers import AutoTokenizer

    from contbatch.setup.loading import default_model_dir

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TINY_SERVER_CONTEXT, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
        initializer_range=0.2,  # peaked logits: greedy decided by real margins, not rounding
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_prompts(n: int, min_len: int, max_len: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def reference_generate(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """`model.generate` on one unpadded prompt: the ground truth for greedy exactness."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
    # generate() fills a None eos from the model's own generation config; blank that too.
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos_token_id
    try:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), generation_config=gc, attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
            )
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


NEAR_TIE = 1e-4  # a greedy choice whose top-two logits are closer than this is decided by rounding


def greedy_margins(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The top-two logit margin behind each of `tokens` (a greedy continuation of `prompt`),
    from one forward over both: where one is below NEAR_TIE, any other summation order (our
    kernels, another batch) may pick the runner-up, so such a reference is not a test of
    exactness."""
    if not tokens:
        return []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def dense_attention(q, k, v, table, kv_len, block_size, scale, window, softcap, sinks=None):
    """Paged attention written out densely in float64, independently of every backend: keys
    gathered position by position through one request's block table, grouped-query heads
    repeated, the causal (and windowed) mask spelled out, and attention sinks (one logit per
    query head) appended as one more score column and dropped after the softmax.
    q: [n, H, D] (the request's last n positions); k, v: [H_kv, slots, D]. Returns [n, H, D]."""
    n, heads = q.shape[0], q.shape[1]
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(kv_len)]
    rep = heads // k.shape[0]
    kk = k[:, slots].double().repeat_interleave(rep, 0)
    vv = v[:, slots].double().repeat_interleave(rep, 0)
    scores = torch.einsum("nhd,hkd->hnk", q.double(), kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window is not None else True)
    scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, -1)
    else:
        sink = sinks.double().view(heads, 1, 1).expand(heads, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.einsum("hnk,hkd->nhd", probs, vv)
