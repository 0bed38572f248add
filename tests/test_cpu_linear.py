"""CPU linear layers on oneDNN or our C++ kernel inside engine steps only (cpu/routers/linear.py)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.cpu import linear_kernels, native, ops, probe
from contbatch.cpu.routers import linear as linear_router

from conftest import make_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not linear_kernels.onednn_available(), reason="this PyTorch build has no oneDNN linear")


@pytest.mark.parametrize("kernel", ["aten", "onednn", "small_linear", "panel", "auto"])
def test_greedy_output_equals_generate_with_each_kernel(llama_model, kernel):
    prompts = random_prompts(12, 1, 40, seed=5)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=32, cpu_kernel_overrides={"linear": kernel})
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    results = generate_batch(llama_model, prompts, gc, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(llama_model, prompt, 8)


def assert_equals_generate(manager, model, prompts, new_tokens: int) -> None:
    """All `prompts` at once through a running manager: each one's tokens equal `generate`'s."""
    ids = [manager.add_request(p) for p in prompts]
    for rid, prompt in zip(ids, prompts):
        assert manager.get_result(rid, timeout=60).generated_tokens == reference_generate(model, prompt, new_tokens)


def test_forced_onednn_routes_engine_calls_only_and_is_taken_back():
    """While attached, the engine's forward goes through oneDNN; the user's own forward and
    backward on the same model are the unmodified model's (same loss and gradients), and
    stopping the manager leaves no trace on the modules."""
    model = make_tiny_model("llama")
    twin = copy.deepcopy(model)
    ids = torch.tensor([random_prompts(1, 12, 12, seed=3)[0]])
    calls = []
    real = linear_kernels.onednn_linear

    def counting(x, w, b):
        calls.append(tuple(w.shape))
        return real(x, w, b)

    manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None),
                                        ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "onednn"}))
    r = manager.resolved_config.cpu.linear
    assert r.kernel == "onednn" and r.kernels_at(2) and "as asked" in r.summary
    linear_kernels.onednn_linear = counting
    try:
        manager.start()
        try:
            rid = manager.add_request(ids[0].tolist())
            assert manager.get_result(rid, timeout=60).error is None
            assert calls, "engine steps did not use the oneDNN linear"
            seen = len(calls)
            loss = model(ids, labels=ids).loss  # the user's training step, while attached
            loss.backward()
            assert len(calls) == seen, "a forward outside the engine was routed"
        finally:
            manager.stop(timeout=30)
    finally:
        linear_kernels.onednn_linear = real
    twin_loss = twin(ids, labels=ids).loss
    twin_loss.backward()
    assert torch.equal(loss, twin_loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert not any(set(linear_router.ATTRIBUTES) & set(m.__dict__) for m in model.modules())


def test_prepacked_weights_are_exact_and_follow_weight_updates(monkeypatch):
    """Layers on oneDNN run on prepacked copies of their weights inside steps of two or more
    rows; an in-place update (an optimizer step) or a replaced weight is packed again before
    the next use, so tokens keep equal `generate` on the model as it is now (`update_weights()`
    only drops the prefixes cached with the old weights)."""
    model = make_tiny_model("llama")
    prompts = random_prompts(6, 5, 30, seed=11)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    packed_calls = []
    real = linear_kernels.packed_linear
    monkeypatch.setattr(linear_kernels, "packed_linear", lambda x, w, b: packed_calls.append(x.shape) or real(x, w, b))
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "onednn"}))
    plan = manager.resolved_config.cpu.linear
    assert plan.prepack and "oneDNN weights prepacked" in plan.summary
    manager.start()
    try:
        def check():
            assert_equals_generate(manager, model, prompts, 6)

        check()
        assert packed_calls, "no step ran on the prepacked weights"
        copy.deepcopy(model)  # a frozen reference policy, taken while attached: oneDNN's copies are not copied
        with torch.no_grad():  # in place, as an optimizer step does
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.mul_(torch.linspace(0.5, 1.5, m.weight.shape[1]))
        manager.update_weights()  # drops the cached prefixes; the packed copies follow on their own
        check()
        down = model.model.layers[0].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight.detach().flip(0))  # a new tensor
        manager.update_weights()
        check()
    finally:
        manager.stop(timeout=30)
    assert not any("_contbatch_packed" in m.__dict__ for m in model.modules())
    off = ContinuousBatchingManager(model, config=ContinuousBatchingConfig(
        cpu_kernel_overrides={"linear": "onednn", "linear_prepack": False}))
    assert not off.resolved_config.cpu.linear.prepack and "not prepacked (as asked)" in off.resolved_config.cpu.linear.summary
    monkeypatch.setattr(linear_router, "PREPACK_RAM_FRACTION", 0.0)
    tight = ContinuousBatchingManager(model, config=ContinuousBatchingConfig(cpu_kernel_overrides={"linear": "onednn"})).resolved_config
    assert not tight.cpu.linear.prepack and "of the available RAM" in tight.cpu.linear.summary


def test_weights_are_packed_at_their_second_multi_row_call(monkeypatch):
    """A lone request (one prompt step, then one-row steps on the plain weights) packs nothing
    (but the layer its first step checks, which runs twice); a second request's prompt packs
    the other layers' weights, once each, and the tokens stay exact."""
    model = make_tiny_model("llama")
    packs = []
    real = linear_kernels.pack
    monkeypatch.setattr(linear_kernels, "pack", lambda w: packs.append(w) or real(w))
    manager = ContinuousBatchingManager(model, GenerationConfig(do_sample=False, eos_token_id=None),
                                        ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "onednn"}))
    assert manager.resolved_config.cpu.linear.prepack
    unchecked = [m.weight for m in model.model.layers[1].modules() if isinstance(m, torch.nn.Linear)]
    prompts = random_prompts(2, 12, 20, seed=5)
    manager.start()
    try:
        for i, prompt in enumerate(prompts):
            out = manager.get_result(manager.add_request(prompt, max_new_tokens=5), timeout=60)
            assert out.generated_tokens == reference_generate(model, prompt, 5)
            packed = [sum(p is w for p in packs) for w in unchecked]
            assert packed == [i] * len(unchecked), packed
    finally:
        manager.stop(timeout=30)


def test_plan_is_probed_logged_and_validated(llama_model, caplog):
    with pytest.raises(ValueError, match=r"cpu_kernel_overrides\['linear'\]"):
        ContinuousBatchingConfig(cpu_kernel_overrides={"linear": "mkl"})
    aten = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig(cpu_kernel_overrides={"linear": "aten"}))
    assert not aten.resolved_config.cpu.linear.routes_anything
    auto = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig()).resolved_config.cpu.linear
    shapes = {(m.out_features, m.in_features, "float32") for m in llama_model.modules()
              if isinstance(m, torch.nn.Linear)}
    for regime in range(4):
        assert set(auto.kernels_at(regime)) <= shapes
        assert set(auto.kernels_at(regime).values()) <= {"onednn", "small_linear", "panel"}
    assert "panel" not in auto.kernels_at(0).values()  # one row streams the plain weight
    assert not {"panel", "small_linear"} & set(auto.kernels_at(3).values())  # neither runs prompt chunks
    assert "4 rows:" in auto.summary and "32 rows:" in auto.summary and "512 rows:" in auto.summary
    assert "probed in" in auto.summary or "reused from" in auto.summary  # the verdict, for the start-up line
    json.dumps(dataclasses.asdict(auto))  # resolved_config.as_dict() is printed as JSON by `contbatch serve`
    double = make_tiny_model("llama").to(torch.float64)
    plan = ContinuousBatchingManager(double, config=ContinuousBatchingConfig()).resolved_config.cpu.linear
    assert not plan.routes_anything and "no float32, bfloat16 or float16" in plan.summary
    half = make_tiny_model("llama").to(torch.float16)  # aten, oneDNN where it runs float16, or upcast; never ours
    plan = ContinuousBatchingManager(half, config=ContinuousBatchingConfig()).resolved_config.cpu.linear
    assert "small_linear" not in {k for _, route in plan.routes for k in route}


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7])
def test_native_small_linear_matches_float64(rows, dtype):
    """Every row count it takes, odd widths (the tail past the last 32 values), with and
    without a bias: float32 accumulation, within rounding of the exact product."""
    gen = torch.Generator().manual_seed(rows)
    for out_features, in_features in [(96, 64), (33, 70), (5, 31), (300, 576)]:
        w = (torch.rand(out_features, in_features, generator=gen) - 0.5).to(dtype)
        x = (torch.rand(rows, in_features, generator=gen) - 0.5).to(dtype)
        b = (torch.rand(out_features, generator=gen) - 0.5).to(dtype)
        for bias in (None, b):
            got = ops.small_linear(x[None], w, bias)  # [1, rows, in]: a step's layout
            assert got.shape == (1, rows, out_features) and got.dtype == dtype
            exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[0].double(), exact, atol=tol, rtol=tol)


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_linear_output_does_not_depend_on_rows_or_band(dtype):
    """One or two rows read several output features at once from different stretches of the
    weight; a row's outputs are still bit for bit those of the weight's single rows and, on
    AVX-512 (where every row count sums in the same order), those it gets among five rows (read
    one feature at a time): how the weight is read never changes a value."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.rand(1031, 200, generator=gen) - 0.5).to(dtype)  # odd: the streams leave a remainder
    b = (torch.rand(1031, generator=gen) - 0.5).to(dtype)
    x = (torch.rand(5, 200, generator=gen) - 0.5).to(dtype)
    one = ops.small_linear(x[:1][None], w, b)[0, 0]
    for o in (0, 257, 258, 1030):
        assert torch.equal(ops.small_linear(x[:1][None], w[o:o + 1], b[o:o + 1])[0, 0, 0], one[o])
    if "avx512f" in native._cpu_flags().split() and "-mno-avx512f" not in native.cflags():
        two, five = ops.small_linear(x[:2][None], w, b)[0], ops.small_linear(x[None], w, b)[0]
        assert torch.equal(one, five[0]) and torch.equal(two, five[:2])


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
@pytest.mark.parametrize("rows", [2, 13, 14, 15, 29, 32, 100, 256, 257])
def test_panel_linear_matches_float64(rows):
    """Row counts around the tile's 14 and the 256 rows above which aten's GEMM takes over, odd
    widths (a last panel of fewer than 32 outputs, of fewer than 16), with and without a bias:
    float32 sums within rounding of the exact product, in the input's leading shape."""
    gen = torch.Generator().manual_seed(rows)
    for out_features, in_features in [(96, 64), (33, 70), (5, 31), (300, 576)]:
        w = torch.rand(out_features, in_features, generator=gen) - 0.5
        x = torch.rand(1, rows, in_features, generator=gen) - 0.5
        b = torch.rand(out_features, generator=gen) - 0.5
        packed = ops.panel_pack(w)
        assert packed.shape == ((out_features + 31) // 32, in_features, 32)
        for bias in (None, b):
            got = ops.panel_linear(x, w, packed, bias)
            assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
            exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_panel_linear_rows_do_not_depend_on_the_batch_or_threads():
    """A row's outputs are one chain of multiply-adds over the input features whatever block,
    thread or batch the row falls in: bit for bit the same alone, among 15 or 100 rows, and on
    one thread or three."""
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(1000, 200, generator=gen) - 0.5
    b = torch.rand(1000, generator=gen) - 0.5
    x = torch.rand(100, 200, generator=gen) - 0.5
    packed = ops.panel_pack(w)
    full = ops.panel_linear(x, w, packed, b)
    for rows in (1, 2, 15, 40):
        assert torch.equal(ops.panel_linear(x[:rows], w, packed, b), full[:rows]), rows
    assert torch.equal(ops.panel_linear(x[57:58], w, packed, b)[0], full[57])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(ops.panel_linear(x, w, packed, b), full), n
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="panel_pack of|its panel_pack"):
        ops.panel_linear(x, w[:, :100], packed, b)
    with pytest.raises(RuntimeError, match="float32"):
        ops.panel_linear(x.bfloat16(), w, packed, b)


def test_panel_weights_are_packed_at_the_first_batch_and_follow_weight_updates(monkeypatch):
    """Layers on the panel kernel pack their weight at their first call of two or more rows (a
    lone request's one-row steps read the plain weight); an in-place update or a replaced weight
    is packed again before the next use, so tokens keep equal `generate`; without copies
    (`linear_prepack` off) the kernel is not used."""
    model = make_tiny_model("llama")
    prompts = random_prompts(6, 5, 30, seed=12)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    packs = []
    real = ops.panel_pack
    monkeypatch.setattr(ops, "panel_pack", lambda w: packs.append(w) or real(w))
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "panel"}))
    plan = manager.resolved_config.cpu.linear
    assert plan.prepack and "panel weights packed" in plan.summary and set(plan.kernels_at(2).values()) == {"panel"}
    assert not plan.kernels_at(0)
    manager.start()
    try:
        def check():
            assert_equals_generate(manager, model, prompts, 6)

        check()
        down = model.model.layers[0].mlp.down_proj
        assert sum(p is down.weight for p in packs) == 1
        with torch.no_grad():  # in place, as an optimizer step does
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.mul_(torch.linspace(0.5, 1.5, m.weight.shape[1]))
        manager.update_weights()
        check()
        assert sum(p is down.weight for p in packs) == 2
        down.weight = torch.nn.Parameter(down.weight.detach().flip(0))  # a new tensor
        manager.update_weights()
        check()
        assert sum(p is down.weight for p in packs) == 1
    finally:
        manager.stop(timeout=30)
    assert not any("_contbatch_panel" in m.__dict__ for m in model.modules())
    off = ContinuousBatchingManager(model, config=ContinuousBatchingConfig(
        cpu_kernel_overrides={"linear": "panel", "linear_prepack": False})).resolved_config.cpu.linear
    assert not off.routes_anything and "not available" in off.summary


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_native_small_linear_refuses_what_it_cannot_take():
    w = torch.rand(8, 16)
    with pytest.raises(RuntimeError, match="1 to 7 rows"):
        torch.ops.contbatch_cpu.small_linear(torch.rand(8, 16), w, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.contbatch_cpu.small_linear(torch.rand(2, 16), w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.contbatch_cpu.small_linear(torch.rand(2, 16).half(), w.half(), None)


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_linear_runs_the_kernel_its_route_names_for_the_row_count(dtype):
    """A compiled step's linear picks its kernel by the row count at run time: bit for bit the
    kernel the route names for one row, 2-7 rows, 8-256 and more (and aten for none)."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(40, 24, generator=gen) - 0.5).to(dtype)
    b = (torch.rand(40, generator=gen) - 0.5).to(dtype)
    # panel's packed weight is no input of the op: a compiled step's panel linear is aten's
    kernels = {"aten": torch.nn.functional.linear, "small_linear": ops.small_linear, "panel": torch.nn.functional.linear}
    if linear_kernels.onednn_available(dtype):
        kernels["onednn"] = linear_kernels.onednn_linear
    routes = [("small_linear", "small_linear", "aten", "aten"), ("aten", "small_linear", "aten", "aten"),
              ("small_linear", "panel", "panel", "aten")]
    if "onednn" in kernels:
        routes += [("small_linear", "small_linear", "onednn", "aten"), ("onednn", "aten", "onednn", "onednn"),
                   ("aten", "onednn", "small_linear", "onednn"), ("aten", "aten", "panel", "onednn")]
    for route in routes:
        codes = linear_router.routed_codes(route)
        for rows in (0, 1, 2, 7, 8, 33, 256, 257):
            x = (torch.rand(1, rows, 24, generator=gen) - 0.5).to(dtype)
            kernel = linear_router.kernel_at(route, rows)
            if kernel == "small_linear" and rows > ops.SMALL_LINEAR_MAX_ROWS:
                with pytest.raises(RuntimeError, match="1 to 7 rows"):
                    torch.ops.contbatch_cpu.routed_linear(x, w, b, *codes)
                continue
            got = torch.ops.contbatch_cpu.routed_linear(x, w, b, *codes)
            assert got.shape == (1, rows, 40) and torch.equal(got, kernels[kernel](x, w, b)), (route, rows)
    assert linear_router.routed_codes(("upcast",) * 4) is None  # a Python kernel: branches in Python


def test_probe_streams_weights_from_memory():
    """The probe times each kernel over many copies of the weight (as a forward reads it from
    memory), not one hot copy; the pool is as large as the model's linears, within bounds."""
    pool = probe.probe_pool(model_bytes=4 << 20, largest=1000, dtype=torch.float32)
    assert pool.numel == (4 << 20) // 4 and pool.tensor.numel() == pool.numel
    assert probe.probe_pool(1 << 40, 10, torch.float32).numel == probe.stream_bytes() // 4
    assert probe.MIN_STREAM_BYTES <= probe.stream_bytes() <= probe.POOL_BYTES
    assert probe.probe_pool(100, 10_000, torch.bfloat16).tensor.numel() == 10_000
    times = probe.time_kernels(64, 32, 1, pool, ("aten", "onednn"))
    assert set(times) == {"aten", "onednn"} and all(t > 0 for t in times.values())


def test_prompt_chunks_have_a_verdict_of_their_own():
    """Calls of more than PANEL_MAX_ROWS rows (prompt chunks) take a fourth verdict, timed at 512
    rows among the kernels that run there (never `panel` nor `small_linear`), a vocabulary-sized
    weight on its first HOT_OUT output features (compute-bound: the same work per feature)."""
    route = ("small_linear", "panel", "panel", "onednn")
    assert [linear_router.kernel_at(route, rows) for rows in (0, 1, 7, 8, 256, 257, 4096)] == [
        "aten", "small_linear", "panel", "panel", "panel", "onednn", "onednn"]
    assert linear_router.PROBE_ROWS[3] > ops.PANEL_MAX_ROWS
    assert "panel" not in linear_kernels.available_kernels(torch.float32, linear_router.PROBE_ROWS[3])
    assert "small_linear" not in linear_kernels.available_kernels(torch.float32, linear_router.PROBE_ROWS[3])
    if native.load()[0]:
        assert "panel" in linear_kernels.available_kernels(torch.float32, ops.PANEL_MAX_ROWS)
    assert probe.timed_shape(49152, 576, 512) == (probe.HOT_OUT, 576)
    assert probe.timed_shape(49152, 576, 32) == (49152, 576) and probe.timed_shape(1536, 576, 512) == (1536, 576)


@pytest.mark.parametrize("batch_kernel", ["onednn", "panel"])
def test_prompt_chunks_keep_the_batch_kernel_without_a_clear_winner(llama_model, tmp_path, monkeypatch, batch_kernel):
    """At 512 rows a kernel replaces the batch verdict's only where it beats aten by WIN_MARGIN;
    where none does, prompt chunks keep the batch kernel if it runs there (oneDNN), else aten
    (`panel` hands them to aten itself); a clear winner takes them."""
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "store", probe.ProbeStore())
    monkeypatch.setattr(linear_router.ForeignLoad, "cores", lambda self: 0.0)
    clear = {"value": False}

    def fake_times(out_features, in_features, rows, pool, kernels, packs=None):
        if rows == 32:  # the batch verdict: `batch_kernel` by far
            return {k: 1.0 if k == batch_kernel else 3.0 for k in kernels}
        if rows == 512:  # tied, or oneDNN clearly ahead
            return {k: 0.5 if clear["value"] and k == "onednn" else 1.0 for k in kernels}
        return {k: 1.0 for k in kernels}  # aten keeps one and a few rows

    monkeypatch.setattr(probe, "time_kernels", fake_times)
    if batch_kernel == "panel" and "panel" not in linear_kernels.available_kernels(torch.float32, 32):
        pytest.skip("panel does not run here")
    routes = dict(linear_router.plan_linear(llama_model).routes)
    assert routes and all(r[2] == batch_kernel for r in routes.values())
    assert all(r[3] == ("onednn" if batch_kernel == "onednn" else "aten") for r in routes.values())
    clear["value"] = True
    routes = dict(linear_router.plan_linear(llama_model).routes)
    assert routes and all(r[3] == "onednn" for r in routes.values())


def test_probe_verdicts_persist_for_later_starts(llama_model, tmp_path, monkeypatch):
    """The probe's timings are kept in $CONTBATCH_CACHE per machine: a later process routes the
    same way without probing (and so rounds the same way), and its start-up line says where
    the verdicts came from; a damaged file is probed over."""
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(linear_router.ForeignLoad, "cores", lambda self: 0.0)  # a quiet machine, whatever runs

    def new_process() -> probe.ProbeStore:
        store = probe.ProbeStore()
        monkeypatch.setattr(probe, "store", store)
        return store

    store = new_process()
    first = linear_router.plan_linear(llama_model)
    path = store.path
    assert "probed in" in first.summary and path.is_file() and store.probed > 0
    assert str(tmp_path) in str(path)
    store = new_process()

    def no_draw(pool):
        raise AssertionError("a pool was drawn with every verdict in the file")

    with monkeypatch.context() as patch:
        patch.setattr(probe.ProbePool, "draw", no_draw)
        second = linear_router.plan_linear(llama_model)
    assert store.probed == 0 and store.path == path and second.routes == first.routes
    assert f"probe verdicts reused from {path}" in second.summary
    path.write_text("{not json")
    store = new_process()
    third = linear_router.plan_linear(llama_model)
    assert "probed in" in third.summary and store.probed > 0
    assert json.loads(path.read_text())  # written again, whole


def test_probe_timings_taken_under_foreign_load_are_not_saved(llama_model, tmp_path, monkeypatch, caplog):
    """Timings taken while other processes kept the CPUs busy route this process only: the
    start-up line and a warning say so, nothing reaches the file, and the next start probes
    again (and saves, the machine being quiet then). A later quiet window in the same process
    does not carry the loaded window's timings into the file either."""
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))
    store = probe.ProbeStore()
    monkeypatch.setattr(probe, "store", store)
    monkeypatch.setattr(linear_router.ForeignLoad, "cores", lambda self: 1.5)
    with caplog.at_level("WARNING", logger="contbatch"):
        loaded = linear_router.plan_linear(llama_model)
    assert store.probed > 0 and not store.path.exists()
    assert "other processes kept 1.5 CPUs busy (timings not saved" in loaded.summary
    assert any("probed while other processes kept 1.5 CPUs busy" in r.getMessage() for r in caplog.records)
    assert store.save(0.0) and not store.path.exists()  # the loaded window's timings stay in memory only
    monkeypatch.setattr(linear_router.ForeignLoad, "cores", lambda self: 0.0)
    store = probe.ProbeStore()
    monkeypatch.setattr(probe, "store", store)
    quiet = linear_router.plan_linear(llama_model)
    assert store.probed > 0 and "probe verdicts reused" not in quiet.summary and store.path.is_file()
    assert set(json.loads(store.path.read_text())) == set(store.times)


def test_foreign_load_counts_other_processes_only():
    """Our own busy threads are not foreign load; a busy child process is (it is another process
    until waited for, as any neighbour is)."""
    import subprocess
    import sys
    import time

    from contbatch.cpu.load import ForeignLoad
    watch = ForeignLoad()
    if watch.cores() is None:
        pytest.skip("no /proc here")
    end = time.perf_counter() + 0.6
    while time.perf_counter() < end:
        pass
    assert watch.cores() < 0.5  # a busy loop of our own
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"])
    watch = ForeignLoad()
    time.sleep(1.0)
    busy = watch.cores()
    child.wait()
    assert busy > 0.5


@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_bfloat16_model_runs_where_onednn_has_no_bfloat16(kernel, monkeypatch):
    """On an AVX2-only CPU oneDNN's bfloat16 linear raises on every call; a bfloat16 model must
    still run there, on the other kernels, and the plan must say why (here simulated, so the
    test means the same on every machine)."""
    real = linear_kernels.onednn_available
    monkeypatch.setattr(linear_kernels, "onednn_available",
                        lambda dtype=torch.float32: dtype != torch.bfloat16 and real(dtype))

    def refusing(kernel):
        def call(x, weight, bias):
            assert x.dtype != torch.bfloat16, "a bfloat16 product reached oneDNN"
            return kernel(x, weight, bias)
        return call

    monkeypatch.setattr(linear_kernels, "onednn_linear", refusing(linear_kernels.onednn_linear))
    monkeypatch.setattr(linear_kernels, "packed_linear", refusing(linear_kernels.packed_linear))
    model = make_tiny_model("llama").to(torch.bfloat16)
    prompts = random_prompts(4, 3, 30, seed=2)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=64, cpu_kernel_overrides={"linear": kernel})
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, config)
    plan = manager.resolved_config.cpu.linear
    assert "oneDNN's linear does not run in bfloat16 here" in plan.summary
    assert "onednn" not in {k for _, route in plan.routes for k in route}
    manager.start()
    try:
        results = [manager.get_result(manager.add_request(p), timeout=120) for p in prompts]
    finally:
        manager.stop()
    assert all(len(r.generated_tokens) == 6 and r.error is None for r in results)


def test_onednn_availability_is_tried_per_dtype():
    """The check runs a product at that dtype: a float32-only answer must not route bfloat16."""
    assert linear_kernels.onednn_available(torch.float32)
    x, w = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(8, 16, dtype=torch.bfloat16)
    try:
        linear_kernels.onednn_linear(x, w, None)
        runs = True
    except RuntimeError:
        runs = False
    assert linear_kernels.onednn_available(torch.bfloat16) == runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_upcast_linear_is_the_float32_product_rounded_once(rows, dtype, monkeypatch):
    """16-bit inputs, float32 products: equal to the float32 linear rounded to the dtype, also
    when the weight is converted a slice at a time (a tiny slice forces several, and a tail)."""
    gen = torch.Generator().manual_seed(rows)
    w = (torch.rand(50, 24, generator=gen) - 0.5).to(dtype)
    x = (torch.rand(rows, 24, generator=gen) - 0.5).to(dtype)
    b = (torch.rand(50, generator=gen) - 0.5).to(dtype)
    for bias in (None, b):
        want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
        whole = linear_kernels.upcast_linear(x[None], w, bias)
        monkeypatch.setattr(linear_kernels, "UPCAST_SLICE", 24 * 16)  # slices of 16 output features
        sliced = linear_kernels.upcast_linear(x[None], w, bias)
        monkeypatch.undo()
        assert whole.shape == sliced.shape == (1, rows, 50) and whole.dtype == dtype
        torch.testing.assert_close(whole[0], want, atol=0, rtol=0)
        torch.testing.assert_close(sliced[0], want, atol=0, rtol=0)
