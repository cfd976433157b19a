"""Fixtures for the server tests: the OpenAI server on the reference model, in this process on 127.0.0.1 at a
free port (uvicorn in a thread), with the offline results the server must reproduce."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from deepinfer_npu.config import REFERENCE_MODEL_DIR

needs_ref = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "model.safetensors").exists(),
                               reason="reference model not shipped")

#: One engine shape for the offline reference and the server (greedy outputs must match token for token).
ENGINE = dict(max_num_seqs=32, block_size=16, num_kv_blocks=512)
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "x = 1\n",
           "print('hi')\n", "# comment\n", "def f(a, b):\n"]


class ServerThread:
    """uvicorn serving ``app`` from a background thread; ``url`` is the ``/v1`` base URL."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start within 60 s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="package")
def offline_greedy():
    """Greedy completions of PROMPTS (16 tokens) from ``LLM.generate``: ``{prompt: (token_ids, text)}``."""
    if not (REFERENCE_MODEL_DIR / "model.safetensors").exists():
        pytest.skip("reference model not shipped")
    from deepinfer_npu import LLM, SamplingParams

    llm = LLM(**ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    result = {p: (list(o.outputs[0].token_ids), o.outputs[0].text) for p, o in zip(PROMPTS, outs)}
    del llm
    return result


@pytest.fixture(scope="package")
def server(offline_greedy):
    """The server (``.url``, ``.llm`` the AsyncLLM, ``.metrics``); stopped at the end of the package."""
    from deepinfer_npu.config import EngineConfig
    from deepinfer_npu.entrypoints.async_llm import AsyncLLM
    from deepinfer_npu.entrypoints.chat_template import load_chat_template
    from deepinfer_npu.entrypoints.metrics import ServerMetrics
    from deepinfer_npu.entrypoints.openai.api_server import build_app

    config = EngineConfig(model=None, **ENGINE)
    metrics = ServerMetrics("reference")
    llm = AsyncLLM(config, observer=metrics.observe)
    metrics.bind(llm)
    app = build_app(llm, "reference", load_chat_template(config.model_dir), metrics)
    srv = ServerThread(app)
    srv.llm, srv.metrics = llm, metrics
    yield srv
    srv.stop()
    llm.shutdown()


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def wait_idle(llm, timeout_s: float = 30.0) -> None:
    """Until the engine has no unfinished request (aborts are applied by the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while llm.engine.has_unfinished_requests() or llm.num_running or llm.num_waiting:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout_s} s: {llm.engine.unfinished_request_ids()}")
        time.sleep(0.02)


def http(method: str, url: str, body: bytes | str | None = None, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """``(status, headers, body)`` of one plain HTTP request (stdlib only; error statuses are returned)."""
    import urllib.error
    import urllib.request

    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
