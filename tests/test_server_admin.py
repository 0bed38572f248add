"""Admin routes for RL loops: pause, resume, prefix-cache reset, weights from --weights-dir."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save_file

from contbatch import load_model

from test_server import GREEDY, MODEL, reference_texts, start_server

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def admin(tiny_dir, tmp_path_factory):  # noqa: F811
    weights = tmp_path_factory.mktemp("weights")
    (weights.parent / "outside.safetensors").write_bytes(b"")
    srv = start_server(tiny_dir, api_keys=("k",), weights_dir=str(weights))
    srv.auth = {"Authorization": "Bearer k"}
    srv.weights = weights
    srv.model_dir = tiny_dir
    yield srv
    srv.stop()


def _post(srv, path, **kw):
    return httpx.post(srv.url + path, headers=srv.auth, timeout=60, **kw)


def test_admin_routes_need_the_key_and_pause_resume(admin):
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/update_weights_from_disk"):
        assert httpx.post(admin.url + path).status_code == 401
    assert _post(admin, "/pause").json() == {"paused": True, "weight_version": 0}
    assert _post(admin, "/pause").json()["paused"] is True  # idempotent
    assert admin.manager.is_paused()
    assert _post(admin, "/resume").json() == {"paused": False, "weight_version": 0}
    assert "freed_blocks" in _post(admin, "/reset_prefix_cache").json()


def test_update_weights_from_disk(admin, tiny_dir):  # noqa: F811
    model, tok = load_model(tiny_dir)
    new = torch.randn_like(model.state_dict()[NAME]) * 0.5
    save_file({NAME: new}, str(admin.weights / "step1.safetensors"))
    save_file({NAME: new[:-1].contiguous()}, str(admin.weights / "bad.safetensors"))
    for body, status in (({"path": "../outside.safetensors"}, 400), ({"path": "/etc/passwd"}, 400),
                         ({"path": "missing.safetensors"}, 400), ({"path": "bad.safetensors"}, 400),
                         ({"path": "step1.safetensors", "inflight": "later"}, 400), ({"no": "path"}, 400)):
        resp = _post(admin, "/update_weights_from_disk", json=body)
        assert resp.status_code == status, (body, resp.text)
        assert resp.json()["error"]["message"]
    assert admin.manager.weight_version == 0  # nothing was copied by the refused ones

    prompt = tok.encode("The quick brown fox")
    client = admin.client(api_key="k")
    before = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True},
                                       **GREEDY).choices[0].text
    resp = _post(admin, "/update_weights_from_disk", json={"path": "step1.safetensors"}).json()
    assert resp["weight_version"] == 1 and resp["tensors"] == 1 and resp["paused"] is False
    after = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True},
                                      **GREEDY).choices[0].text
    with torch.no_grad():
        model.state_dict()[NAME].copy_(new)
    assert after == reference_texts((model, tok), [prompt], 8)[0] != before


# -- admin operations one at a time ------------------------------------------------------
def _slow_copy(monkeypatch, seconds: float) -> threading.Event:
    """Copying weights takes `seconds` (set when it starts): room for another call to race it."""
    import contbatch.engine.weights as weights

    started = threading.Event()
    real = weights.copy_weights

    def slow(pairs):
        started.set()
        time.sleep(seconds)
        real(pairs)

    for module in (weights, __import__("contbatch.engine.control", fromlist=["x"])):
        monkeypatch.setattr(module, "copy_weights", slow, raising=False)
    return started


def test_pause_sent_during_an_update_is_kept(admin, monkeypatch):
    """A pause that arrives while weights are being copied stays in force after the copy:
    the update never restores a pause state it saw before the other call."""
    model, _ = load_model(admin.model_dir)
    save_file({NAME: model.state_dict()[NAME].clone()}, str(admin.weights / "same.safetensors"))
    started = _slow_copy(monkeypatch, 0.8)
    with ThreadPoolExecutor(2) as pool:
        update = pool.submit(_post, admin, "/update_weights_from_disk", json={"path": "same.safetensors"})
        assert started.wait(30)
        paused = pool.submit(_post, admin, "/pause")
        assert update.result().status_code == 200
        assert paused.result().status_code == 200 and paused.result().json()["paused"] is True
    try:
        assert admin.manager.is_paused(), "the update undid a pause sent while it ran"
    finally:
        assert _post(admin, "/resume").json()["paused"] is False


def test_resume_sent_during_an_update_does_not_run_steps_on_partial_weights(admin, monkeypatch):
    """While the weights are copied no step runs, whatever another caller asks meanwhile."""
    model, tok = load_model(admin.model_dir)
    save_file({NAME: model.state_dict()[NAME].clone()}, str(admin.weights / "same.safetensors"))
    started = _slow_copy(monkeypatch, 0.8)
    steps_during_copy = []
    copying = threading.Event()
    real_step = admin.manager.core.step

    def step():
        if copying.is_set():
            steps_during_copy.append(time.monotonic())
        return real_step()

    monkeypatch.setattr(admin.manager.core, "step", step)
    client = admin.client(api_key="k")
    with ThreadPoolExecutor(3) as pool:
        stream = pool.submit(lambda: list(client.completions.create(
            model=MODEL, prompt=tok.encode("Once upon a time"), max_tokens=200, stream=True,
            extra_body={"ignore_eos": True}, **GREEDY)))
        time.sleep(0.3)
        update = pool.submit(_post, admin, "/update_weights_from_disk", json={"path": "same.safetensors"})
        assert started.wait(30)
        copying.set()
        resumed = pool.submit(_post, admin, "/resume")
        time.sleep(0.5)
        copying.clear()
        assert update.result().status_code == 200 and resumed.result().status_code == 200
        assert len(stream.result()) > 1
    assert steps_during_copy == [], f"{len(steps_during_copy)} steps ran while the weights were being copied"


# -- bad weights files: 400s in OpenAI's shape, old weights still serving -------------------
def _bad_files(weights) -> dict[str, object]:
    """name -> request path (a str, or a callable making it in `weights`)."""
    good = {NAME: torch.zeros(4)}
    header = b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    (weights / "empty.safetensors").write_bytes(b"")
    (weights / "garbage.safetensors").write_bytes(b"\x00\xffnot a safetensors file" * 50)
    save_file(good, str(weights / "whole.safetensors"))
    data = (weights / "whole.safetensors").read_bytes()
    (weights / "truncated.safetensors").write_bytes(data[: len(data) - 7])
    (weights / "header.safetensors").write_bytes(len(header).to_bytes(8, "little") + header[:-5] + b"\xff" * 20)
    (weights / "huge_header.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    save_file({NAME: torch.zeros(3, 3, dtype=torch.int32)}, str(weights / "wrong_dtype.safetensors"))
    save_file({"no.such.weight": torch.zeros(4)}, str(weights / "wrong_name.safetensors"))
    (weights / "folder.safetensors").mkdir(exist_ok=True)
    loop = weights / "loop.safetensors"
    if not loop.is_symlink():
        os.symlink(weights / "loop2.safetensors", loop)
        os.symlink(loop, weights / "loop2.safetensors")
    return {
        "missing": "missing.safetensors", "empty": "empty.safetensors", "garbage": "garbage.safetensors",
        "truncated": "truncated.safetensors", "corrupt header": "header.safetensors",
        "huge header": "huge_header.safetensors", "wrong dtype": "wrong_dtype.safetensors",
        "wrong name": "wrong_name.safetensors", "directory": "folder.safetensors",
        "symlink loop": "loop.safetensors", "nul byte": "a\x00b.safetensors",
        "long name": "x" * 300 + ".safetensors", "long path": "/".join(["d" * 200] * 30) + ".safetensors",
        "lone surrogate": "\ud800.safetensors", "outside": "../outside.safetensors", "absolute": "/etc/passwd",
        "not safetensors": "whole.bin", "not a string": 7,
    }


def test_every_bad_weights_file_is_a_400_and_changes_nothing(admin):
    version = admin.manager.weight_version
    for name, path in _bad_files(admin.weights).items():
        body = json.dumps({"path": path}, ensure_ascii=True)  # a lone surrogate travels as \ud800
        resp = httpx.post(admin.url + "/update_weights_from_disk", content=body,
                          headers={**admin.auth, "Content-Type": "application/json"}, timeout=60)
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (name, error)
    assert admin.manager.weight_version == version
    deep = "[" * 50_000 + "]" * 50_000
    resp = httpx.post(admin.url + "/update_weights_from_disk", content=deep,
                      headers={**admin.auth, "Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["message"], resp.text
    client = admin.client(api_key="k")
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **GREEDY).choices[0].text
