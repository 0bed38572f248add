"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): keys and values of different head
dims, cached decompressed at one width, token-exact against `model.generate`."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from contbatch.attention.paged import equal_head_dims
from contbatch.cache import KVLayout, PagedAttentionCache
from contbatch.setup.support import probe_attention_calls

from family_exactness import SETTINGS, assert_exact

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.2, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
           topk_group=1)


def _build(name: str) -> torch.nn.Module:
    if name == "deepseek_v3":  # keys 24 wide, values 16
        config = transformers.DeepseekV3Config(**COMMON, **MOE, q_lora_rank=32, v_head_dim=16)
    elif name == "deepseek_v2_wide_values":  # values (32) wider than keys (24); no query compression
        config = transformers.DeepseekV2Config(**COMMON, **MOE, q_lora_rank=None, v_head_dim=32)
    elif name == "minicpm3":
        config = transformers.MiniCPM3Config(**COMMON, q_lora_rank=32, v_head_dim=16)
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


MODELS = ("deepseek_v3", "deepseek_v2_wide_values", "minicpm3")
model_of = functools.cache(_build)  # each tiny model built once per module


@pytest.mark.parametrize("name", MODELS)
def test_layout_holds_the_decompressed_shapes_the_layers_attend_with(name):
    model = model_of(name)
    layout = KVLayout.from_model_config(model.config, torch.float32)
    text = model.config
    value_dim = text.v_head_dim
    assert all((s.kv_heads, s.key_dim, s.value_dim) == (4, 24, value_dim) for s in layout.layers)
    assert layout.head_dim == max(24, value_dim)  # both stored at the wider dim
    calls = probe_attention_calls(model)
    assert [(c.kv_heads, c.key_dim, c.value_dim) for c in calls] == [(4, 24, value_dim)] * 3
    # Each block holds K and V of every layer at the stored width.
    assert layout.bytes_per_block(4) == 2 * 3 * 4 * max(24, value_dim) * 4 * 4


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", MODELS)
def test_exact_against_generate(name, setting):
    assert_exact(model_of(name), setting)


def test_zero_padding_leaves_attention_unchanged():
    """What the engine stores and attends with (padded to one width) gives the same output as
    attention over the unpadded keys and values, for keys or values the wider."""
    gen = torch.Generator().manual_seed(3)
    for dk, dv in ((24, 16), (16, 32)):
        q, k, v = (torch.randn(1, 4, 5, d, generator=gen) for d in (dk, dk, dv))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dk ** -0.5)
        pq, pk, pv = equal_head_dims(q, k, v)
        assert pq.shape[-1] == pk.shape[-1] == pv.shape[-1] == max(dk, dv)
        got = torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, is_causal=True, scale=dk ** -0.5)
        torch.testing.assert_close(got[..., :dv], want, rtol=1e-6, atol=1e-6)


def test_mismatched_call_is_refused():
    """A layout that does not match what the layers receive refuses the model at start."""
    from contbatch.setup import support

    model = model_of("deepseek_v3")
    calls = probe_attention_calls(model)
    layout = KVLayout.from_model_config(model.config, torch.float32)
    support._check_calls(calls, model.config, layout)  # the true layout passes
    wrong = KVLayout(3, 4, 24, torch.float32)  # values at the keys' dim: not what the layers give
    with pytest.raises(support.UnsupportedModel, match="value dim 16, but its config says 4 of key dim 24 and value dim 24"):
        support._check_calls(calls, model.config, wrong)


def test_offload_round_trip_of_a_latent_layout():
    """copy_out / copy_in carry every layer's padded K/V to the host and back, bit for bit."""
    layout = KVLayout.from_model_config(model_of("deepseek_v3").config, torch.float32)
    cache = PagedAttentionCache(layout, num_blocks=8, block_size=4)
    gen = torch.Generator().manual_seed(5)
    for t in cache.key_cache + cache.value_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    keys, values = cache.copy_out([1, 3], 6)  # slots 4-7 and 12-13
    before = [torch.cat([t[:, 4:8], t[:, 12:14]], 1) for t in cache.key_cache + cache.value_cache]
    cache.copy_in([5, 6], 6, keys, values)  # into slots 20-25
    for b, t in zip(before, cache.key_cache + cache.value_cache):
        assert torch.equal(b, t[:, 20:26])


def test_compiled_step_is_exact():
    """A compiled step (level 1) hands the padded Q/K/V to the opaque paged-attention op and
    slices its output back: still `generate`'s tokens."""
    from family_exactness import PROMPTS, expected, served

    model = model_of("deepseek_v3")
    config = dict(block_size=4, max_batch_tokens=16, num_blocks=128, default_compile_level=1)
    tokens, stats = served(model, config, PROMPTS[:4])
    assert stats["compiles"] >= 1 and stats["graph_breaks"] == 0, stats
    assert tokens == expected(model, PROMPTS[:4])
