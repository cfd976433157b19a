"""The fixed prompt set. Text prompts for models with a tokenizer (the reference model is trained on Python's
standard library, so code-like prompts give it peaked, meaningful distributions); token-id prompts
otherwise."""

from __future__ import annotations

TEXT_PROMPTS: list[str] = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    ",
    "# Return the sum of a list\ndef total(xs):\n",
    'if __name__ == "__main__":\n',
    "try:\n    import json\nexcept ImportError:\n",
    "with open(path) as f:\n",
]

MAX_TOKENS = 32
TOP_LOGPROBS = 5


def token_prompts(vocab_size: int) -> list[list[int]]:
    """Deterministic id prompts (lengths 3..40, crossing block boundaries) for models without a tokenizer."""
    lengths = [3, 9, 17, 24, 33, 40]
    return [[(7 * i + 13 * p + 1) % (vocab_size - 3) + 3 for i in range(n)] for p, n in enumerate(lengths)]
