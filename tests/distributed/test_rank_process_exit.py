"""``rank_worker.rank_process_main``: a rank in a process of its own leaves with exit code 0 once ``rank_main`` has
returned; the messages it sent arrive when the front-end reads them, and a front-end that reads nothing holds it no
longer than ``OUTBOX_FLUSH_TIMEOUT_S``. Real spawned processes; ``rank_main`` is replaced by a stand-in that only
sends."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

CHUNK = 1 << 16


def _rank(outbox, messages: int, timeout_s: float) -> None:
    from deepinfer_npu.distributed import rank_worker

    rank_worker.OUTBOX_FLUSH_TIMEOUT_S = timeout_s
    rank_worker.rank_main = lambda spec, inbox, out: [out.put(("outputs", spec.rank, bytes(CHUNK)))
                                                     for _ in range(messages)]
    rank_worker.rank_process_main(SimpleNamespace(rank=1), None, outbox)


def _start(messages: int, timeout_s: float):
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(outbox, messages, timeout_s))
    proc.start()
    return proc, outbox


def test_every_message_arrives_and_the_rank_exits_0():
    proc, outbox = _start(messages=40, timeout_s=30.0)  # 2.5 MiB: more than a pipe holds, read while it flushes
    got = [outbox.get(timeout=60) for _ in range(40)]
    proc.join(60)
    assert proc.exitcode == 0
    assert all(m[:2] == ("outputs", 1) and len(m[2]) == CHUNK for m in got)


def test_a_front_end_that_reads_nothing_holds_the_rank_no_longer_than_the_flush_timeout():
    start = time.monotonic()
    proc, outbox = _start(messages=200, timeout_s=1.0)  # 12.5 MiB nobody reads: the flush cannot finish
    proc.join(60)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0 and time.monotonic() - start < 40
    outbox.cancel_join_thread()
