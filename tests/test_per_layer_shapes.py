"""Per-layer KV shapes: layers of different KV heads and head dims (Gemma 4, MiMo-V2-Flash),
layers without KV, each cache layer allocated and copied at its own shape; token-exact
against `model.generate`."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from contbatch.cache import KVLayout, LayerKV, PagedAttentionCache
from contbatch.setup.support import probe_attention_calls

from family_exactness import SETTINGS, assert_exact

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.2, sliding_window=8,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ALTERNATING = ["sliding_attention", "full_attention"] * 2


def _build(name: str) -> torch.nn.Module:
    if name == "gemma4_shared_kv":  # full layers of head dim 32; the last two reuse the first two's K/V
        config = transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=4, layer_types=ALTERNATING,
                                               global_head_dim=32, num_kv_shared_layers=2,
                                               hidden_size_per_layer_input=16, vocab_size_per_layer_input=512)
    elif name == "gemma4_k_eq_v":  # full layers: one KV head of dim 32, keys doubling as values
        config = transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=4, layer_types=ALTERNATING,
                                               global_head_dim=32, attention_k_eq_v=True,
                                               num_global_key_value_heads=1, hidden_size_per_layer_input=0)
    elif name == "mimo_v2_flash":  # sliding layers: twice the KV heads, and attention sinks
        config = transformers.MiMoV2FlashConfig(**COMMON, num_hidden_layers=3, v_head_dim=16,
                                                layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                n_group=1, topk_group=1)
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


MODELS = ("gemma4_shared_kv", "gemma4_k_eq_v", "mimo_v2_flash")
SHAPES = {  # (kv heads, head dim) of each layer, as the layers' attention receives them
    "gemma4_shared_kv": [(2, 16), (2, 32), (2, 16), (2, 32)],
    "gemma4_k_eq_v": [(2, 16), (1, 32), (2, 16), (1, 32)],
    "mimo_v2_flash": [(2, 16), (4, 16), (4, 16)],
}
model_of = functools.cache(_build)  # each tiny model built once per module


@pytest.mark.parametrize("name", MODELS)
def test_layout_gives_each_layer_the_shape_it_attends_with(name):
    model = model_of(name)
    layout = KVLayout.from_model_config(model.config, torch.float32)
    assert [(s.kv_heads, s.width) for s in layout.layers] == SHAPES[name]
    calls = probe_attention_calls(model)
    assert [(c.kv_heads, c.key_dim) for c in sorted(calls, key=lambda c: c.layer_idx)] == SHAPES[name]
    cache = PagedAttentionCache(layout, num_blocks=4, block_size=4)
    assert [tuple(t.shape) for t in cache.key_cache] == [(h, 24, d) for h, d in SHAPES[name]]
    assert layout.bytes_per_block(4) == sum(2 * h * d * 4 * 4 for h, d in SHAPES[name])


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", MODELS)
def test_exact_against_generate(name, setting):
    assert_exact(model_of(name), setting)


def test_prefix_hits_copy_every_layer_at_its_shape():
    """Shared prompts (whole and partial block hits) on a per-layer layout stay exact."""
    from family_exactness import NEW_TOKENS, expected
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig, continuous_batching
    from conftest import random_prompts

    model = model_of("gemma4_shared_kv")
    system = random_prompts(1, 14, 14, seed=7)[0]
    prompts = [system + tail for tail in random_prompts(4, 1, 6, seed=8)]
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=16, num_blocks=64, allow_block_sharing=True)
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    with continuous_batching(model, gc, config) as m:
        first = m.get_result(m.add_request(prompts[0]), timeout=300)
        rest = [m.get_result(rid, timeout=300) for rid in m.add_requests(prompts[1:])]
        stats = m.stats()
    assert stats["prefix_cache_hits"] > 0, stats
    assert [list(o.generated_tokens) for o in [first, *rest]] == expected(model, prompts)


# -- the layout itself: layers without KV, copies, tensor-parallel shares ----------------------
MIXED = (LayerKV(2, 8, 8), LayerKV(0, 8, 8), LayerKV(1, 16, 12), LayerKV(4, 8, 8))


@pytest.mark.parametrize("token_major", [False, True])
def test_layers_without_kv_allocate_nothing_and_copies_keep_each_shape(token_major):
    layout = KVLayout(4, 4, 16, torch.float32, layers=MIXED)
    assert layout.bytes_per_block(4) == 2 * (2 * 8 + 0 + 1 * 16 + 4 * 8) * 4 * 4
    cache = PagedAttentionCache(layout, num_blocks=6, block_size=4, token_major=token_major)
    assert cache.key_cache[1].numel() == 0 and cache.value_cache[1].numel() == 0
    assert cache.nbytes == (6 + 2) * layout.bytes_per_block(4)
    gen = torch.Generator().manual_seed(1)
    for t in cache.key_cache + cache.value_cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    logical = [cache.kv(i) for i in range(4)]  # [H, slots, D] views
    before = [torch.cat([k[:, 0:4], k[:, 8:10]], 1).clone() for k, _ in logical]
    keys, values = cache.copy_out([0, 2], 6)
    cache.copy_in([4, 5], 6, keys, values)
    for b, (k, _) in zip(before, logical):
        assert torch.equal(b, k[:, 16:22])
    cache.copy_positions([(0, 3, 3)])  # a partial prefix hit: 3 positions of block 0 into block 3
    for k, v in logical:
        assert torch.equal(k[:, 12:15], k[:, 0:3]) and torch.equal(v[:, 12:15], v[:, 0:3])
    with pytest.raises(ValueError, match="copy_in was given"):
        cache.copy_in([4, 5], 5, keys, values)


def test_gather_reads_each_layer_with_its_own_heads():
    layout = KVLayout(4, 4, 16, torch.float32, layers=MIXED)
    cache = PagedAttentionCache(layout, num_blocks=6, block_size=4)
    for t in cache.key_cache:
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    slots = torch.tensor([5, 9, 2])
    for layer in (0, 2, 3):
        heads, width = layout.layer(layer).kv_heads, layout.layer(layer).width
        k, _ = cache.gather(layer, cache.gather_index(slots, heads))
        assert torch.equal(k.view(heads, 3, width), cache.key_cache[layer][:, slots])


def test_tensor_parallel_share_splits_every_layer():
    layout = KVLayout(4, 4, 16, torch.float32, layers=(LayerKV(2, 8, 8), LayerKV(0, 8, 8), LayerKV(4, 16, 16),
                                                        LayerKV(2, 8, 8)))
    half = layout.shard(2)
    assert [s.kv_heads for s in half.layers] == [1, 0, 2, 1] and half.num_kv_heads == 2
    assert half.bytes_per_block(4) * 2 == layout.bytes_per_block(4)
    with pytest.raises(ValueError, match="cannot split layers of \\[2\\] KV heads"):
        layout.shard(4)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="was given 1 layer shapes"):
        KVLayout(2, 2, 8, torch.float32, layers=(LayerKV(2, 8, 8),))
    with pytest.raises(ValueError, match="kv_heads >= 0"):
        LayerKV(-1, 8, 8)


def test_a_layer_attending_with_other_heads_than_its_layout_is_refused():
    from contbatch.setup import support

    model = model_of("mimo_v2_flash")
    calls = probe_attention_calls(model)
    uniform = KVLayout(3, 2, 16, torch.float32)  # what one shape for every layer would say
    with pytest.raises(support.UnsupportedModel, match="layer 1 attends with 4 KV heads"):
        support._check_calls(calls, model.config, uniform)


def test_resolved_config_reports_each_layers_shape():
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager

    manager = ContinuousBatchingManager(model_of("gemma4_k_eq_v"), GenerationConfig(max_new_tokens=2),
                                        ContinuousBatchingConfig(block_size=4, num_blocks=16))
    try:
        resolved = manager.resolved_config
    finally:
        manager.destroy()
    assert resolved.kv_layers == "0: 2 KV heads of 16; 1: 1 KV heads of 32; 2: 2 KV heads of 16; 3: 1 KV heads of 32"
    layout = KVLayout.from_model_config(model_of("gemma4_k_eq_v").config, torch.float32)
    assert resolved.kv_cache_bytes == (16 + 2) * layout.bytes_per_block(4)
