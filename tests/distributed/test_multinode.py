"""Several nodes on one machine (127.0.0.1, gloo): node 0 runs the front-end and its ranks, node 1 is a headless
``python -m deepinfer_npu.run --node-rank 1`` process. fp32 greedy tokens equal the single-process engine's with
expert parallelism over the nodes; node 1 exits 0 when node 0 shuts down; a node that dies, or never comes, is
named within the timeout; inconsistent arguments are refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.distributed.control_link import connect_store, control_group
from deepinfer_npu.distributed.dp_engine import DPEngine
from deepinfer_npu.distributed.node_server import serve_node
from deepinfer_npu.distributed.rank_launch import node_ranks
from deepinfer_npu.distributed.rank_worker import RankSpec, visible_device_for
from deepinfer_npu.run import main as run_main
from tests.distributed.random_checkpoints import save_random_checkpoint

PROMPTS = [[(7 * i + j) % 96 for j in range(3 + i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 120  # generous: the machine running the tests may be shared

#: one pytest-xdist worker runs the module: the checkpoint and the single-process tokens are made once
pytestmark = pytest.mark.xdist_group("multinode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_random_checkpoint("v2", tmp_path_factory.mktemp("multinode") / "v2")


@pytest.fixture(scope="module")
def single_tokens(model) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in LLM(model, max_num_seqs=8).generate(prompts, GREEDY, use_tqdm=False)]


def _run_node(model: str, node_rank: int, dp: int, port: int, *extra: str) -> subprocess.Popen:
    """``python -m deepinfer_npu.run`` as node ``node_rank`` of 2 (its own process group: killed as a whole)."""
    cmd = [sys.executable, "-m", "deepinfer_npu.run", "--model", model, "--data-parallel-size", str(dp),
           "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--distributed-timeout", str(TIMEOUT_S), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture
def nodes():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:  # never leave a node behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_four_ranks_on_two_nodes_cli_equal_one_process(model, single_tokens, nodes):
    port = _free_port()
    nodes.append(_run_node(model, 1, 4, port))
    ids = [a for p in PROMPTS for a in ("--prompt-token-ids", ",".join(map(str, p)))]
    nodes.append(_run_node(model, 0, 4, port, *ids, "--max-tokens", "8", "--temperature", "0", "--json",
                           "--no-progress"))
    headless, front_end = nodes
    out, err = front_end.communicate(timeout=240)
    assert front_end.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [row["token_ids"] for row in rows if "token_ids" in row] == single_tokens
    _, node1_err = headless.communicate(timeout=60)  # node 1 leaves once node 0 is done
    assert headless.returncode == 0, node1_err[-3000:]
    assert f"node 1 of 2: serving DP ranks 2..3 for master 127.0.0.1:{port}" in node1_err


def test_two_nodes_from_python_then_a_dead_node_is_named(model, single_tokens, nodes):
    port = _free_port()
    nodes.append(_run_node(model, 1, 2, port))
    llm = LLM(model, data_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
              distributed_timeout_s=TIMEOUT_S)  # the engine options node 1's command line gives
    engine = llm.llm_engine
    try:
        # 8 experts, 4 on each rank
        assert engine.rank_info[0]["expert_weight_bytes"] == engine.rank_info[1]["expert_weight_bytes"] > 0
        # what the CLI summary and the parity recorder read from an engine
        assert (engine.backend.name, engine.backend.device, engine.vocab_size) == ("cpu", "cpu", 96)
        assert engine.backend.op_report()
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == single_tokens
        assert llm.get_stats()["generation_tokens"] == 4 * 8

        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, long)
        engine.add_request("b", {"prompt_token_ids": [4, 5, 6]}, long)
        assert sorted(engine.requests_per_rank()) == [1, 1]
        deadline = time.monotonic() + TIMEOUT_S
        while not engine.step() and time.monotonic() < deadline:  # until both nodes run
            pass
        os.killpg(nodes[0].pid, signal.SIGKILL)  # node 1 and its rank
        with pytest.raises(RuntimeError, match=r"node 1 \(DP rank 1\) was lost"):
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                engine.step()
    finally:
        engine.shutdown()
    assert engine._procs[0].exitcode is not None  # node 0's rank stopped too


def test_a_node_that_never_comes_is_named():
    store = connect_store("127.0.0.1", _free_port(), 2, host=True)
    with pytest.raises(RuntimeError, match=r"node\(s\) \[1\] did not join the control group within 2 s"):
        control_group(store, 0, 2, 2)


def test_a_headless_node_without_node_0_gives_up():
    config = EngineConfig(data_parallel_size=2, nnodes=2, node_rank=1, master_addr="127.0.0.1",
                          master_port=_free_port(), distributed_timeout_s=2)
    with pytest.raises(RuntimeError, match=r"could not reach node 0's rendezvous store at 127.0.0.1:\d+ within 2 s"):
        serve_node(config)
    with pytest.raises(ValueError, match="node_rank=1 runs no front-end: node 0 does"):
        DPEngine(config)


@pytest.mark.parametrize("kwargs,message", [
    ({"data_parallel_size": 3, "nnodes": 2, "master_addr": "h"}, "data_parallel_size=3 is not divisible by nnodes=2"),
    ({"data_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_addr": "h"},
     r"node_rank=2 is out of range for nnodes=2 \(node ranks are 0..1\)"),
    ({"data_parallel_size": 2, "nnodes": 2}, "nnodes=2 needs master_addr"),
    ({"nnodes": 0}, "nnodes must be a positive integer"),
    ({"node_rank": -1}, "node_rank must be a non-negative integer"),
    ({"master_port": 0}, r"master_port must be a TCP port in \[1, 65535\]"),
])
def test_inconsistent_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_rank_numbering_and_devices(monkeypatch):
    config = EngineConfig(data_parallel_size=6, nnodes=3, master_addr="h")
    assert [list(node_ranks(config, n)) for n in range(3)] == [[0, 1], [2, 3], [4, 5]]
    spec = RankSpec(rank=3, world_size=6, master_port=1, config=config, heartbeat_s=1, timeout_s=2, local_rank=1)
    assert spec.device_index == 1  # a node's ranks bind its devices from 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert visible_device_for(spec.device_index, "CUDA_VISIBLE_DEVICES") == "7"


def test_cli_refuses_inconsistent_nodes(capsys):
    assert run_main(["--data-parallel-size", "2", "--nnodes", "2"]) == 2
    assert "nnodes=2 needs master_addr" in capsys.readouterr().err


def test_torchrun_one_process_per_rank(model, single_tokens):
    """torchrun itself starts the ranks: rank 0's process prints the completions, rank 1's serves headless."""
    ids = [a for p in PROMPTS for a in ("--prompt-token-ids", ",".join(map(str, p)))]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "deepinfer_npu.run",
                        "--model", model, "--data-parallel-size", "2", *ids, "--max-tokens", "8", "--temperature", "0",
                        "--json", "--no-progress", "--distributed-timeout", str(TIMEOUT_S)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["token_ids"] for row in rows if "token_ids" in row] == single_tokens
    assert "DP rank 1 of 2 (torchrun): serving DP rank 1 for master 127.0.0.1:" in r.stderr


def test_torchrun_variables_must_agree(monkeypatch):
    from deepinfer_npu.distributed.torchrun import torchrun_config

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert torchrun_config(EngineConfig(data_parallel_size=2)).rank == 1
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 processes, one per rank: set data_parallel_size=2"):
        torchrun_config(EngineConfig(data_parallel_size=4))
    with pytest.raises(ValueError, match="leave nnodes, node_rank, master_addr and master_port unset"):
        torchrun_config(EngineConfig(data_parallel_size=2, master_port=1234))
    with pytest.raises(ValueError, match="RANK=1: torchrun's rank 0 runs the front-end"):
        DPEngine(EngineConfig(data_parallel_size=2))
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        torchrun_config(EngineConfig(data_parallel_size=2))


def test_a_node_with_other_options_is_refused(model, nodes):
    port = _free_port()
    nodes.append(_run_node(model, 1, 2, port, "--max-num-seqs", "4"))
    with pytest.raises(ValueError, match=r"node 1 \(DP rank 1\) runs max_num_seqs=4, node 0 runs max_num_seqs=8: "
                                         "every node must pass the same engine options"):
        DPEngine(EngineConfig(model, max_num_seqs=8, data_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                              master_port=port, distributed_timeout_s=TIMEOUT_S))
    _, err = nodes[0].communicate(timeout=60)
    assert nodes[0].returncode == 1 and "refused this node: node 1 (DP rank 1) runs max_num_seqs=4" in err
