"""LoRA adapters and engine state: the prefix cache keeps adapters apart, weights swap in
place, adapters unload and reload, and more adapters than `max_loras` are swapped in and out
least recently used first; every output checked against PEFT's merged reference
(tests/lora_adapters.py)."""

from __future__ import annotations

import pytest
import torch

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.lora.peft_files import LoraWeights
from contbatch.lora.registry import AdapterRegistry
from conftest import make_tiny_model, random_prompts
from lora_adapters import ATTENTION, expected, references, write_adapters

MAX_NEW = 6


@pytest.fixture(scope="module")
def base():
    return make_tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory):
    specs = {name: dict(rank=r, alpha=2 * r, seed=seed, targets=ATTENTION)
             for name, r, seed in (("a", 8, 1), ("b", 8, 2), ("c", 4, 3), ("a2", 8, 4))}
    return write_adapters(base, tmp_path_factory.mktemp("lora-cache"), specs)


@pytest.fixture(scope="module")
def refs(base, paths):
    return references(base, paths)


@pytest.fixture
def manager(base):
    m = ContinuousBatchingManager(base, config=ContinuousBatchingConfig(block_size=4, max_loras=2))
    m.start()
    yield m
    m.stop()
    m.destroy()


def _ref(refs, prompt, adapter):
    return expected(refs, [prompt], [adapter], MAX_NEW)[0]


def _one(manager, prompt, adapter):
    rid = manager.add_request(prompt, max_new_tokens=MAX_NEW, adapter=adapter)
    out = manager.get_result(rid, timeout=120)
    assert out.error is None, out.error
    return out


def test_two_adapters_never_share_prefix_blocks(refs, paths, manager):
    prompt = random_prompts(1, 17, 17, seed=7)[0]  # four full blocks
    manager.load_adapter("a", paths["a"])
    manager.load_adapter("b", paths["b"])
    first = _one(manager, prompt, "a")
    other = _one(manager, prompt, "b")
    plain = _one(manager, prompt, None)
    again = _one(manager, prompt, "a")
    assert (other.cached_tokens, plain.cached_tokens) == (0, 0)  # same tokens, other weights: no reuse
    assert again.cached_tokens >= 16  # the same adapter reuses its own blocks
    assert first.generated_tokens == again.generated_tokens == _ref(refs, prompt, "a")
    assert other.generated_tokens == _ref(refs, prompt, "b")
    assert plain.generated_tokens == _ref(refs, prompt, None)


def test_update_adapter_weights_in_place(refs, paths, manager):
    from safetensors.torch import load_file

    prompt = random_prompts(1, 13, 13, seed=8)[0]
    manager.load_adapter("a", paths["a"])
    manager.load_adapter("b", paths["b"])
    before = _one(manager, prompt, "a")
    new = load_file(f"{paths['a2']}/adapter_model.safetensors")  # same shapes, other values
    assert manager.update_adapter_weights("a", new) == 1
    after = _one(manager, prompt, "a")
    assert after.cached_tokens == 0  # blocks of the old weights are not reused
    assert before.generated_tokens == _ref(refs, prompt, "a")
    assert after.generated_tokens == _ref(refs, prompt, "a2")
    assert _one(manager, prompt, "b").generated_tokens == _ref(refs, prompt, "b")
    assert _one(manager, prompt, None).generated_tokens == _ref(refs, prompt, None)
    with pytest.raises(ValueError, match="shape"):
        manager.update_adapter_weights("a", {k: v[:, :1] for k, v in new.items()})
    with pytest.raises(ValueError, match="not a LoRA weight"):
        manager.update_adapter_weights("a", {"model.layers.0.mlp.up_proj.weight": torch.zeros(1)})


def test_unload_and_reload(refs, paths, manager):
    prompt = random_prompts(1, 10, 10, seed=9)[0]
    manager.load_adapter("a", paths["a"])
    assert _one(manager, prompt, "a").generated_tokens == _ref(refs, prompt, "a")
    manager.unload_adapter("a")
    assert manager.list_adapters() == {}
    with pytest.raises(KeyError, match="not loaded"):
        manager.add_request(prompt, max_new_tokens=MAX_NEW, adapter="a")
    manager.load_adapter("a", paths["c"])  # the name again, other weights
    out = _one(manager, prompt, "a")
    assert out.generated_tokens == _ref(refs, prompt, "c")
    with pytest.raises(ValueError, match="already loaded"):
        manager.load_adapter("a", paths["a"])


def test_more_adapters_than_slots_swap_lru(refs, paths, manager):
    """max_loras=2 with three adapters in one batch: the third waits for a slot, parks the
    least recently used idle adapter, and every row is still exact."""
    for name in ("a", "b", "c"):
        manager.load_adapter(name, paths[name])
    prompts = random_prompts(6, 6, 14, seed=10)
    names = ["a", "b", "c", None, "c", "a"]
    ids = manager.add_requests(prompts, max_new_tokens=MAX_NEW, adapters=names)
    outs = [manager.get_result(rid, timeout=120) for rid in ids]
    assert [o.generated_tokens for o in outs] == expected(refs, prompts, names, MAX_NEW)
    stats = manager.stats()
    assert stats["lora_evictions"] >= 1 and stats["lora_resident"] <= 2 and stats["lora_waiting"] == 0
    assert sum(a["resident"] for a in manager.list_adapters().values()) <= 2


def test_bad_adapters_are_clear_errors(base, paths, manager, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        manager.load_adapter("x", str(tmp_path))
    with pytest.raises(ValueError, match="max_lora_rank"):
        small = ContinuousBatchingManager(base, config=ContinuousBatchingConfig(block_size=4, max_lora_rank=4))
        small.load_adapter("x", paths["a"])
    with pytest.raises(ValueError, match="adapter name"):
        manager.load_adapter("bad name!", paths["a"])
    with pytest.raises(KeyError):
        manager.add_requests([[5, 6, 7]], adapters=["nope"])
    with pytest.raises(ValueError, match="adapters for"):
        manager.add_requests([[5, 6, 7]], adapters=[None, None])
    with pytest.raises(ValueError, match="max_loras"):
        ContinuousBatchingConfig(max_loras=0)


def _weights(rank: int) -> LoraWeights:
    return LoraWeights(rank, 1.0, {"m": (torch.ones(rank, 2), torch.ones(3, rank))})


def test_registry_lru_bookkeeping():
    reg = AdapterRegistry(max_loras=2, max_lora_rank=8, device=torch.device("cpu"))
    for name in "xyz":
        reg.register(name, name, _weights(4))
    assert reg.resident() == []  # registered adapters are parked until a request needs them
    sx, sy = reg.acquire("x"), reg.acquire("y")
    assert {sx, sy} == {0, 1}
    assert reg.acquire("z") is None  # both slots held by running requests: z waits
    reg.release("x")
    assert reg.acquire("z") == sx and reg.adapters["x"].slot == -1 and reg.evictions == 1
    reg.release("y")
    reg.release("z")
    reg.acquire("z")  # z is now the most recently used: y goes first
    reg.release("z")
    assert reg.acquire("x") == sy and reg.adapters["y"].slot == -1
    with pytest.raises(RuntimeError, match="running requests"):
        reg.remove("x")
    with pytest.raises(ValueError, match="max_lora_rank"):
        reg.register("big", "big", _weights(16))


@pytest.mark.parametrize("slots", [
    [0, 0, 0, 0],  # one adapter, every row: no filler needed
    [2, -1, 0, 2, 0, 2],  # two groups of 2 and 3, a base row
    [1, 1, -1, 3, 3],  # groups of equal size and a base row: a filler entry is added for it
    [5],
    [4] * 10 + [-1, 1, 2],  # a prompt chunk beside two decode rows: padding would triple the rows
    [0, 0, 1] + [3] * 9,  # the same with no base row
])
@pytest.mark.parametrize("padding", [0, 3])
def test_lora_groups_gather_back_to_their_rows(slots, padding):
    """The step's grouping (lora/segments.py) against a loop: every adapter row sits in its
    slot's group and `inverse` finds it there; rows of no adapter (and the step's padding rows)
    read a filler or the zero entry; groups padded to the largest unless that would more than
    double the rows (then segmented); the products equal a per-row computation."""
    from contbatch.lora.segments import group_rows, lora_products
    import numpy as np

    token_slots = np.array(slots, np.int64)
    n = len(slots) + padding
    step = group_rows(token_slots, n, torch.device("cpu"))
    used = [s for s in slots if s >= 0]
    groups = len(set(used))
    assert step.slots == tuple(sorted(set(used)))
    sizes = [used.count(s) for s in step.slots]
    assert (step.bounds is not None) == (groups * max(sizes) > 2 * len(used))
    rows, inverse = step.rows.tolist(), step.inverse.tolist()
    if step.bounds is None:
        flat_drop = [d for g in step.drop.view(groups, -1).tolist() for d in g]
        group_of = [e // (len(rows) // groups) for e in range(len(rows))]
    else:
        assert step.drop is None and len(rows) == len(used) and step.bounds[-1] == len(used)
        flat_drop = [False] * len(rows) + [True]  # entry len(rows): the zero one
        group_of = [g for g in range(groups) for _ in range(step.bounds[g], step.bounds[g + 1])]
        assert [step.bounds[g + 1] - step.bounds[g] for g in range(groups)] == sizes
    for r in range(n):
        entry = inverse[r]
        if r < len(slots) and slots[r] >= 0:
            assert rows[entry] == r and not flat_drop[entry]
            assert step.slots[group_of[entry]] == slots[r]
        else:
            assert flat_drop[entry]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=generator)
    a = torch.randn(groups, 2, 6, generator=generator)
    bt = torch.randn(groups, 2, 5, generator=generator)
    base = torch.randn(n, 5, generator=generator)
    got = base + lora_products(x, a, bt, step)
    want = base.clone()
    for r, s in enumerate(slots):
        if s >= 0:
            g = step.slots.index(s)
            want[r] += (x[r] @ a[g].T) @ bt[g]
    torch.testing.assert_close(got, want)
