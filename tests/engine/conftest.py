"""Shared fixtures for the engine tests: a small byte-level BPE tokenizer trained on the fly."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer_npu.engine.tokenizer import Tokenizer, load_tokenizer

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln: Äpfel, Öl und Übermut — ça va très bien, señor!",
    "深度求索的推理引擎支持多种模型。今天天气很好，我们去公园散步吧。",
    "日本語のテキストも少し入れておきます。ありがとうございます。",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "Emoji time: 😀🚀🎉👍🏽 and a family 👨‍👩‍👧 plus flags 🇩🇪🇯🇵.",
    "def sample(logits, temperature):\n    return (logits / temperature).softmax(-1)\n",
    "Numbers 12345 67890, symbols ∑∫√∞≈≠ and arrows ←↑→↓.",
    "한국어 문장도 조금 있습니다. 감사합니다!",
    "Ελληνικά γράμματα: αβγδε, and Arabic: مرحبا بالعالم.",
]

CORPUS = [s for _ in range(8) for s in _SENTENCES]
SPECIAL_TOKENS = ["<bos>", "<eos>", "<pad>"]


def train_byte_level_bpe(vocab_size: int = 300) -> HFTokenizer:
    """A byte-level BPE tokenizer (GPT-2 / DeepSeek style) with ~``vocab_size`` entries."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model directory with tokenizer.json, tokenizer_config.json and generation_config.json."""
    d = tmp_path_factory.mktemp("bpe_model")
    tok = train_byte_level_bpe()
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "add_bos_token": True}, f)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [1, 2]}, f)
    return str(d)


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_dir: str) -> Tokenizer:
    tok = load_tokenizer(bpe_dir)
    assert tok is not None
    return tok
