"""benchmarks/bench_throughput.py: the model FLOPs it divides by, and a CPU rehearsal whose rows count every token
of every request and carry the transformers peer's rate."""

import json

from benchmarks import bench_throughput as bench
from benchmarks.decode_workload import V2_LITE


def test_linear_flops_are_two_per_active_weight_of_v2_lite():
    """27 MLA layers (q 16 x 192 x 2048, kv_a 576 x 2048, kv_b 512 x 16 x 256, o 2048 x 2048), one dense MLP of
    10944 and 26 MoE layers (router 64 x 2048, 2 shared + 6 routed experts of 3 x 2048 x 1408)."""
    attn = 16 * 192 * 2048 + 576 * 2048 + 512 * 16 * 256 + 2048 * 2048
    active = 27 * attn + 3 * 2048 * 10944 + 26 * (64 * 2048 + 8 * 3 * 2048 * 1408)
    linear, per_position, logits = bench.token_flops(V2_LITE)
    assert linear == 2 * active and per_position == 27 * 2 * 16 * (192 + 128) and logits == 2 * 2048 * 102400


def test_request_flops_count_causal_positions_and_one_logits_row_a_token():
    linear, per_pos, logits = bench.token_flops(V2_LITE)
    # 3 prompt tokens + 2 outputs: 4 tokens through the layers (the last output is never fed back), attending to
    # 1 + 2 + 3 + 4 positions, and 2 logits rows
    assert bench.request_flops(V2_LITE, 3, 2) == 4 * linear + 10 * per_pos + 2 * logits


def test_cpu_rehearsal_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    bench.main(["--backend", "cpu", "--tiny", "--num-prompts", "6", "--peer-prompts", "2", "--max-num-seqs", "4",
                "--max-model-len", "256", "--workload", "prefill", "mix", "--max-num-batched-tokens", "256", "64",
                "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["workload"], r["max_num_batched_tokens"]) for r in rows] == [
        ("prefill", 256), ("mix", 256), ("prefill", 64), ("mix", 64)]  # one engine each, side by side
    for r in rows:
        assert r["requests"] == 6 and r["all_outputs_complete"], r
        assert r["prompt_tok_s"] > 0 and r["frac_of_tensor_core_roofline"] > 0
        assert 0 < r["host_step_ms"] and 0 < r["step_ms"]
    assert rows[0]["over_first_engine"] == 1.0 and rows[2]["over_first_engine"] == round(
        rows[2]["req_s"] / rows[0]["req_s"], 4)
    assert rows[2]["prefill_steps"] > rows[0]["prefill_steps"]  # smaller steps: more of them
    for r in rows:  # every step's kind, in order
        runs = r["step_kinds"].split()
        assert runs[0].startswith("P") and sum(int(x[1:]) for x in runs) == r["steps"], r["step_kinds"]
    prefill, mix = rows[:2]
    assert prefill["output_tokens"] == 6 and mix["output_tokens"] > 6
    assert prefill["peer_prompts"] == 2 and prefill["peer_prompt_tok_s"] > 0 and prefill["over_peer_flop_rate"] > 0
    assert "peer" not in mix


def test_cpu_rehearsal_profile_names_device_and_host_time(tmp_path):
    out = tmp_path / "rows.jsonl"
    bench.main(["--backend", "cpu", "--tiny", "--num-prompts", "3", "--peer-prompts", "0", "--max-num-seqs", "4",
                "--max-model-len", "256", "--workload", "prefill", "--profile", "--profile-prompts", "2", "--top", "5",
                "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bench"] for r in rows] == ["throughput", "throughput_profile"]
    prof = rows[1]
    assert prof["max_num_batched_tokens"] == 4096 and prof["wall_s"] > 0
    assert 0 < len(prof["top"]) <= 5 and 0 < len(prof["host_top"]) <= 5
    assert all(isinstance(n, str) and s >= 0 and c >= 1 for n, s, c in prof["host_top"])


def test_cpu_rehearsal_runs_one_engine_a_max_num_seqs(tmp_path):
    out = tmp_path / "rows.jsonl"
    bench.main(["--backend", "cpu", "--tiny", "--num-prompts", "6", "--peer-prompts", "0", "--max-num-seqs", "2", "6",
                "--max-model-len", "256", "--workload", "mix", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["workload"], r["max_num_seqs"]) for r in rows] == [("mix", 2), ("mix", 6)]
    assert all(r["all_outputs_complete"] for r in rows)
    # six requests at most two at a time take more steps than all six at once
    assert rows[0]["steps"] > rows[1]["steps"]
    assert rows[1]["over_first_engine"] == round(rows[1]["req_s"] / rows[0]["req_s"], 4)


def test_cpu_rehearsal_graph_capture_at_start_up_captures_nothing_in_the_run(tmp_path, graph_runners):
    out = tmp_path / "rows.jsonl"
    bench.main(["--backend", "cpu", "--tiny", "--num-prompts", "6", "--peer-prompts", "0", "--max-num-seqs", "4",
                "--max-model-len", "256", "--workload", "mix", "--graph-capture", "lazy", "startup",
                "--out", str(out)])
    lazy, startup = [json.loads(line) for line in out.read_text().splitlines()]
    assert (lazy["graph_capture"], startup["graph_capture"]) == ("lazy", "startup")
    assert startup["graphs_captured_in_run"] == 0 and startup["graph_capture_s_in_run"] == 0.0
    assert startup["graphs_captured_at_start"] > 0 and lazy["graphs_captured_at_start"] == 0
    assert lazy["all_outputs_complete"] and startup["all_outputs_complete"]


def test_step_kinds_are_run_length_coded():
    assert bench.step_kinds(["P", "P", "D", "D", "D", "P"]) == "P2 D3 P1"
    assert bench.step_kinds(["P", "D"] * 3, runs=2) == "P1 D1 ... (4 more runs)"
    assert bench.step_kinds([]) == ""
