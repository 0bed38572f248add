"""Admin routes for RL loops: pause, resume, prefix-cache reset, weights from --weights-dir."""

from __future__ import annotations

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
    for body, status in (({"path": "../outside.safetensors"}, 403), ({"path": "/etc/passwd"}, 403),
                         ({"path": "missing.safetensors"}, 404), ({"path": "bad.safetensors"}, 400),
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
