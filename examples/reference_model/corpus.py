"""Corpus and tokenizer for the embedded reference model.

Corpus = the ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), selected by :func:`list_stdlib_files` (the rule is written out in
``RULE`` and in the model card), sorted by their POSIX path relative to the stdlib root. A file is held out
when the first 8 hex digits of ``sha256(f"{SEED}:{relpath}")`` read as an integer are ``< HELDOUT_FRACTION *
16**8``; the rest is the training set.

Tokenizer = byte-level BPE trained with ``tokenizers`` on the training files only (held-out files never
reach it), pre-tokenized like DeepSeek-V3's (newline runs isolated, then the GPT-2 byte-level regex),
vocabulary 4096 with ``<|bos|>`` = 0, ``<|eos|>`` = 1, ``<|pad|>`` = 2. Each document is encoded
as ``<|bos|> text <|eos|>``; documents are concatenated in the sorted file order and stored as
``np.uint16``."""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

SEED = 1234
HELDOUT_FRACTION = 0.02
VOCAB_SIZE = 4096
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2
MAX_MODEL_LEN = 2048

EXCLUDED_TOP_LEVEL = ("site-packages", "dist-packages", "test", "idlelib", "pydoc_data", "encodings")
EXCLUDED_ANY_DIR = ("test", "tests", "__pycache__")

RULE = (
    "every regular file matching `**/*.py` under `sysconfig.get_paths()['stdlib']`, except files whose "
    f"first path component (relative to that root) is one of {list(EXCLUDED_TOP_LEVEL)} and files with "
    f"any directory component named one of {list(EXCLUDED_ANY_DIR)} (this drops lib2to3/tests, "
    "ctypes/test, unittest/test, ...); files that are not valid UTF-8 are skipped. `pydoc_data` "
    "(generated help text) and `encodings` (generated codec tables) are excluded because they are data, "
    "not code."
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted."""
    root = root or stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        if not f.is_file():
            continue
        parts = f.relative_to(root).parts
        if parts[0] in EXCLUDED_TOP_LEVEL:
            continue
        if any(p in EXCLUDED_ANY_DIR for p in parts[:-1]):
            continue
        out.append(f.relative_to(root).as_posix())
    return sorted(out)


def is_heldout(relpath: str, seed: int = SEED, fraction: float = HELDOUT_FRACTION) -> bool:
    h = int(hashlib.sha256(f"{seed}:{relpath}".encode()).hexdigest()[:8], 16)
    return h < fraction * 16**8


def read_texts(root: Path, relpaths: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(kept paths, texts, skipped paths)."""
    kept, texts, skipped = [], [], []
    for rp in relpaths:
        try:
            texts.append((root / rp).read_bytes().decode("utf-8"))
            kept.append(rp)
        except UnicodeDecodeError:
            skipped.append(rp)
    return kept, texts, skipped


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Newline runs (with the whitespace before them) are pieces of their own, as in DeepSeek-V3's tokenizer,
    # so indentation never merges with the newline before it and a prompt may end with "\n".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s*[\r\n]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # encode(text) (add_special_tokens=True) prepends <|bos|>, as every training document starts with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_MODEL_LEN,
    }


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
        ids.append(1)
    arr = np.asarray(ids, dtype=np.int64)
    assert arr.max() < 65536
    return arr.astype(np.uint16)


def build_corpus(out_dir: Path, log=print) -> dict:
    """Writes tokenizer.json, tokenizer_config.json, train.npy, heldout.npy, corpus_meta.json to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    files = list_stdlib_files(root)
    kept, texts, skipped = read_texts(root, files)
    held = [is_heldout(p) for p in kept]
    train_texts = [t for t, h in zip(texts, held) if not h]
    held_texts = [t for t, h in zip(texts, held) if h]
    log(f"corpus: {len(kept)} files ({len(skipped)} skipped), {len(held_texts)} held out, root {root}")
    tok = train_tokenizer(train_texts)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    train_ids = encode_docs(tok, train_texts)
    held_ids = encode_docs(tok, held_texts)
    np.save(out_dir / "train.npy", train_ids)
    np.save(out_dir / "heldout.npy", held_ids)
    meta = {
        "python_version": sys.version.split()[0],
        "stdlib_root": str(root),
        "rule": RULE,
        "seed": SEED,
        "heldout_fraction": HELDOUT_FRACTION,
        "num_files": len(kept),
        "num_skipped_non_utf8": len(skipped),
        "skipped": skipped,
        "num_train_files": len(train_texts),
        "num_heldout_files": len(held_texts),
        "heldout_files": [p for p, h in zip(kept, held) if h],
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "heldout_bytes": sum(len(t.encode()) for t in held_texts),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "vocab_size": tok.get_vocab_size(),
        "files_sha256": hashlib.sha256("\n".join(kept).encode()).hexdigest(),
        "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (out_dir / "corpus_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(
        f"tokens: train {meta['train_tokens']} ({meta['train_bytes'] / meta['train_tokens']:.2f} B/tok), "
        f"held-out {meta['heldout_tokens']}"
    )
    return meta
