"""Chunked local attention (Llama 4: a query at q sees keys k <= q with k // chunk == q // chunk):
the kernels and their reference against a dense computation, the start-up checks, and the
engine token-exact against `model.generate`."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from contbatch.attention.metadata import first_visible, visible_keys
from contbatch.attention.varlen_reference import reference_decode_attention, reference_varlen_attention
from contbatch.cache import KVLayout
from contbatch.setup import layer_checks

from family_exactness import SETTINGS, assert_exact

CHUNK = 8
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              initializer_range=0.2, num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=CHUNK,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Layers 0-2 rope and chunked, layer 3 no-rope and full, its queries tempered by position: with
# floor_scale 20 (and attn_scale 1) positions from 19 on are scaled by 1.69, from 39 on by 2.10,
# while the engine's 16-token steps stay below 20 (`attention/temperature.py`).
NO_ROPE = [1, 1, 1, 0]
TEMPERATURE = dict(attn_temperature_tuning=True, floor_scale=20, attn_scale=1.0)
TOL = dict(atol=1e-5, rtol=1e-5)  # float32 kernels against float64


def _llama4(**overrides) -> torch.nn.Module:
    config = transformers.Llama4TextConfig(**{**COMMON, "no_rope_layers": NO_ROPE, **TEMPERATURE, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


_model: list[torch.nn.Module] = []


def llama4() -> torch.nn.Module:
    if not _model:
        _model.append(_llama4())
    return _model[0]


# -- the rule ----------------------------------------------------------------------------------
def _dense(q, k, v, kv_len, scale, chunk, window=None):
    """One request's last n queries over its first kv_len keys (contiguous, [H_kv, L, D]), in
    float64 with the chunk written out as `k // chunk == q // chunk`."""
    n, heads = q.shape[0], q.shape[1]
    rep = heads // k.shape[0]
    kk = k[:, :kv_len].double().repeat_interleave(rep, 0)
    vv = v[:, :kv_len].double().repeat_interleave(rep, 0)
    scores = torch.einsum("nhd,hkd->hnk", q.double(), kk) * scale
    q_pos = torch.arange(kv_len - n, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    visible = (k_pos <= q_pos) & (k_pos // chunk == q_pos // chunk)
    if window is not None:
        visible &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hnk,hkd->nhd", probs, vv)


def test_visible_keys_is_the_aligned_chunk():
    q = torch.arange(40)[:, None]
    k = torch.arange(40)[None, :]
    assert torch.equal(visible_keys(q, k, None, CHUNK), (k <= q) & (k // CHUNK == q // CHUNK))
    assert torch.equal(visible_keys(q, k, 3, CHUNK), (k <= q) & (k // CHUNK == q // CHUNK) & (k > q - 3))
    assert [first_visible(p, None, CHUNK) for p in (0, 7, 8, 15, 16)] == [0, 0, 8, 8, 16]
    assert [first_visible(p, 3, CHUNK) for p in (7, 8, 9, 10, 11)] == [5, 8, 8, 8, 9]


def _paged(kv_lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int):
    """Contiguous per-request K/V laid into a paged cache through a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(kv_lens) // block_size)
    blocks = len(kv_lens) * width + 1
    table = (torch.randperm(blocks - 1, generator=gen) + 1).view(len(kv_lens), width).int()
    dense_k = [torch.randn(kv_heads, width * block_size, dim, generator=gen) for _ in kv_lens]
    dense_v = [torch.randn(kv_heads, width * block_size, dim, generator=gen) for _ in kv_lens]
    k = torch.zeros(kv_heads, blocks * block_size, dim)
    v = torch.zeros_like(k)
    for b in range(len(kv_lens)):
        pos = torch.arange(width * block_size)
        slots = table[b].long()[pos // block_size] * block_size + pos % block_size
        k[:, slots], v[:, slots] = dense_k[b], dense_v[b]
    return k, v, table, dense_k, dense_v, gen


@pytest.mark.parametrize("window", [None, 5])
def test_reference_decode_and_varlen_match_dense(window):
    kv_lens = [1, 7, 8, 9, 17, 40]
    k, v, table, dk, dv, gen = _paged(kv_lens, 4, 2, 16, 4, seed=2)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(len(kv_lens), 4, 16, generator=gen)
    out = reference_decode_attention(q, k, v, table, lens, 0.25, window, None, block_size=4, chunk=CHUNK)
    unchunked = reference_decode_attention(q, k, v, table, lens, 0.25, window, None, block_size=4)
    for b, n in enumerate(kv_lens):
        torch.testing.assert_close(out[b : b + 1].double(), _dense(q[b : b + 1], dk[b], dv[b], n, 0.25, CHUNK, window),
                                   **TOL)
    assert not torch.allclose(out[4], unchunked[4])  # position 16 opens a chunk: it sees itself only
    q_lens = [1, 12, 20, 3]
    kv = [9, 12, 33, 40]
    k, v, table, dk, dv, gen = _paged(kv, 4, 2, 16, 4, seed=3)
    cu = torch.tensor([0, 1, 13, 33, 36], dtype=torch.int32)
    q = torch.randn(36, 4, 16, generator=gen)
    out = reference_varlen_attention(q, k, v, table, torch.tensor(kv, dtype=torch.int32), cu, scale=0.25,
                                     sliding_window=window, block_size=4, chunk=CHUNK)
    for b, n in enumerate(q_lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        torch.testing.assert_close(out[rows].double(), _dense(q[rows], dk[b], dv[b], kv[b], 0.25, CHUNK, window),
                                   **TOL)


def test_triton_kernels_chunk_like_the_reference():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and Triton's interpreter was not chosen before triton was imported")
    pytest.importorskip("triton")
    from contbatch.attention import triton_kernels as tk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Chunks that end inside and at the edges of the kernels' 32-key tiles.
    chunk = 12
    kv_lens = [1, 12, 13, 2 * tk.BLOCK_N + 1, 70]
    k, v, table, _, _, gen = _paged(kv_lens, 4, 2, 16, 4, seed=4)
    k, v, table = k.to(device), v.to(device), table.to(device)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(kv_lens), 4, 16, generator=gen).to(device)
    args = (q, k, v, table, lens, 0.25, None, None)
    out = tk.paged_decode_attention(*args, block_size=4, chunk=chunk)
    ref = reference_decode_attention(*args, block_size=4, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    reqs = [(1, 13), (40, 40), (5, 70)]
    k, v, table, _, _, gen = _paged([kv for _, kv in reqs], 4, 2, 16, 4, seed=5)
    k, v, table = k.to(device), v.to(device), table.to(device)
    cu = torch.tensor([0, 1, 41, 46], dtype=torch.int32, device=device)
    lens = torch.tensor([kv for _, kv in reqs], dtype=torch.int32, device=device)
    q = torch.randn(46, 4, 16, generator=gen).to(device)
    tiles = [t.to(device) for t in tk.varlen_tiles(cu.cpu(), tk.max_varlen_tiles(46, 3))]
    out = tk.paged_varlen_attention(q, k, v, table, lens, cu, *tiles, 0.25, None, None, block_size=4, chunk=chunk)
    ref = reference_varlen_attention(q, k, v, table, lens, cu, *tiles, 0.25, None, None, block_size=4, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# -- start-up ----------------------------------------------------------------------------------
def test_layout_chunks_the_chunked_layers_and_tempers_the_no_rope_one():
    layout = KVLayout.from_model_config(llama4().config, torch.float32)
    assert [s.chunk for s in layout.layers] == [CHUNK, CHUNK, CHUNK, None]
    assert [s.temperature for s in layout.layers] == [None, None, None, (20, 1.0)]
    assert not layout.uniform


def test_chunk_check_compares_with_transformers_mask(monkeypatch):
    text = llama4().config
    layout = KVLayout.from_model_config(text, torch.float32)
    assert layer_checks.chunk_mismatch(text, text.layer_types, layout) is None
    other = KVLayout.from_model_config(transformers.Llama4TextConfig(**{**COMMON, "attention_chunk_size": 4}),
                                       torch.float32)
    assert "chunked by 8 positions in its config, but the cache layout chunks it by {4}" in \
        layer_checks.chunk_mismatch(text, text.layer_types, other)
    bad = SimpleNamespace(attention_chunk_size=None)
    assert "no usable config.attention_chunk_size" in layer_checks.chunk_mismatch(bad, text.layer_types, layout)
    # A rule that drifted from transformers' (here: a window instead of a chunk) is caught.
    monkeypatch.setattr(layer_checks, "visible_keys", lambda q, k, window, chunk: (k <= q) & (k > q - chunk))
    assert "differs from the chunks the engine applies" in layer_checks.chunk_mismatch(text, text.layer_types, layout)


def test_steps_reaching_floor_scale_are_refused():
    """The model counts a step's rows from 0: a step of floor_scale tokens or more would have
    its later rows scaled by the model itself, on top of the engine's scaling: refused."""
    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=2, do_sample=False)
    for step_tokens in (20, None):  # None: the CPU default of 512
        with pytest.raises(ValueError, match="attn_temperature_tuning.*floor_scale=20.*set max_batch_tokens below 20"):
            ContinuousBatchingManager(llama4(), gc, ContinuousBatchingConfig(max_batch_tokens=step_tokens))
    layout = KVLayout.from_model_config(llama4().config, torch.float32)
    assert layer_checks.temperature_tuning_mismatch(llama4().config, layout, 19) is None
    untempered = KVLayout(4, 2, 16, torch.float32)
    assert "tempers layers []" in layer_checks.temperature_tuning_mismatch(llama4().config, untempered, 19)


def test_tempered_query_is_the_models_own_scaling():
    """The engine's scaling equals the one the model applies from its own cache's count."""
    from contbatch.attention.metadata import StepMetadata
    from contbatch.attention.temperature import tempered_query
    from contbatch.cache import PagedAttentionCache

    layout = KVLayout.from_model_config(llama4().config, torch.float32)
    cache = PagedAttentionCache(layout, num_blocks=4, block_size=4)
    pos = torch.tensor([0, 18, 19, 20, 39, 40, 100])
    meta = StepMetadata(cache, None, False, pos, *(torch.zeros(1),) * 4, None, None, 7, 7, positions=pos)
    q = torch.randn(1, 4, 7, 16)
    want = (q.transpose(1, 2) * (torch.log1p(torch.floor((pos.float() + 1.0) / 20)) * 1.0 + 1.0).view(1, 7, 1, 1))
    assert torch.equal(tempered_query(q, meta, 3), want.transpose(1, 2))
    assert tempered_query(q, meta, 0) is q


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_exact_against_generate(setting):
    assert_exact(llama4(), setting)


def test_exact_on_the_triton_backend():
    """The Triton kernels (Triton's interpreter without a GPU) chunk each layer in the engine."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter was not chosen before triton was imported")
    pytest.importorskip("triton")
    from family_exactness import PROMPTS, expected, served

    triton = dict(block_size=4, max_batch_tokens=16, num_blocks=128, attention_backend="triton")
    tokens, _ = served(llama4(), triton, PROMPTS[:3])
    assert tokens == expected(llama4(), PROMPTS[:3])
