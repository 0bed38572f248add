"""The strict capture stand-in (tests/capture_guard.py) itself: each forbidden call raises
inside a captured region, works outside it and on other threads, and everything is restored."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from capture_guard import HostSyncInCapture, captured_region, forbid_host_syncs, guarded_capture, suspended
from contbatch.runtime.graphs import GraphCache

x = torch.arange(4.0)
meta = torch.empty(4, device="meta")
FORBIDDEN = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x.tolist(),
    "int": lambda: int(x[0]),
    "float": lambda: float(x[1]),
    "bool": lambda: bool(x.any()),
    "index": lambda: [0, 1, 2][x.long()[1]],
    "nonzero": lambda: x.nonzero(),
    "torch.nonzero": lambda: torch.nonzero(x),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "mask": lambda: x[x > 1],
    "mask in tuple": lambda: x.view(2, 2)[x[:2] > 0, 0],
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "torch.as_tensor": lambda: torch.as_tensor([1, 2]),
    "from_numpy": lambda: torch.from_numpy(np.zeros(2)),
    "to cpu": lambda: x.to("cpu"),
    "to cpu kw": lambda: x.to(device="cpu", dtype=torch.float64),
    "to device": lambda: x.to("meta"),
    "copy_ to device": lambda: meta.copy_(x),
}
if hasattr(torch.cuda, "synchronize"):
    FORBIDDEN["cuda.synchronize"] = lambda: torch.cuda.synchronize()
    FORBIDDEN["Event.synchronize"] = lambda: torch.cuda.Event.synchronize(object())
    FORBIDDEN["Stream.synchronize"] = lambda: torch.cuda.Stream.synchronize(object())
ALLOWED_OUTSIDE = [k for k in FORBIDDEN if not k.endswith("synchronize")]  # those need a GPU to run


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_each_forbidden_call_raises_inside_a_captured_region(name):
    with forbid_host_syncs(), captured_region(), pytest.raises(HostSyncInCapture):
        FORBIDDEN[name]()


@pytest.mark.parametrize("name", ALLOWED_OUTSIDE)
def test_each_call_works_outside_a_region_and_on_other_threads(name):
    with forbid_host_syncs():
        FORBIDDEN[name]()  # guard installed, no region: allowed
        with captured_region(), suspended():
            FORBIDDEN[name]()  # instrumentation lifted explicitly
        errors = []
        with captured_region():  # this thread is capturing; another one is not
            t = threading.Thread(target=lambda: errors.append(FORBIDDEN[name]()))
            t.start()
            t.join()
        assert len(errors) == 1


def test_what_a_graph_may_do_stays_allowed():
    """Device-side work on tensors: arithmetic, integer/slice indexing, casts, copies between
    device tensors, `.to(dtype)`."""
    out = torch.zeros(4)
    with forbid_host_syncs(), captured_region():
        y = (x * 2)[1:3].to(torch.float64).to(device=x.device)
        out.copy_(x + 1)
        z = x[x.long()[:2]]
        w = torch.where(x > 1, x, torch.zeros_like(x))
    assert y.tolist() == [2.0, 4.0] and out.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert z.tolist() == [0.0, 1.0] and w.tolist() == [0.0, 0.0, 2.0, 3.0]


def test_guard_is_removed_afterwards():
    before = (torch.Tensor.item, torch.tensor, torch.Tensor.__getitem__, torch.Tensor.to)
    with forbid_host_syncs():
        assert torch.tensor is not before[1]
    assert (torch.Tensor.item, torch.tensor, torch.Tensor.__getitem__, torch.Tensor.to) == before
    with captured_region():
        assert x.sum().item() == 6.0  # region without the guard: nothing is patched


def test_graph_cache_with_guarded_capture():
    """Capture and every replay run guarded; the replay's copy into the output is not."""
    with forbid_host_syncs():
        cache = GraphCache(2, guarded_capture)
        cache.add("clean", lambda: x * 2)
        assert cache.replay("clean").tolist() == [0.0, 2.0, 4.0, 6.0]
        for name in ("item", "mask", "torch.tensor", "cpu"):
            with pytest.raises(HostSyncInCapture):
                cache.add(name, lambda name=name: x * 0 + FORBIDDEN[name]().sum())
        calls = {"n": 0}

        def syncs_on_replay():  # a capture that passes once and reads the host later
            calls["n"] += 1
            return x * (1 if calls["n"] == 1 else x.sum().item())

        cache.add("late", syncs_on_replay)
        with pytest.raises(HostSyncInCapture):
            cache.replay("late")
