"""The progress bar counts tokens as they are generated; Ctrl-C during a CLI run keeps the finished completions,
prints a one-line note and exits 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import tqdm.auto

from deepinfer_npu import SamplingParams

from .conftest import needs_ref

pytestmark = needs_ref
REPO = Path(__file__).resolve().parents[2]


class _RecordingBar:
    draws: list = []

    def __init__(self, *args, total=None, **kwargs):
        self.n, self.total, self.postfix = 0, total, ""

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = s
        if refresh:
            self.refresh()

    def update(self, n=1):
        self.n += n
        self.refresh()

    def refresh(self):
        _RecordingBar.draws.append((self.n, self.postfix))

    def close(self):
        self.refresh()


def test_progress_bar_shows_tokens_before_any_request_finishes(llm, monkeypatch):
    monkeypatch.setattr(tqdm.auto, "tqdm", _RecordingBar)
    _RecordingBar.draws = []
    llm.generate(["def fibonacci(n):\n"], SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    early = [postfix for n, postfix in _RecordingBar.draws if n == 0 and re.search(r"\b[1-9]\d* tok", postfix)]
    assert early, _RecordingBar.draws[:5]
    assert "150 tok" in _RecordingBar.draws[-1][1]


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT handled and unblocked, as a terminal's foreground job has it (a test
    runner's process may ignore or block it, and a child inherits both)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "no /proc"


def test_ctrl_c_keeps_finished_completions_and_exits_130():
    env = dict(os.environ, DEEPINFER_CPU_THREADS="1", PYTHONUNBUFFERED="1")
    # six prompts one at a time: after the first finishes, seconds of work remain for the signal to interrupt even
    # when a loaded machine delays this process's reading of the progress line
    prompts = ["def f(x):\n", "class A:\n", "import os\n", "def g(y):\n", "class B:\n", "import re\n"]
    cmd = [sys.executable, "-m", "deepinfer_npu.run", "--max-num-seqs", "1", "--max-tokens", "150",
           "--temperature", "0", *[arg for p in prompts for arg in ("--prompt", p)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env,
                            preexec_fn=_terminal_sigint)
    err_chunks: list[bytes] = []

    def read_stderr():
        while chunk := proc.stderr.read1(4096):
            err_chunks.append(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while b"1/6" not in b"".join(err_chunks):
        assert proc.poll() is None and time.monotonic() < deadline, b"".join(err_chunks)[-800:]
        time.sleep(0.05)
    masks = _signal_masks(proc.pid)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)  # stdout (a few completions) fits the pipe; the reader thread drains stderr
    reader.join(30)
    err = b"".join(err_chunks).decode()
    out = proc.stdout.read().decode()
    assert proc.returncode == 130, (masks, err[-800:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "=== completion 0 (150 tokens, finish: length)" in out
    assert "=== completion 5" not in out
    assert re.search(r"interrupted: [1-5] of 6 completions had finished \(printed\); the rest were aborted", err)
