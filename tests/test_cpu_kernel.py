"""The C++ CPU decode kernel (attention/cpu_kernel.py): reads K/V in place, matches the math."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.attention import backend as backend_mod
from contbatch.attention import cpu_kernel

from conftest import dense_attention, random_prompts, reference_generate

AVAILABLE, HOW = cpu_kernel.load()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"CPU kernel: {HOW}")


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (7, None, False), (None, 5.0, False),
                                                    (None, None, True)])
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 6, 2), (64, 10, 2), (128, 6, 2), (32, 4, 4), (256, 2, 1)],
                         ids=["generic", "d64-tiles-4+1", "d128-tiles-2+1", "d32-mha", "d256"])
def test_kernel_matches_reference(dtype, tol, window, cap, with_sinks, token_major, dim, heads, kv_heads):
    """Every head dim with an AVX-512 tile (32, 64, 128, 256; groups split over tiles) and
    one without (16: the generic loops), against dense attention, with key counts on both
    sides of the 16-key chunks."""
    gen = torch.Generator().manual_seed(0)
    rows, bs, blocks, width = 9, 4, 40, 8
    shape = (blocks * bs, kv_heads, dim) if token_major else (kv_heads, blocks * bs, dim)
    k_store, v_store = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    k, v = (t.transpose(0, 1) for t in (k_store, v_store)) if token_major else (k_store, v_store)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(rows)]).int()
    lens = torch.tensor([1, 2, 3, 4, 5, 17, 31, 32, 9], dtype=torch.int32)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    out = cpu_kernel.paged_decode(q, k, v, table, lens, sinks, bs, 0.3, window, cap)
    ref = torch.cat([dense_attention(q[b : b + 1], k, v, table[b], int(n), bs, 0.3, window, cap, sinks)
                     for b, n in enumerate(lens)])
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
def test_kernel_refuses_bad_inputs():
    q = torch.randn(2, 4, 8)
    k = v = torch.randn(3, 16, 8)  # 4 query heads over 3 KV heads
    table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_kernel.paged_decode(q, k, v, table, lens, None, 4, 1.0, None, None)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernel.paged_decode(q, k[:2], v[:2], table.long(), lens, None, 4, 1.0, None, None)


@needs_kernel
@pytest.mark.parametrize("fast,spec", [(True, False), (False, False), (True, True)],
                         ids=["kernel", "gather", "kernel-speculative"])
def test_engine_exact_with_and_without_the_kernel(sliding_model, fast, spec):
    """Windowed and soft-capped models: the in-place kernel and the gather reference both
    give `model.generate`'s tokens, and the resolved config says which ran. The kernel also
    takes the short rows (chunks of <= 16 tokens here; with speculation, verification runs)
    token by token."""
    prompts = random_prompts(10, 1, 40, seed=21) + ([p * 3 for p in random_prompts(4, 3, 6, seed=22)] if spec else [])
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=32, decode_fast_path=fast,
                                      speculative_config={"method": "ngram"} if spec else None)
    assert ContinuousBatchingManager(sliding_model, config=config).resolved_config.decode_fast_path is fast
    gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None)
    results = generate_batch(sliding_model, prompts, gc, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(sliding_model, prompt, 10)


def test_missing_kernel_is_a_warning_not_a_failure(llama_model, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "load", lambda: (False, "unavailable (no compiler)"))
    r = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig(block_size=4)).resolved_config
    assert r.attention_backend == "torch" and not r.decode_fast_path
    assert any("C++ CPU decode kernel is unavailable (no compiler)" in w for w in r.warnings)
    asked = backend_mod.choose_backend("torch", "cpu", 4, True, None, None)
    assert not asked.decode_fast_path and "decode_fast_path=True cannot run" in asked.warnings[0]
