"""The C++ CPU attention kernels (cpu/ops.py): decode rows and prompt chunks read
K/V in place and match the math."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.attention import select as backend_mod
from contbatch.cpu import ops as cpu_ops

from conftest import dense_attention, random_prompts, reference_generate

AVAILABLE, HOW = cpu_ops.load_attention()
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
    out = cpu_ops.paged_decode(q, k, v, table, lens, sinks, bs, 0.3, window, cap)
    ref = torch.cat([dense_attention(q[b : b + 1], k, v, table[b], int(n), bs, 0.3, window, cap, sinks)
                     for b, n in enumerate(lens)])
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (100, None, False), (None, 5.0, True),
                                                    (130, None, True)])
@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 6, 2), (64, 9, 3), (128, 4, 1)], ids=["generic", "d64-gqa3", "d128"])
def test_kernel_splits_long_heads_into_key_chunks(dtype, tol, window, cap, with_sinks, dim, heads, kv_heads):
    """Heads with more keys than a chunk (csrc/layer_parts.h's kKeyChunk, 64) are attended in
    chunks by several threads and merged: key counts on both sides of one, two and several
    chunks, with windows cutting them, sinks entering once, beside one-chunk rows; the values
    equal dense attention's and do not depend on the thread count."""
    gen = torch.Generator().manual_seed(3)
    rows, bs, blocks, width = 9, 16, 60, 24
    k, v = (torch.randn(kv_heads, blocks * bs, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(rows)]).int()
    lens = torch.tensor([64, 65, 128, 129, 1, 200, 63, 384, 250], dtype=torch.int32)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_ops.paged_decode(q, k, v, table, lens, sinks, bs, 0.3, window, cap))
    finally:
        torch.set_num_threads(threads)
    ref = torch.cat([dense_attention(q[b : b + 1], k, v, table[b], int(n), bs, 0.3, window, cap, sinks)
                     for b, n in enumerate(lens)])
    torch.testing.assert_close(outs[0].float(), ref.float(), atol=tol, rtol=tol)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (7, None, False), (70, 5.0, True)])
@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 6, 2), (64, 9, 3), (128, 8, 2), (80, 4, 4), (40, 2, 1)],
                         ids=["generic", "d64-gqa3", "d128-gqa4", "d80-mha", "d40-partial-columns"])
def test_prefill_kernel_matches_reference(dtype, tol, window, cap, with_sinks, dim, heads, kv_heads):
    """Prompt chunks of 1-150 tokens, first chunks and later ones (earlier keys in the cache),
    in one call, against dense attention: query tiles of several sizes, key blocks of 64 cut
    by the causal diagonal and by the window, head dims in 16-float columns (64, 128, 80),
    with a partial column (40) and without one (16). Rows of other requests are left alone."""
    gen = torch.Generator().manual_seed(1)
    bs, blocks = 8, 120
    k, v = (torch.randn(kv_heads, blocks * bs, dim, generator=gen).to(dtype) for _ in range(2))
    chunks = [(1, 1), (5, 5), (150, 150), (37, 200), (64, 64), (2, 90)]  # (query tokens, keys seen)
    width = max(-(-kv // bs) for _, kv in chunks)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in chunks]).int()
    decode_rows = 3  # rows before the chunks, as in a step: the kernel must not touch them
    q_lens = torch.tensor([n for n, _ in chunks], dtype=torch.int32)
    q_start = (torch.cumsum(q_lens, 0) - q_lens + decode_rows).int()
    q = torch.randn(decode_rows + int(q_lens.sum()), heads, dim, generator=gen).to(dtype)
    kv_lens = torch.tensor([kv for _, kv in chunks], dtype=torch.int32)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    out = torch.full_like(q, 7.0)
    cpu_ops.paged_prefill(q, k, v, table, q_start, q_lens, kv_lens, sinks, bs, 0.3, window, cap, out)
    assert (out[:decode_rows] == 7.0).all()
    for c, (n, kv) in enumerate(chunks):
        rows = slice(int(q_start[c]), int(q_start[c]) + n)
        ref = dense_attention(q[rows], k, v, table[c], kv, bs, 0.3, window, cap, sinks)
        torch.testing.assert_close(out[rows].float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
def test_prefill_kernel_reads_strided_queries_and_refuses_bad_inputs():
    """The backend hands the projections' [T, H, D] view (heads not adjacent in memory)."""
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 64, 32, generator=gen) for _ in range(2))
    q = torch.randn(4, 20, 32, generator=gen).transpose(0, 1)  # [20, 4, 32], strided
    table = torch.arange(8, dtype=torch.int32)[None]
    args = (torch.tensor([0], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
            torch.tensor([30], dtype=torch.int32))
    out = torch.empty(20, 4, 32)
    cpu_ops.paged_prefill(q, k, v, table, *args, None, 8, 0.5, None, None, out)
    torch.testing.assert_close(out, dense_attention(q, k, v, table[0], 30, 8, 0.5, None, None).float())
    with pytest.raises(RuntimeError, match="inconsistent"):  # 20 query tokens cannot see only 10 keys
        cpu_ops.paged_prefill(q, k, v, table, args[0], args[1], torch.tensor([10], dtype=torch.int32), None, 8,
                                 0.5, None, None, out)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_prefill(q, k, v, table.long(), *args, None, 8, 0.5, None, None, out)
    with pytest.raises(RuntimeError, match="shaped as query"):
        cpu_ops.paged_prefill(q, k, v, table, *args, None, 8, 0.5, None, None, out[:10])


@needs_kernel
def test_kernel_refuses_bad_inputs():
    q = torch.randn(2, 4, 8)
    k = v = torch.randn(3, 16, 8)  # 4 query heads over 3 KV heads
    table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_ops.paged_decode(q, k, v, table, lens, None, 4, 1.0, None, None)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_decode(q, k[:2], v[:2], table.long(), lens, None, 4, 1.0, None, None)


@needs_kernel
@pytest.mark.parametrize("fast,prefill,spec,mbt", [(True, "auto", False, 32), (False, "off", False, 32),
                                                   (True, "auto", True, 32), (True, "auto", False, 96),
                                                   (False, "auto", False, 96)],
                         ids=["kernels", "gather-sdpa", "kernels-speculative", "prefill-kernel", "gather-prefill-kernel"])
def test_engine_exact_with_and_without_the_kernel(sliding_model, fast, prefill, spec, mbt):
    """Windowed and soft-capped models: the in-place kernels and the gather/SDPA reference all
    give `model.generate`'s tokens, and the resolved config says which ran. The decode kernel
    also takes the short rows (chunks of <= 16 tokens at 32 tokens a step; with speculation,
    verification runs) token by token; at 96 tokens a step the prefill kernel takes chunks of
    up to 96 tokens, first and later ones."""
    prompts = random_prompts(10, 1, 40, seed=21) + ([p * 3 for p in random_prompts(4, 3, 6, seed=22)] if spec else [])
    prompts += random_prompts(2, 100, 150, seed=23) if mbt > 32 else []
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=mbt, decode_fast_path=fast,
                                      cpu_kernel_overrides={"prefill": prefill},
                                      speculative_config={"method": "ngram"} if spec else None)
    resolved = ContinuousBatchingManager(sliding_model, config=config).resolved_config
    assert resolved.decode_fast_path is fast and resolved.cpu.prefill is (prefill == "auto")
    gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None)
    results = generate_batch(sliding_model, prompts, gc, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(sliding_model, prompt, 10)


def test_missing_kernel_is_a_warning_not_a_failure(llama_model, monkeypatch):
    monkeypatch.setattr(cpu_ops, "load_attention", lambda: (False, "unavailable (no compiler)"))
    r = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig(block_size=4)).resolved_config
    assert r.attention_backend == "torch" and not r.decode_fast_path
    assert any("C++ CPU decode kernel is unavailable (no compiler)" in w for w in r.warnings)
    assert not r.cpu.prefill
    assert any("C++ CPU prefill kernel is unavailable (no compiler)" in w for w in r.warnings)
    asked = backend_mod.choose_backend("torch", "cpu", 4, True, None, None)
    assert not asked.decode_fast_path and "decode_fast_path=True cannot run" in asked.warnings[0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("dim", [64, 8], ids=["whole-lines", "partial-lines"])
def test_kv_write_matches_index_copy(dtype, token_major, dim):
    """Our cache writer stores exactly what index_copy_ stores, heads-first or token-major,
    rows filling whole 64-byte lines (streaming stores) or not, from strided rows, and
    touches no other slot; enough rows to run on every thread."""
    from contbatch.cache.paged_cache import KVLayout, PagedAttentionCache

    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=dim, dtype=dtype)
    cache = PagedAttentionCache(layout, num_blocks=80, block_size=64, token_major=token_major)
    assert cache.native_write
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 32, 5000):
        slots = torch.randperm(cache.num_rows, generator=gen)[:tokens]
        fused = torch.randn(tokens, 2 * 3 + 9, dim, generator=gen).to(dtype)  # q, k, v heads of one projection
        key, value = fused[:, 9:12].transpose(0, 1), fused[:, 12:].transpose(0, 1)  # strided [3, T, D]
        expect = [t.clone() for t in cache.kv(1)]
        for e, rows in zip(expect, (key, value)):
            e.index_copy_(1, slots, rows)
        cache.write(1, slots, key, value)
        assert all(torch.equal(got, e) for got, e in zip(cache.kv(1), expect))
    assert not any(t.any() for t in cache.kv(0))  # another layer: untouched


@needs_kernel
def test_kv_write_refuses_bad_inputs():
    k = v = torch.zeros(2, 16, 8)
    rows = torch.ones(2, 3, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.contbatch_cpu.kv_write(k, v, torch.tensor([0, 5, 16]), rows, rows)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.contbatch_cpu.kv_write(k, v, torch.tensor([0, 5, 6], dtype=torch.int32), rows, rows)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.contbatch_cpu.kv_write(k, v, torch.tensor([0, 5, 6]), rows.double(), rows.double())
    assert not k.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_memory_is_zeroed_and_outlives_its_mapping(dtype):
    """Large CPU cache tensors live in a private anonymous mapping, touched only when written:
    zero, contiguous, writable, and kept alive by the tensor alone."""
    import gc

    from contbatch.cache.paged_cache import _zeros
    from contbatch.hugepages import HUGE_PAGE

    for shape in ((3, 8, 16), (3, HUGE_PAGE // 64 + 5, 64)):  # under and over one huge page
        t = _zeros(shape, dtype, torch.device("cpu"))
        gc.collect()
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        t.fill_(2.0)
        assert int(t.sum(dtype=torch.float64)) == 2 * t.numel()


def test_a_decode_steps_plan_is_the_general_paths(monkeypatch):
    """A step whose every request computes one token takes the backend's short path
    (`_one_token_rows`): its plan equals what the general path makes of the same host tensors;
    steps with a longer or an empty row are left to the general path."""
    from contbatch.attention import torch_backend as tb
    from contbatch.cache.paged_cache import KVLayout, PagedAttentionCache

    cache = PagedAttentionCache(KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32),
                                num_blocks=12, block_size=4)
    backend = tb.TorchBackend(decode_kernel=True, prefill_kernel=True)

    def host(q_lens: list[int], kv_lens: list[int]) -> dict[str, torch.Tensor]:
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=cu[1:])
        return {"cu_seqlens_q": cu, "kv_lens": torch.tensor(kv_lens, dtype=torch.int32),
                "block_table": torch.arange(len(q_lens) * 3, dtype=torch.int32).view(len(q_lens), 3)}

    decode = host([1, 1, 1], [5, 9, 2])
    short, one_token_rows = backend.prepare(decode, cache), tb._one_token_rows
    monkeypatch.setattr(tb, "_one_token_rows", lambda h, c: None)
    general = backend.prepare(decode, cache)
    assert short.decode_rows is not None and (short.num_tokens, short.decode_groups, short.prefill_rows,
                                              short.prefill_chunks) == (3, [], [], None)
    assert (general.num_tokens, general.decode_groups, general.prefill_rows, general.prefill_chunks) == (3, [], [], None)
    for a, b in ((short.decode_rows.block_table, general.decode_rows.block_table),
                 (short.decode_rows.kv_lens, general.decode_rows.kv_lens)):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
    assert short.decode_rows.num_rows == general.decode_rows.num_rows == 3
    for q_lens in ([1, 3, 1], [1, 0, 2], [2]):
        assert one_token_rows(host(q_lens, [4] * len(q_lens)), cache) is None
