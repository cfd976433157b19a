"""Data-parallel engine: ``LLMEngine``'s API over one process per rank, each with its own engine and device.

The front-end (this object, in the caller's process) hands each request to the least-loaded rank (prompt plus
remaining output tokens of its unfinished requests), forwards aborts to the owning rank and returns outputs as
ranks produce them. Each rank process binds one device (the ``local_rank``-th of ``CUDA_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES`` when set), joins the process groups (``parallel_state``) and runs its
``LLMEngine`` loop. Per-request seeds are drawn here, in submission order, from ``EngineConfig.seed``, so sampled
outputs do not depend on which rank serves a request.

Failure behaviour: a request a rank rejects raises ``ValueError`` from ``add_request`` (the rank keeps serving
the others); a rank that exits, or sends no heartbeat for ``timeout_s``, makes the next call raise
``RuntimeError`` naming the rank, and the other ranks are stopped. Rank processes ignore SIGINT: Ctrl-C reaches
the front-end, whose ``shutdown`` stops every rank.
"""

from __future__ import annotations

import dataclasses
import queue as queue_mod
import socket
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch.multiprocessing as mp

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams

from .rank_worker import RankSpec, rank_main

DEFAULT_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPEngine:
    """``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests`` over ``data_parallel_size``
    rank processes on this host."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 master_port: int | None = None, heartbeat_s: float = 1.0) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if timeout_s <= heartbeat_s:
            raise ValueError(f"timeout_s={timeout_s} must exceed the heartbeat interval {heartbeat_s}")
        self.config = config
        self.world_size = data_parallel_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(data_parallel_size)]
        port = master_port or _free_port()
        self._procs = []
        for rank in range(data_parallel_size):
            spec = RankSpec(rank=rank, world_size=data_parallel_size, master_port=port, config=config,
                            heartbeat_s=heartbeat_s, timeout_s=timeout_s)
            proc = ctx.Process(target=rank_main, args=(spec, self._inboxes[rank], self._outbox),
                               name=f"deepinfer-dp-rank{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
        self._last_seen = [time.monotonic()] * data_parallel_size
        self._owner: dict[str, int] = {}
        self._load: dict[str, int] = {}
        self._rank_load = [0] * data_parallel_size
        self._outputs: list[RequestOutput] = []
        self._acks: dict[str, str | None] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self._closed = False
        self.rank_info: list[dict] = [{} for _ in range(data_parallel_size)]
        self._wait_ready()

    # ------------------------------------------------------------------ lifecycle
    def _wait_ready(self) -> None:
        pending = set(range(self.world_size))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            self._pump(max(0.0, min(1.0, deadline - time.monotonic())))
            pending = {r for r in pending if not self.rank_info[r]}
            if pending and time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"DP ranks {sorted(pending)} did not start within {self.timeout_s:.0f} s")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(("shutdown",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)

    def __del__(self) -> None:  # best effort: never leave rank processes behind
        try:
            self.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------------ messages
    def _fail(self, message: str) -> None:
        self.shutdown()
        raise RuntimeError(message)

    def _check_alive(self) -> None:
        now = time.monotonic()
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                self._fail(f"DP rank {rank} exited with code {proc.exitcode}; every rank was stopped")
            if now - self._last_seen[rank] > self.timeout_s:
                self._fail(f"DP rank {rank} sent nothing for {self.timeout_s:.0f} s (hung?); every rank was stopped")

    def _pump(self, wait_s: float) -> None:
        """Read every message that is ready (waiting up to ``wait_s`` for the first one)."""
        if self._closed:
            raise RuntimeError("the DP engine has been shut down")
        try:
            msg = self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait()
        except queue_mod.Empty:
            self._check_alive()
            return
        while True:
            kind, rank = msg[0], msg[1]
            self._last_seen[rank] = time.monotonic()
            if kind == "ready":
                self.rank_info[rank] = msg[2]
            elif kind == "ack":
                self._acks[msg[2]] = msg[3]
            elif kind == "outputs":
                for out in msg[2]:
                    if out.finished:
                        self._release(out.request_id)
                self._outputs.extend(msg[2])
            elif kind == "fatal":
                self._fail(f"DP rank {rank} failed:\n{msg[2]}")
            try:
                msg = self._outbox.get_nowait()
            except queue_mod.Empty:
                break
        self._check_alive()

    def _release(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._rank_load[rank] -= self._load.pop(request_id, 0)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | dict | Sequence[int] | None,
                    sampling_params: SamplingParams | None = None) -> None:
        request_id = str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.seed is None:  # drawn here, in submission order: independent of the serving rank
            params = dataclasses.replace(params, seed=int(self._seed_rng.integers(0, 2**63 - 1)))
        rank = min(range(self.world_size), key=lambda r: (self._rank_load[r], r))
        self._inboxes[rank].put(("add", request_id, prompt, params))
        deadline = time.monotonic() + self.timeout_s
        while request_id not in self._acks:
            self._pump(min(0.5, max(0.0, deadline - time.monotonic())))
            if request_id not in self._acks and time.monotonic() > deadline:
                self._fail(f"DP rank {rank} did not answer add_request({request_id!r}) within {self.timeout_s:.0f} s")
        error = self._acks.pop(request_id)
        if error is not None:
            raise ValueError(error)
        prompt_len = len(prompt) if isinstance(prompt, (list, tuple)) else 0
        load = prompt_len + (params.max_tokens or 0) + 1
        self._owner[request_id] = rank
        self._load[request_id] = load
        self._rank_load[rank] += load

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]
        for rid in ids:
            rank = self._owner.get(rid)
            if rank is not None:
                self._inboxes[rank].put(("abort", rid))

    def step(self) -> list[RequestOutput]:
        """Outputs produced since the last call (waits briefly for some when requests are unfinished)."""
        self._pump(0.05 if self._owner and not self._outputs else 0.0)
        outputs, self._outputs = self._outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or bool(self._outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    def requests_per_rank(self) -> list[int]:
        counts = [0] * self.world_size
        for rank in self._owner.values():
            counts[rank] += 1
        return counts

