"""``python -m deepinfer_npu.serve`` as users start it: it prints where it serves, answers, and on SIGTERM lets
running requests finish (or aborts them after --shutdown-timeout) and exits 0; bad arguments exit 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from .conftest import http, needs_ref

pytestmark = needs_ref


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_npu.serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving \S+ on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
            proc.log = lines
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


def _wait_running(base: str, client: threading.Thread, timeout_s: float = 120.0) -> None:
    """Until the server's /metrics shows a running request (one that produced tokens)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = http("GET", base + "/metrics")[2].decode()
        m = re.search(r"^deepinfer:num_requests_running\{[^}]*\} (\S+)$", body, re.MULTILINE)
        if m and float(m.group(1)) >= 1:
            return
        assert client.is_alive(), "the request finished before the server reported it running"
        time.sleep(0.01)
    raise AssertionError(f"no running request within {timeout_s} s")


def test_sigterm_drains_running_requests_and_exits_0():
    proc, base = _start("--max-num-seqs", "8", "--num-kv-blocks", "128", "--block-size", "16",
                        "--served-model-name", "ref", "--shutdown-timeout", "60")
    try:
        assert http("GET", base + "/health")[0] == 200
        result = {}

        def request():  # a 40-token completion in flight when SIGTERM arrives
            result["r"] = http("POST", base + "/v1/completions", json.dumps(
                {"model": "ref", "prompt": "def f(x):\n", "max_tokens": 40, "temperature": 0, "ignore_eos": True}))

        t = threading.Thread(target=request)
        t.start()
        _wait_running(base, t)  # SIGTERM while the request runs, however loaded the machine
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert proc.wait(timeout=120) == 0, "".join(proc.log)
        status, _, body = result["r"]
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 40  # drained, not cut
        assert "server stopped" in "".join(proc.log)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_arguments_exit_2_before_loading():
    r = subprocess.run([sys.executable, "-m", "deepinfer_npu.serve", "--max-waiting-requests", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-waiting-requests must be >= 1" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deepinfer_npu.serve", "--chat-template", "no such template"],
                       capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode == 2 and "neither a file nor a jinja2 template" in r.stderr
