"""Tokenizer loading, special ids from the config files, error messages naming the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deepinfer_npu.engine.tokenizer import TokenizerLoadError, load_tokenizer, read_special_token_ids


def _copy_tokenizer(src: str, dst: str, **configs: dict) -> str:
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    for name, data in configs.items():
        with open(os.path.join(dst, f"{name}.json"), "w") as f:
            json.dump(data, f)
    return dst


def test_load_and_special_ids(bpe_tokenizer) -> None:
    tok = bpe_tokenizer
    assert tok.vocab_size == 300 and len(tok) == 300
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.eos_token_ids == [1, 2]  # tokenizer's EOS first, then generation_config's list
    assert tok.all_special_ids == {0, 1, 2}
    ids = tok.encode("Grüße 深度")
    assert ids[0] == tok.bos_token_id  # add_bos_token: true
    assert tok.decode(ids) == "Grüße 深度"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>Grüße 深度"
    assert tok.encode("Grüße", add_special_tokens=False)[0] != tok.bos_token_id
    assert "vocab_size=300" in repr(tok)


def test_no_tokenizer_json(tmp_path) -> None:
    assert load_tokenizer(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))


def test_corrupt_tokenizer_json_names_the_file(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    assert issubclass(TokenizerLoadError, ValueError)


def test_corrupt_config_names_the_file(bpe_dir, tmp_path) -> None:
    d = _copy_tokenizer(bpe_dir, str(tmp_path / "m"))
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(TokenizerLoadError, match="generation_config.json"):
        load_tokenizer(d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": "two"}, f)
    with pytest.raises(TokenizerLoadError, match="generation_config.json.*eos_token_id"):
        load_tokenizer(d)


def test_eos_from_config_json_int_or_list(bpe_dir, tmp_path) -> None:
    d = _copy_tokenizer(bpe_dir, str(tmp_path / "a"), config={"bos_token_id": 0, "eos_token_id": 1})
    tok = load_tokenizer(d)
    assert tok is not None
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, [1])
    assert tok.add_bos_token is None
    # No tokenizer_config: the post-processor (none here) decides, so no BOS is added.
    assert tok.encode("ab")[0] != 0
    d = _copy_tokenizer(
        bpe_dir, str(tmp_path / "b"), config={"eos_token_id": 1}, generation_config={"eos_token_id": [2, 1]}
    )
    assert load_tokenizer(d).eos_token_ids == [2, 1]
    # Without any tokenizer the ids are still available for token-id prompts.
    os.remove(os.path.join(d, "tokenizer.json"))
    assert load_tokenizer(d) is None
    special = read_special_token_ids(d)
    assert special.eos_token_id == 2 and special.eos_token_ids == [2, 1] and special.bos_token_id is None


def test_add_eos_token_flag(bpe_dir, tmp_path) -> None:
    d = _copy_tokenizer(
        bpe_dir,
        str(tmp_path / "c"),
        tokenizer_config={
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "add_bos_token": False,
            "add_eos_token": True,
        },
    )
    ids = load_tokenizer(d).encode("hi")
    assert ids[0] != 0 and ids[-1] == 1
