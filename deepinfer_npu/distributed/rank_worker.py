"""One data-parallel rank: binds its device, joins the process groups, runs its ``LLMEngine`` loop.

Messages in (from the front-end): ``(what, token, *payload)`` with ``what`` one of ``validate`` / ``add`` (a
list of ``(request_id, prompt, params)``), ``abort`` (a request id), ``stats``, ``shutdown``; a message with a
token gets ``("reply", rank, token, value)``. Messages out besides replies: ``("ready", rank, info)``,
``("outputs", rank, [RequestOutput])``, ``("heartbeat", rank)``, ``("fatal", rank, traceback_text)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from deepinfer_npu.config import EngineConfig

logger = logging.getLogger(__name__)

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}
OUTBOX_FLUSH_TIMEOUT_S = 10.0  # a stopped rank process waits this long for its last messages to be written


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    master_port: int
    config: EngineConfig
    heartbeat_s: float
    timeout_s: float
    master_addr: str = "127.0.0.1"
    local_rank: int | None = None  # the device index on this node; None: the rank (one node)
    # Several nodes: rendezvous on node 0's store at master_addr:master_port (the front-end hosts it)
    shared_store: bool = False
    parent_pid: int | None = None  # the process that started this rank: when it is gone, the rank stops

    @property
    def device_index(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank


def visible_device_for(local_rank: int, variable: str) -> str | None:
    """The device this rank binds: the ``local_rank``-th entry of ``variable`` if set, else its index."""
    visible = os.environ.get(variable)
    if not visible:
        return str(local_rank)
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if local_rank >= len(devices):
        raise RuntimeError(f"DP rank {local_rank}: {variable}={visible!r} lists {len(devices)} devices, too few for "
                           "this data-parallel size")
    return devices[local_rank]


def _bind_device(spec: RankSpec) -> None:
    # Before any device runtime starts in this process: the rank sees exactly one device, as index 0.
    backend = spec.config.backend
    for name, variable in VISIBLE_DEVICES.items():
        if backend in (name, "auto"):
            os.environ[variable] = visible_device_for(spec.device_index, variable)


def rank_main(spec: RankSpec, inbox, outbox, store=None) -> None:
    """``store``: the rendezvous store, when the rank runs in the process that holds it (torchrun)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the front-end
    try:
        _bind_device(spec)
        from deepinfer_npu.engine.llm_engine import LLMEngine

        from .parallel_state import DistributedConfig, destroy_process_groups, init_process_groups

        from deepinfer_npu.hal.registry import get_backend

        backend = get_backend(spec.config.backend)  # binds the rank's one visible device
        if store is not None:
            import torch.distributed as dist

            store = dist.PrefixStore("ranks", store)
        elif spec.shared_store:
            import torch.distributed as dist

            from .control_link import connect_store

            store = dist.PrefixStore("ranks", connect_store(spec.master_addr, spec.master_port, spec.timeout_s,
                                                            host=False))
        groups = init_process_groups(DistributedConfig(
            rank=spec.rank, world_size=spec.world_size, local_rank=spec.device_index, master_addr=spec.master_addr,
            master_port=spec.master_port, timeout_s=spec.timeout_s), backend.dist_backend, store)
        lockstep = _setup_expert_parallel(spec, groups)
        config = spec.config
        if lockstep and config.enable_graphs is not False and (config.enable_graphs or backend.graphs_by_default):
            config = _graphs_under_expert_parallel(spec.rank, config, backend.kernels)
        engine = LLMEngine(config)
        if lockstep:
            engine.attach_step_group(groups.cpu_group)
        outbox.put(("ready", spec.rank, {"backend": engine.backend.name, "pid": os.getpid(),
                                         "device": str(engine.backend.device),
                                         "device_type": engine.backend.device_type,
                                         "device_index": engine.backend.device_index,
                                         "op_report": engine.backend.op_report(), "vocab_size": engine.vocab_size,
                                         "max_model_len": engine.max_model_len,
                                         "dtype": engine.runner.dtype, "num_kv_blocks": engine.runner.num_kv_blocks,
                                         **weight_bytes(engine.runner.model)}))
        try:
            (_serve_lockstep if lockstep else _serve)(spec, engine, inbox, outbox, groups)
        finally:
            destroy_process_groups()
    except Exception:
        outbox.put(("fatal", spec.rank, traceback.format_exc()))


def rank_process_main(spec: RankSpec, inbox, outbox) -> None:
    """A rank in a process of its own (``spawn_ranks``): ``rank_main``, then out without the interpreter's teardown.

    By then the rank has stopped and destroyed its groups, and failures have travelled as ``("fatal", ...)``; what
    it sent is flushed first, for at most ``OUTBOX_FLUSH_TIMEOUT_S`` (a front-end that is gone reads nothing, and
    a full pipe would hold the flush forever). At teardown gloo's C++ objects are released in no fixed order, and a
    rank that had stopped cleanly could abort there ("terminate called without an active exception"): exit code -6
    for a clean stop, which a node server reports as a failed node."""
    rank_main(spec, inbox, outbox)
    outbox.close()
    flush = threading.Thread(target=outbox.join_thread, name="outbox-flush", daemon=True)
    flush.start()
    flush.join(OUTBOX_FLUSH_TIMEOUT_S)
    if flush.is_alive():
        logger.warning("rank %d: its last messages were not read within %.0f s; leaving without them", spec.rank,
                       OUTBOX_FLUSH_TIMEOUT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _graphs_under_expert_parallel(rank: int, config: EngineConfig, kernels) -> EngineConfig:
    """Decode graphs under expert parallelism need a dispatch without host reads at decode sizes: a kernel set with
    ``FixedCapacityAtDecode`` (fixed capacity, or Ascend's MC2) keeps them, captured at start-up so every rank
    captures the same sizes in the same order (each graph's all-to-all pairs with the other ranks'); any other
    keeps the eager decode (its reference dispatch sizes the all-to-all from host counts: not capturable), and so does
    EPLB (a re-plan installs new route tables and moves experts between slots, which a captured graph would not
    follow)."""
    from .ep_decode_path import FixedCapacityAtDecode

    if config.eplb is not None:
        logger.warning("rank %d: decode graphs are off under expert parallelism with EPLB (eager decode): a "
                       "re-plan moves experts to other slots, which captured graphs would not follow", rank)
        return dataclasses.replace(config, enable_graphs=False)
    if not isinstance(kernels, FixedCapacityAtDecode):
        logger.warning("rank %d: decode graphs are off under expert parallelism (eager decode): kernel set %s "
                       "sizes its all-to-all from host counts", rank, type(kernels).__name__)
        return dataclasses.replace(config, enable_graphs=False)
    logger.info("rank %d: decode graphs on under expert parallelism (%s: fixed-capacity dispatch at decode sizes "
                "<= %d tokens), all captured at start-up", rank, type(kernels).__name__, kernels.ep_fixed_max_tokens)
    return dataclasses.replace(config, graph_capture="startup")


def weight_bytes(model) -> dict[str, int]:
    """This rank's weight memory: all parameters, and the routed experts' share of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
    return {"weight_bytes": total, "expert_weight_bytes": experts}


def _handle(engine, msg) -> object:
    """Run one front-end request; the reply (None or the exception a bad request raised)."""
    what, payload = msg[0], msg[2:]
    if what == "validate":
        try:
            for index, (request_id, prompt, params) in enumerate(payload[0]):
                engine._validate(request_id, prompt, params)
        except (ValueError, TypeError) as e:
            n = len(payload[0])
            return e if n == 1 else type(e)(f"{e} (index {index} of the {n} submitted; none was queued)")
        return None
    if what == "add":
        try:
            engine.add_requests(payload[0])
        except (ValueError, TypeError) as e:
            return e
        return None
    if what == "stats":
        from .parallel_state import get_expert_parallel

        stats = engine.get_stats()
        ep = get_expert_parallel()
        if ep is not None:
            from deepinfer_npu.eplb.balancer import ep_stats

            stats["expert_parallel"] = ep_stats(ep)
        return stats
    if what == "abort":
        engine.abort_request(payload[0])
        return None
    if what == "prepare_structured_output":  # on a thread of the rank: the reply does not wait for it
        return engine.prepare_structured_output() is not None
    if what == "structured_output_ready":
        return engine.structured_output_ready
    raise ValueError(f"unknown front-end message {what!r}")


def _setup_expert_parallel(spec: RankSpec, groups) -> bool:
    """Shard the routed experts over the ranks when the model has them and the configuration asks for it
    (contiguous placement; with EPLB the policy's placement with redundant slots and a balancer); True when the
    ranks must then step in lockstep."""
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

    from .ep_moe import EPGroup
    from .expert_placement import ExpertPlacement
    from .parallel_state import set_expert_parallel

    config = spec.config
    cfg = DeepseekModelConfig.from_pretrained(config.model_dir)
    if not config.enable_expert_parallel or spec.world_size == 1 or not cfg.n_routed_experts:
        if config.enable_eplb:
            raise ValueError(f"enable_eplb: the model at {config.model_dir} has no routed experts to balance")
        return False
    eplb = config.eplb
    if eplb is None:
        placement = ExpertPlacement.contiguous(cfg.n_routed_experts, spec.world_size)
        set_expert_parallel(EPGroup(placement, spec.rank, groups.device_group, config.moe_routing_skew))
        return True
    from deepinfer_npu.eplb.balancer import ExpertBalancer, initial_placement

    where = dict(num_groups=cfg.n_group or 1, num_nodes=config.nnodes)
    placement = initial_placement(cfg.n_routed_experts, spec.world_size, eplb, **where)
    ep = EPGroup(placement, spec.rank, groups.device_group, config.moe_routing_skew)
    ep.balancer = ExpertBalancer(ep, eplb, **where)
    set_expert_parallel(ep)
    return True


def _drain(engine, inbox, outbox, rank: int, wait_s: float, parent_pid: int | None = None) -> bool:
    """Handle every waiting front-end message (the first waited for up to ``wait_s``); True on shutdown."""
    if parent_pid is not None and os.getppid() != parent_pid:  # orphaned: nobody reads this rank's outputs
        raise RuntimeError(f"DP rank {rank}: the process that started it (pid {parent_pid}) has exited")
    try:
        msg = inbox.get(timeout=wait_s) if wait_s > 0 else inbox.get_nowait()
    except queue_mod.Empty:
        return False
    while True:
        if msg[0] == "shutdown":
            return True
        reply = _handle(engine, msg)
        if msg[1] is not None:  # a token: the front-end waits for this reply
            outbox.put(("reply", rank, msg[1], reply))
        try:
            msg = inbox.get_nowait()
        except queue_mod.Empty:
            return False


def _serve_lockstep(spec: RankSpec, engine, inbox, outbox, groups) -> None:
    """Every rank steps every iteration (the engine's vote pairs them); shutdown is agreed first, so all ranks
    leave at the same step. Idle iterations wait briefly for work."""
    import torch
    import torch.distributed as dist

    from .parallel_state import get_expert_parallel

    ep = get_expert_parallel()
    if ep is not None:
        ep.start_counting()
    last_beat, stop, idle_wait = time.monotonic(), False, 0.0
    while True:
        stop = _drain(engine, inbox, outbox, spec.rank, idle_wait, spec.parent_pid) or stop
        # with the model step count (MAX of it and of its negation): a load balancer re-plans at a step count,
        # and every rank must be at the same one
        if ep is not None:
            ep.step_boundary()
        steps = ep.steps if ep is not None else 0
        flag = torch.tensor([int(stop), steps, -steps])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.cpu_group)
        agreed = flag.tolist()
        if agreed[0]:
            return
        if agreed[1] != -agreed[2]:
            raise RuntimeError(f"DP rank {spec.rank}: the ranks' model step counts differ ({-agreed[2]} to "
                               f"{agreed[1]}); the expert-parallel steps are out of lockstep")
        if ep is not None and ep.balancer is not None:
            ep.balancer.at_step_boundary()
        outputs = engine.step()
        if outputs:
            outbox.put(("outputs", spec.rank, outputs))
            last_beat = time.monotonic()
        idle_wait = 0.0 if engine.last_step_had_work or engine.has_unfinished_requests() else 0.005
        if time.monotonic() - last_beat >= spec.heartbeat_s:
            outbox.put(("heartbeat", spec.rank))
            last_beat = time.monotonic()


def _serve(spec: RankSpec, engine, inbox, outbox, groups=None) -> None:
    """Each rank on its own (every expert local): step while there is work, else wait for messages."""
    last_beat = time.monotonic()
    while True:
        idle = not engine.has_unfinished_requests()
        if _drain(engine, inbox, outbox, spec.rank, spec.heartbeat_s if idle else 0.0, spec.parent_pid):
            return
        if engine.has_unfinished_requests():
            outputs = engine.step()
            if outputs:
                outbox.put(("outputs", spec.rank, outputs))
                last_beat = time.monotonic()
        if time.monotonic() - last_beat >= spec.heartbeat_s:
            outbox.put(("heartbeat", spec.rank))
            last_beat = time.monotonic()
