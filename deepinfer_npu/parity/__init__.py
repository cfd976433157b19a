"""Cross-backend parity traces: record greedy tokens + top-5 logprobs on fixed prompts, compare by rule.

``python -m deepinfer_npu.parity record --backend NAME [--dtype float32|bfloat16] [--model DIR]`` writes
``parity_tests/golden/<backend>-<dtype>.json``; ``python -m deepinfer_npu.parity compare --golden FILE`` runs
a
backend (default cpu) on the same prompts and applies the rule for the golden's dtype (see :mod:`.rules`).
"""
