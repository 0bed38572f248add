"""Every Python code block of the README runs, in order, in one namespace: users copy them first.

The server example talks to `http://127.0.0.1:8000/v1`; the test serves the default model on a
free loopback port and points the block there (its only edit), so a busy port 8000 on the
machine cannot fail it. The LoRA-over-HTTP block starts its own server on `port = 8001`; the
test gives it a free port instead (that block's only edit).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://127.0.0.1:8000/v1"
README_PORT = "port = 8001"  # the block that starts its own server


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 3, "the README's examples moved: update this test"
    assert any(README_URL in block for block in blocks)
    assert sum(README_PORT in block for block in blocks) == 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(model, tokenizer):
    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
    from contbatch.setup.loading import DEFAULT_MODEL_NAME
    from contbatch.server.app import build_app
    from contbatch.server.draining import DrainingServer
    from contbatch.server.settings import ServerSettings

    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(block_size=64), tokenizer=tokenizer)
    app = build_app(manager, tokenizer, ServerSettings(served_model_names=(DEFAULT_MODEL_NAME,)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="on"), app.state.server_state, 5.0,
                            manager)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server, thread


def _check_entry_points(ns: dict, printed: str) -> None:
    """Block 1: results keyed in input order; the stream's tokens are the blocking call's; the
    long-lived manager was configured as asked and is stopped."""
    results, tok = ns["results"], ns["tokenizer"]
    assert list(results) == ["req_0", "req_1"] and all(o.is_finished for o in results.values())
    assert "Paris" in tok.decode(results["req_0"].generated_tokens)  # greedy: the same answer every run
    streamed = [int(t) for t in re.findall(r"^\[(\d+)\]$", printed, flags=re.M)]
    assert streamed[:-1] == results["req_0"].generated_tokens[: len(streamed) - 1]  # chunks, then the final
    assert "GenerationOutput(" in printed and "block_size=64" in printed
    assert ns["manager"].resolved_config.block_size == 64 and not ns["manager"].is_running()


def _check_sampling(ns: dict, printed: str) -> None:
    out = ns["out"]
    assert len(out.samples) == 4
    for sample in out.samples:
        assert len(sample.logprobs) == len(sample.generated_tokens) > 0
        assert all(lp <= 0 for lp in sample.logprobs)
        assert all(0 < len(top) <= 5 for top in sample.top_logprobs)
        assert "\n\n" not in sample.text and len(sample.generated_tokens) <= 64


def _check_structured(ns: dict, printed: str) -> None:
    value = json.loads(ns["out"].text)
    assert ns["out"].finish_reason == "stop" and set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and type(value["population"]) is int and 0 <= value["population"] <= 10**8
    assert ns["out"].text in printed


def _check_speculative(ns: dict, printed: str) -> None:
    out = ns["out"]
    assert 0 < out.spec_accepted_tokens <= out.spec_draft_tokens
    assert f"({out.spec_accepted_tokens} of {out.spec_draft_tokens} proposed tokens accepted)" in printed


def _check_rl(ns: dict, printed: str) -> None:
    group, manager = ns["group"], ns["manager"]
    assert len(group) == 4 and all(len(s.logprobs) == 8 and all(lp <= 0 for lp in s.logprobs) for s in group)
    assert manager.weight_version == 2 and printed.strip().endswith("2") and not manager.is_running()


def _check_lora(ns: dict, printed: str) -> None:
    """The adapter row's tokens are PEFT's merge of the adapter (run with generate), the other row the base's."""
    from lora_adapters import merged
    from conftest import reference_generate

    base, results = ns["base"], ns["results"]
    plain, adapted = (r.generated_tokens for r in results.values())
    assert plain == reference_generate(base, [5, 6, 7], 8)
    assert adapted == reference_generate(merged(base, ns["adapter_dir"]), [5, 6, 7], 8) != plain
    assert str([plain, adapted]) in printed


def _check_lora_http(ns: dict, printed: str) -> None:
    """/v1/models lists the base and the adapter; each one's greedy text is `generate`'s on the
    base and on PEFT's merge of the adapter; the two differ; the server drained and exited 0."""
    from lora_adapters import merged
    from conftest import reference_generate

    smol, tok, texts = ns["smol"], ns["tokenizer"], ns["texts"]
    assert ns["served_models"] == ["SmolLM2-135M-Instruct", "mine"] and list(texts) == ns["served_models"]
    ids = tok.encode("The capital of France is")
    for name, model in (("SmolLM2-135M-Instruct", smol), ("mine", merged(smol, ns["smol_adapter"]))):
        want = reference_generate(model, ids, 8, eos_token_id=tok.eos_token_id)
        assert texts[name] == tok.decode(want, skip_special_tokens=True), name
        assert f"{name} {texts[name]!r}" in printed
    assert texts["mine"] != texts["SmolLM2-135M-Instruct"]
    assert ns["server"].returncode == 0


def _check_server(ns: dict, printed: str) -> None:
    choice = ns["chat"].choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert ns["chat"].model == "SmolLM2-135M-Instruct" and 0 < ns["chat"].usage.completion_tokens <= 32


def _check_tools(ns: dict, printed: str) -> None:
    chat, call, answer = ns["chat"], ns["call"], ns["answer"]
    assert chat.choices[0].finish_reason == "tool_calls" and chat.choices[0].message.content is None
    arguments = json.loads(call.function.arguments)  # always valid JSON for the function's schema
    assert call.function.name == "get_weather" and set(arguments) == {"city"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 40
    assert f"get_weather {arguments}" in printed
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and its result are in the second request's context.
    assert answer.usage.prompt_tokens > chat.usage.prompt_tokens + chat.usage.completion_tokens


def _check_responses(ns: dict, printed: str) -> None:
    client, first, then, parsed = ns["client"], ns["first"], ns["then"], ns["parsed"]
    assert first.status == "completed" and first.output_text
    assert then.previous_response_id == first.id
    assert then.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the stored turn
    assert client.responses.retrieve(then.id).output_text == then.output_text
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, ns["City"])
    same = client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.", max_output_tokens=16,
                                   temperature=0)  # greedy: the stream printed the same text
    assert same.output_text and same.output_text in printed


# What each block promises, in the README's order (a block added there needs its check here).
CHECKS = [_check_entry_points, _check_sampling, _check_structured, _check_speculative, _check_rl, _check_lora,
          _check_lora_http, _check_server, _check_tools, _check_responses]


def test_readme_python_blocks_run(capsys):
    blocks = python_blocks()
    assert len(blocks) == len(CHECKS), "the README's examples changed: give each block its check"
    namespace: dict = {"__name__": "__readme__"}
    served = None
    try:
        for i, (block, check) in enumerate(zip(blocks, CHECKS)):
            if README_URL in block:
                if served is None:
                    served = _serve(namespace["model"], namespace["tokenizer"])
                block = block.replace(README_URL, served[0])
            if README_PORT in block:
                block = block.replace(README_PORT, f"port = {_free_port()}")
            capsys.readouterr()
            try:
                exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"README python block {i + 1} failed: {exc!r}\n{block}")
            check(namespace, capsys.readouterr().out)
    finally:
        if served is not None:
            served[1].should_exit = True
            served[2].join(30)
