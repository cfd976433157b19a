"""benchmarks/profile_decode.py on the CPU: a row a batch, and with --host-steps the clean wall time and the host's
Python functions, ranked, with the engine's step among the inclusive ones."""

from __future__ import annotations

import json

from benchmarks import profile_decode


def test_cpu_rehearsal_ranks_the_hosts_functions(capsys):
    assert profile_decode.main(["--backend", "cpu", "--tiny", "--batch", "2", "--steps", "2", "--host-steps", "3",
                                "--top", "6", "--prompt-len", "16"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert row["batch"] == 2 and row["host_steps"] == 3 and row["clean_wall_ms_per_step"] > 0
    for key in ("host_functions_self", "host_functions_cum"):
        ranked = row[key]
        assert len(ranked) == 6 and all(len(r) == 3 for r in ranked)
        assert [r[1] for r in ranked] == sorted((r[1] for r in ranked), reverse=True)
    # inclusive time: the engine's step holds every other engine function, about once a step
    step = [r for r in row["host_functions_cum"] if "step_loop.py" in r[0] and r[0].endswith("(step)")]
    assert step and step[0][2] == 1.0 and step[0][1] <= 1e3 * row["clean_wall_ms_per_step"] * 10
