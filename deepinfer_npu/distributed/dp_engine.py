"""Data-parallel engine: ``LLMEngine``'s API over one process per rank, each with its own engine and device.

The front-end (this object, in the caller's process) validates every submission on rank 0 before any request is
queued (all or nothing, as ``LLMEngine.add_requests``), hands each request to the least-loaded rank (prompt plus
output tokens of its unfinished requests), forwards aborts to the owning rank and routes outputs to whoever added
each request (``OutputRouter``, as ``LLMEngine``). Each rank process binds one device (the ``local_rank``-th of
``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` when set), joins the process groups and runs its
``LLMEngine`` loop (``rank_worker``). Per-request seeds are drawn here, in submission order, from
``EngineConfig.seed``, so sampled outputs do not depend on which rank serves a request.

Several nodes (``config.nnodes > 1``): this front-end runs on node 0 with node 0's ranks; it hosts the rendezvous
store at ``master_addr:master_port`` and reaches each other node over a gloo control group (``rank_launch``,
``remote_ranks``, ``node_server``): messages to and from a remote rank travel through its node's link, so placement, replies and
failure checks are the same for every rank.

Under torchrun (``torchrun.py``) this process is rank 0 (its engine loop on a thread) and every other rank is
a process of its own, reached the same way.

Failure behaviour: a request the ranks reject raises ``ValueError`` / ``TypeError`` here and the ranks keep
serving the others; a rank that exits, or sends nothing for ``distributed_timeout_s``, or a node whose link
fails, makes the next call raise ``RuntimeError`` naming the rank (and its node), and every rank is stopped.
Rank processes ignore SIGINT: Ctrl-C reaches the front-end, whose ``shutdown`` stops every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import queue as queue_mod
import threading
import time
import types
import weakref
from collections.abc import Iterable, Sequence

import numpy as np
import torch.multiprocessing as mp

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.generation_config import load_generation_defaults
from deepinfer_npu.engine.output_router import OutputRouter, OutputSink
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.tokenizer import load_tokenizer

from .dp_stats import merge_rank_stats
from .rank_launch import launch
from .remote_ranks import RemoteRank
from .torchrun import launched_by_torchrun, torchrun_config


class DPEngine:
    """``add_request(s)`` / ``step`` / ``abort_request`` / ``has_unfinished_requests`` / ``get_stats`` over
    ``config.data_parallel_size`` rank processes (on this host, or over ``config.nnodes`` nodes); thread-safe like
    ``LLMEngine`` (``lock``)."""

    def __init__(self, config: EngineConfig, *, master_port: int | None = None, heartbeat_s: float = 1.0) -> None:
        self.config = config
        self.world_size = config.data_parallel_size
        self.timeout_s = float(config.distributed_timeout_s)
        if self.timeout_s <= heartbeat_s:
            raise ValueError(f"distributed_timeout_s={self.timeout_s} must exceed the heartbeat interval "
                             f"{heartbeat_s} s")
        env = torchrun_config(config) if launched_by_torchrun() else None
        if env is not None and env.rank != 0:
            raise ValueError(f"RANK={env.rank}: torchrun's rank 0 runs the front-end; this process serves its rank "
                             "with deepinfer_npu.distributed.node_server.serve_rank(config)")
        if config.node_rank != 0:
            raise ValueError(f"node_rank={config.node_rank} runs no front-end: node 0 does; serve this node's ranks "
                             "with deepinfer_npu.distributed.node_server.serve_node(config) or python -m "
                             f"deepinfer_npu.run --nnodes {config.nnodes} --node-rank {config.node_rank} ...")
        self.lock = threading.RLock()
        self._closed = False
        this = weakref.ref(self)  # other nodes wait for this front-end's goodbye: say it at exit too
        atexit.register(lambda: this() is not None and this().shutdown())
        self._procs: list = []
        self._inboxes: list = []
        self._nodes: list = []
        self.tokenizer = load_tokenizer(config.model_dir)
        self.generation_defaults = load_generation_defaults(config.model_dir)
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._node_of = [rank // config.ranks_per_node for rank in range(self.world_size)]
        deployment = launch(config, ctx, self._outbox, master_port=master_port, heartbeat_s=heartbeat_s)
        self._store, self._nodes = deployment.store, deployment.nodes  # the store lives as long as the ranks
        self.master_addr, self.master_port = deployment.master_addr, deployment.master_port
        self._procs, self._inboxes = deployment.procs, deployment.inboxes
        self._last_seen = [time.monotonic()] * self.world_size
        self._owner: dict[str, int] = {}
        self._load: dict[str, int] = {}
        self._rank_load = [0] * self.world_size
        self._router = OutputRouter()
        self._replies: dict[tuple, object] = {}
        self._next_token = 0
        self._seed_rng = np.random.default_rng(config.seed)
        self.rank_info: list[dict] = [{} for _ in range(self.world_size)]
        self._wait_ready()
        # what the CLI and the parity recorder read from an LLMEngine's backend and runner (rank 0's)
        info = self.rank_info[0]
        self.backend = types.SimpleNamespace(name=info["backend"], device=info["device"],
                                             device_type=info["device_type"], device_index=info["device_index"],
                                             op_report=lambda: dict(info["op_report"]))
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.runner = types.SimpleNamespace(dtype=self.rank_info[0]["dtype"],
                                            num_kv_blocks=self.rank_info[0]["num_kv_blocks"])

    # ------------------------------------------------------------------ lifecycle
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not all(self.rank_info):
            self._pump(max(0.0, min(1.0, deadline - time.monotonic())))
            if not all(self.rank_info) and time.monotonic() > deadline:
                pending = [r for r in range(self.world_size) if not self.rank_info[r]]
                where = f" (ranks per node: {self.config.ranks_per_node})" if self.config.nnodes > 1 else ""
                self._fail(f"DP ranks {pending}{where} did not start within {self.timeout_s:.0f} s")

    def _where(self, rank: int) -> str:
        return f" on node {self._node_of[rank]}" if self.config.nnodes > 1 else ""

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(("shutdown",))
        for node in self._nodes:  # each node stops its own ranks, then says goodbye
            node.close(timeout_s=min(self.timeout_s, 30.0))
        for proc in self._procs:
            if isinstance(proc, RemoteRank):
                continue
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._store = None

    def __del__(self) -> None:  # never leave rank processes behind
        try:
            self.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------------ messages
    def _fail(self, message: str) -> None:
        self.shutdown()
        raise RuntimeError(message)

    def _fail_with_cause(self, rank: int, error: str) -> None:
        """A rank's collective fails when a peer died: name the dead peer first, then the failure it caused."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            lost = [node for node in self._nodes if node.lost]
            if lost:
                self._fail(f"{lost[0].describe()} was lost: {lost[0].lost}; every rank was stopped (DP rank {rank}"
                           f"{self._where(rank)} then failed: {error.strip().splitlines()[-1]})")
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if r != rank and p.exitcode not in (None, 0)]
            if dead:
                r, code = dead[0]
                self._fail(f"DP rank {r}{self._where(r)} exited with code {code}; every rank was stopped (rank "
                           f"{rank} then failed: {error.strip().splitlines()[-1]})")
            time.sleep(0.05)
        self._fail(f"DP rank {rank}{self._where(rank)} failed:\n{error}")

    def _check_alive(self) -> None:
        now = time.monotonic()
        for node in self._nodes:
            if node.lost:
                self._fail(f"{node.describe()} was lost: {node.lost}; every rank was stopped")
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                self._fail(f"DP rank {rank}{self._where(rank)} exited with code {proc.exitcode}; every rank was "
                           "stopped")
            if now - self._last_seen[rank] > self.timeout_s:
                self._fail(f"DP rank {rank}{self._where(rank)} sent nothing for {self.timeout_s:.0f} s (hung?); "
                           "every rank was stopped")

    def _pump(self, wait_s: float) -> list[RequestOutput]:
        """Read every message that is ready (waiting up to ``wait_s`` for the first); return the outputs."""
        if self._closed:
            raise RuntimeError("the data-parallel engine has been shut down")
        outputs: list[RequestOutput] = []
        try:
            msg = self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait()
        except queue_mod.Empty:
            msg = None
        while msg is not None:
            kind, rank = msg[0], msg[1]
            if kind == "node_lost":
                node = self._nodes[rank - 1]
                self._fail(f"{node.describe()} was lost: {msg[2]}; every rank was stopped")
            self._last_seen[rank] = time.monotonic()
            if kind == "ready":
                self.rank_info[rank] = msg[2]
            elif kind == "reply":
                self._replies[(rank, msg[2])] = msg[3]
            elif kind == "outputs":
                for out in msg[2]:
                    if out.finished:
                        self._release(out.request_id)
                outputs.extend(msg[2])
            elif kind == "fatal":
                self._fail_with_cause(rank, msg[2])
            try:
                msg = self._outbox.get_nowait()
            except queue_mod.Empty:
                msg = None
        self._check_alive()
        return outputs

    def _ask(self, rank: int, what: str, *payload):
        """Send a request to ``rank`` and wait for its reply (other messages keep flowing meanwhile)."""
        token = self._next_token
        self._next_token += 1
        self._inboxes[rank].put((what, token, *payload))
        deadline = time.monotonic() + self.timeout_s
        pending: list[RequestOutput] = []
        while (rank, token) not in self._replies:
            pending += self._pump(min(0.5, max(0.01, deadline - time.monotonic())))
            if (rank, token) not in self._replies and time.monotonic() > deadline:
                self._fail(f"DP rank {rank}{self._where(rank)} did not answer {what!r} within {self.timeout_s:.0f} s")
        if pending:
            self._router.route(pending, for_step_caller=False)  # kept for the next step() / their sinks
        return self._replies.pop((rank, token))

    def _release(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._rank_load[rank] -= self._load.pop(request_id, 0)

    # ------------------------------------------------------------------ requests
    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults)

    def add_request(self, request_id: str, prompt: str | dict | Sequence[int] | None,
                    sampling_params: SamplingParams | None = None, *, output_sink: OutputSink | None = None) -> None:
        self.add_requests([(request_id, prompt, sampling_params)], output_sink=output_sink)

    def add_requests(self, requests: Iterable[tuple], *, output_sink: OutputSink | None = None) -> None:
        """All or nothing: rank 0 validates every request (the ranks run one configuration) before any is queued."""
        with self.lock:
            batch = []
            for request_id, prompt, params in requests:
                request_id = str(request_id)
                if request_id in self._owner:
                    raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
                params = params if params is not None else self.default_sampling_params()
                if isinstance(params, SamplingParams) and params.seed is None:  # independent of the serving rank
                    params = dataclasses.replace(params, seed=int(self._seed_rng.integers(0, 2**63 - 1)))
                batch.append((request_id, prompt, params))
            error = self._ask(0, "validate", batch)
            if error is not None:
                raise error
            per_rank: dict[int, list] = {}
            for request_id, prompt, params in batch:
                rank = min(range(self.world_size), key=lambda r: (self._rank_load[r], r))
                load = self._request_load(prompt, params)
                self._owner[request_id], self._load[request_id] = rank, load
                self._rank_load[rank] += load
                self._router.register(request_id, output_sink)
                per_rank.setdefault(rank, []).append((request_id, prompt, params))
            for rank, items in per_rank.items():
                error = self._ask(rank, "add", items)
                if error is not None:  # validated on rank 0 already: a rank that disagrees is a bug, not input
                    self._fail(f"DP rank {rank} refused requests rank 0 accepted: {error}")

    def _request_load(self, prompt, params: SamplingParams) -> int:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            n = len(prompt["prompt_token_ids"])
        elif isinstance(prompt, (list, tuple)):
            n = len(prompt)
        elif self.tokenizer is not None:
            text = prompt["prompt"] if isinstance(prompt, dict) else prompt
            n = len(self.tokenizer.encode(text or ""))
        else:
            n = 0
        return n + (params.max_tokens or 0) + 1

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]
        with self.lock:
            for rid in ids:
                rank = self._owner.get(rid)
                if rank is not None:
                    self._inboxes[rank].put(("abort", None, rid))

    def step(self) -> list[RequestOutput]:
        """Outputs of requests added without a sink, produced since the last call (waits briefly for some)."""
        with self.lock:
            outputs = self._pump(0.05 if self._owner and not self._router.has_kept() else 0.0)
            return self._router.route(outputs, for_step_caller=True)

    def step_for_sinks(self) -> None:
        with self.lock:
            self._router.route(self._pump(0.05 if self._owner else 0.0), for_step_caller=False)

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return bool(self._owner) or self._router.has_kept()

    def get_num_unfinished_requests(self) -> int:
        with self.lock:
            return len(self._owner)

    def unfinished_request_ids(self) -> list[str]:
        with self.lock:
            return list(self._owner)

    def requests_per_rank(self) -> list[int]:
        with self.lock:
            counts = [0] * self.world_size
            for rank in self._owner.values():
                counts[rank] += 1
            return counts

    def get_stats(self) -> dict:
        with self.lock:
            return merge_rank_stats([self._ask(rank, "stats") for rank in range(self.world_size)])

    def prepare_structured_output(self) -> list[bool]:
        """Every rank builds its grammar compiler on a thread of its own, off the request path -> per rank,
        whether it started (False: no tokenizer or no xgrammar there; such requests are refused when they come)."""
        with self.lock:
            return [bool(self._ask(rank, "prepare_structured_output")) for rank in range(self.world_size)]

    @property
    def structured_output_ready(self) -> bool:
        """Whether every rank's grammar compiler is built."""
        with self.lock:
            return all(self._ask(rank, "structured_output_ready") for rank in range(self.world_size))
