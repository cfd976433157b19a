"""Tokenizer loading with the ``tokenizers`` library (``tokenizer.json``), plus the special-token ids.

The engine only needs ``tokenizer.json`` (every DeepSeek checkpoint ships one). Special ids come from, in
order of precedence:

* ``tokenizer_config.json``: ``bos_token`` / ``eos_token`` (a string or ``{"content": ...}``),
  ``add_bos_token``, ``add_eos_token``;
* ``generation_config.json``: ``bos_token_id`` / ``eos_token_id`` (int or list of ints);
* ``config.json``: ``bos_token_id`` / ``eos_token_id``.

The *primary* EOS is the tokenizer's EOS when known, else the first configured id; ``eos_token_ids`` is the
ordered union of all of them (as vLLM adds ``generation_config`` EOS ids to the stop ids).
:func:`read_special_token_ids` works without a tokenizer, for models served with token-id prompts only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

__all__ = ["Tokenizer", "SpecialTokenIds", "TokenizerLoadError", "load_tokenizer", "read_special_token_ids"]

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"


class TokenizerLoadError(ValueError):
    """A tokenizer or config file exists but cannot be read; the message names the file."""


@dataclass
class SpecialTokenIds:
    """BOS/EOS ids of a model and the BOS/EOS insertion flags from ``tokenizer_config.json``.

    ``add_bos_token`` / ``add_eos_token`` are ``None`` when the config does not say (then ``tokenizer.json``'s
    own post-processor decides).
    """

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None


def _read_json(path: str) -> dict[str, Any] | None:
    """Read a JSON object file; ``None`` if absent; :class:`TokenizerLoadError` naming the file if corrupt."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerLoadError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"cannot parse {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _id_list(value: Any, path: str, key: str) -> list[int]:
    """``eos_token_id``-style value (int, list of ints or None) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TokenizerLoadError(
                f"{path}: {key} must be a non-negative int or a list of them, got {value!r}"
            )
        out.append(v)
    return out


def _token_content(value: Any) -> str | None:
    """``bos_token`` / ``eos_token`` in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _unique(ids: Iterable[int]) -> list[int]:
    seen: set[int] = set()
    out: list[int] = []
    for i in ids:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


def read_special_token_ids(model_dir: str, hf_tokenizer: HFTokenizer | None = None) -> SpecialTokenIds:
    """Collect BOS/EOS ids from the model directory's config files (see the module docstring).

    ``hf_tokenizer`` resolves ``bos_token`` / ``eos_token`` strings of ``tokenizer_config.json`` to ids.
    """
    tok_cfg_path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
    gen_cfg_path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    cfg_path = os.path.join(model_dir, MODEL_CONFIG_FILE)
    tok_cfg = _read_json(tok_cfg_path) or {}
    gen_cfg = _read_json(gen_cfg_path) or {}
    cfg = _read_json(cfg_path) or {}

    def tokenizer_id(key: str) -> int | None:
        content = _token_content(tok_cfg.get(key))
        if content is None or hf_tokenizer is None:
            return None
        return hf_tokenizer.token_to_id(content)

    tok_bos, tok_eos = tokenizer_id("bos_token"), tokenizer_id("eos_token")
    gen_bos = _id_list(gen_cfg.get("bos_token_id"), gen_cfg_path, "bos_token_id")
    cfg_bos = _id_list(cfg.get("bos_token_id"), cfg_path, "bos_token_id")
    gen_eos = _id_list(gen_cfg.get("eos_token_id"), gen_cfg_path, "eos_token_id")
    cfg_eos = _id_list(cfg.get("eos_token_id"), cfg_path, "eos_token_id")

    bos_candidates = ([tok_bos] if tok_bos is not None else []) + gen_bos + cfg_bos
    eos_ids = _unique(([tok_eos] if tok_eos is not None else []) + gen_eos + cfg_eos)

    def flag(key: str) -> bool | None:
        v = tok_cfg.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise TokenizerLoadError(f"{tok_cfg_path}: {key} must be true or false, got {v!r}")
        return v

    return SpecialTokenIds(
        bos_token_id=bos_candidates[0] if bos_candidates else None,
        eos_token_id=eos_ids[0] if eos_ids else None,
        eos_token_ids=eos_ids,
        add_bos_token=flag("add_bos_token"),
        add_eos_token=flag("add_eos_token"),
    )


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with the model's special ids.

    ``encode`` adds BOS (and EOS) as ``tokenizer_config.json`` says; when it says nothing,
    ``tokenizer.json``'s post-processor decides (as transformers' fast tokenizers do).
    """

    def __init__(self, hf_tokenizer: HFTokenizer, special: SpecialTokenIds, path: str | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.path = path
        self.bos_token_id = special.bos_token_id
        self.eos_token_id = special.eos_token_id
        self.eos_token_ids: list[int] = list(special.eos_token_ids)
        self.add_bos_token = special.add_bos_token
        self.add_eos_token = special.add_eos_token
        added = hf_tokenizer.get_added_tokens_decoder()
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids})"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS/EOS are added per the tokenizer config."""
        if not add_special_tokens:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=False).ids)
        if self.add_bos_token is None and self.add_eos_token is None:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=True).ids)
        ids = list(self.hf_tokenizer.encode(text, add_special_tokens=False).ids)
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (byte-level invalid UTF-8 becomes U+FFFD, as in the ``tokenizers`` library)."""
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (``None`` if out of range)."""
        return self.hf_tokenizer.id_to_token(int(token_id))


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """Load ``<model_dir>/tokenizer.json``; ``None`` when the directory has no ``tokenizer.json``.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory.
        TokenizerLoadError: ``tokenizer.json`` or one of the config files is corrupt (the message names
            the file).
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = os.path.join(model_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(model_dir, "tokenizer.model")):
            logger.warning(
                "%s has tokenizer.model but no tokenizer.json; only tokenizer.json is supported, "
                "so only token-id prompts will work",
                model_dir,
            )
        return None
    try:
        hf_tokenizer = HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a plain Exception for malformed files
        raise TokenizerLoadError(f"cannot load tokenizer from {path}: {e}") from e
    special = read_special_token_ids(model_dir, hf_tokenizer)
    return Tokenizer(hf_tokenizer, special, path=path)
