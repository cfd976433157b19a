"""A sharded checkpoint whose index assigns a tensor to the wrong shard: the error blames the index."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file, save_file

from deepinfer_npu.model_executor.loader import CheckpointError

from .tiny_models import load_ours, make_hf_model, save_hf


def test_wrong_shard_in_index_is_named(tmp_path):
    hf = make_hf_model("v3", num_hidden_layers=2, first_k_dense_replace=1, n_group=2, topk_group=1)
    d = save_hf(hf, str(tmp_path))
    sd = load_file(os.path.join(d, "model.safetensors"))
    names = sorted(sd)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    os.remove(os.path.join(d, "model.safetensors"))
    save_file({k: sd[k] for k in first}, os.path.join(d, "a.safetensors"), metadata={"format": "pt"})
    save_file({k: sd[k] for k in second}, os.path.join(d, "b.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "a.safetensors" for k in first} | {k: "b.safetensors" for k in second}
    weight_map[first[0]] = "b.safetensors"  # stale index entry
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match=rf"{first[0]}.*b\.safetensors.*index"):
        load_ours(d)
