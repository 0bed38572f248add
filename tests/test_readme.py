"""Every Python code block of the README runs, in order, in one namespace: users copy them first.

The server example talks to `http://127.0.0.1:8000/v1`; the test serves the default model on a
free loopback port and points the block there (its only edit), so a busy port 8000 on the
machine cannot fail it.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://127.0.0.1:8000/v1"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 3, "the README's examples moved: update this test"
    assert any(README_URL in block for block in blocks)


def _serve(model, tokenizer):
    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
    from contbatch.models import DEFAULT_MODEL_NAME
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


def test_readme_python_blocks_run(capsys):
    namespace: dict = {"__name__": "__readme__"}
    served = None
    try:
        for i, block in enumerate(python_blocks()):
            if README_URL in block:
                if served is None:
                    served = _serve(namespace["model"], namespace["tokenizer"])
                block = block.replace(README_URL, served[0])
            try:
                exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"README python block {i + 1} failed: {exc!r}\n{block}")
    finally:
        if served is not None:
            served[1].should_exit = True
            served[2].join(30)
    # The examples did what they say, not just ran.
    results = namespace["results"]
    assert set(results) == {"req_0"} | ({"req_1"} if len(namespace["prompts"]) > 1 else set())
    assert all(out.is_finished and out.generated_tokens for out in results.values())
    assert namespace["chat"].choices[0].message.content
