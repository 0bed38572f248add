"""LoRA adapters over HTTP: the adapter is chosen by `model`, `/v1/models` lists the base and
each adapter, admin routes load and unload adapters at run time (behind the key, under
--weights-dir), and an unknown adapter is a 404 `model_not_found` in the OpenAI format."""

from __future__ import annotations

import httpx
import pytest

from contbatch import load_model
from conftest import reference_generate
from lora_adapters import merged, write_adapter
from test_server import MODEL, start_server

MAX_NEW = 8


@pytest.fixture(scope="module")
def srv(tiny_dir, tmp_path_factory):  # noqa: F811
    weights = tmp_path_factory.mktemp("adapters")
    model, tok = load_model(tiny_dir)
    write_adapter(model, str(weights / "ad1"), rank=8, alpha=16, seed=1, std=0.3)
    (weights / "empty").mkdir()
    server = start_server(tiny_dir, api_keys=("k",), weights_dir=str(weights))
    server.auth = {"Authorization": "Bearer k"}
    server.weights = weights
    server.base_model, server.tok = model, tok
    yield server
    server.stop()


def _post(srv, path, **kw):
    return httpx.post(srv.url + path, headers=srv.auth, timeout=60, **kw)


def _complete(srv, model, prompt):
    return _post(srv, "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                                                "temperature": 0, "ignore_eos": True})


def test_adapter_lifecycle_over_http(srv):
    assert httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "ad1"}).status_code == 401
    for body, status in (({"lora_name": "ad1", "lora_path": "../x"}, 400), ({"lora_name": "ad1", "lora_path": "empty"}, 400),
                         ({"lora_name": MODEL, "lora_path": "ad1"}, 400), ({"lora_name": "ad1"}, 400)):
        resp = _post(srv, "/v1/load_lora_adapter", json=body)
        assert resp.status_code == status, (body, resp.text)
        assert resp.json()["error"]["message"]
    missing = _complete(srv, "ad1", [5, 6, 7])
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    assert _post(srv, "/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "ad1"}).status_code == 200
    models = httpx.get(srv.url + "/v1/models", headers=srv.auth).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "ad1"] and models[1]["parent"] == MODEL
    assert httpx.get(srv.url + "/v1/models/ad1", headers=srv.auth).json()["id"] == "ad1"

    prompt = srv.tok.encode("The quick brown fox")
    ref = merged(srv.base_model, str(srv.weights / "ad1"))
    want = srv.tok.decode(reference_generate(ref, prompt, MAX_NEW))
    base = srv.tok.decode(reference_generate(srv.base_model, prompt, MAX_NEW))
    assert want != base  # the adapter changes the output: the routing below is checked
    got = _complete(srv, "ad1", prompt).json()
    assert got["choices"][0]["text"] == want and got["model"] == "ad1"
    assert _complete(srv, MODEL, prompt).json()["choices"][0]["text"] == base
    constrained = _post(srv, "/v1/completions", json={"model": "ad1", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      "structured_outputs": {"choice": ["yes", "no"]}})
    assert constrained.json()["choices"][0]["text"] in ("yes", "no")  # structured output on an adapter's rows
    responses = _post(srv, "/v1/responses", json={"model": "ad1", "input": "Hi", "max_output_tokens": 4})
    assert responses.status_code == 404 and responses.json()["error"]["code"] == "model_not_found"

    assert _post(srv, "/v1/unload_lora_adapter", json={"lora_name": "ad1"}).status_code == 200
    gone = _post(srv, "/v1/unload_lora_adapter", json={"lora_name": "ad1"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert _complete(srv, "ad1", prompt).status_code == 404
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models", headers=srv.auth).json()["data"]] == [MODEL]
