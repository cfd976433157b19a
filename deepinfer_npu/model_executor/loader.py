"""Weight loading: safetensors (one file, several, or sharded with an index), FP8 block dequantisation or FP8
weights kept as loaded (``quantization="fp8"``, see ``quantization/``), MTP layers, and seeded random ("dummy")
weights.

The model describes its checkpoint by name: every parameter whose name is a checkpoint name loads 1:1, and a
module that stores tensors differently declares ``checkpoint_tensors()`` (local names -> shapes),
``load_checkpoint_tensor(name, tensor)`` and ``remapped_params`` (its parameters filled that way); a quantised
module also lists ``fp8_checkpoint_tensors``, which an FP8 checkpoint hands to ``load_checkpoint_fp8(name, weight,
scale_inv)`` as stored (any other FP8 tensor is dequantised to the model dtype first). The loader
checks the checkpoint against that layout before copying anything it reads, so errors name the tensor and
file: missing, unexpected, mis-shaped, or a truncated / corrupt file.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from .dummy_weights import init_dummy_weights
from .models.deepseek import DeepseekForCausalLM
from .quantization.fp8 import dequantize_fp8_block

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # FP8 checkpoints: "<name>.weight_scale_inv" next to "<name>.weight"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor and the file."""


@dataclass
class _Slot:
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    load_fp8: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # (weight, scale_inv), FP8 kept


def _copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)


def checkpoint_layout(model: torch.nn.Module) -> dict[str, _Slot]:
    """Checkpoint tensor name -> expected shape and loader, for every tensor the model needs."""
    layout: dict[str, _Slot] = {}
    remapped: set[str] = set()
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if hasattr(mod, "checkpoint_tensors"):
            fp8 = set(getattr(mod, "fp8_checkpoint_tensors", ()))
            for local, shape in mod.checkpoint_tensors().items():
                layout[prefix + local] = _Slot(
                    tuple(shape), functools.partial(mod.load_checkpoint_tensor, local),
                    functools.partial(mod.load_checkpoint_fp8, local) if local in fp8 else None,
                )
            remapped |= {prefix + p for p in mod.remapped_params}
    for name, param in model.named_parameters():
        if name not in remapped:
            layout[name] = _Slot(tuple(param.shape), functools.partial(_copy_into, param))
    return layout


# ---- reading safetensors -----------------------------------------------------------------------------------
def _open(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): {e}") from e


def _read(handle, name: str, path: str) -> torch.Tensor:
    if name not in handle.keys():
        # The index (model.safetensors.index.json) mapped the tensor to a shard that does not hold it.
        raise CheckpointError(
            f"tensor {name!r} is not in {path}, the shard {INDEX_FILE} assigns it to (stale or wrong index?)"
        )
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {path} (truncated or corrupt?): {e}") from e


def _index_checkpoint(model_dir: str) -> dict[str, str]:
    """Tensor name -> file name, from the index when present, else from every ``*.safetensors`` header."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: malformed index (needs a 'weight_map' object): {e}") from e
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(model_dir, file)):
                raise CheckpointError(f"{index_path} lists shard {file}, which is missing from {model_dir}")
        return dict(weight_map)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    where: dict[str, str] = {}
    for file in files:
        with _open(os.path.join(model_dir, file)) as handle:
            for name in handle.keys():
                where[name] = file
    return where


class _CheckpointReader:
    """Reads tensors by name across the checkpoint's files, dequantising FP8 weights on the way."""

    def __init__(self, model_dir: str, where: dict[str, str], fp8_block: tuple[int, int]) -> None:
        self.model_dir, self.where, self.block = model_dir, where, fp8_block
        self._handles: dict[str, object] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.model_dir, self.where[name])

    def _raw(self, name: str) -> torch.Tensor:
        file = self.where[name]
        if file not in self._handles:
            self._handles[file] = _open(self.path(name))
        return _read(self._handles[file], name, self.path(name))

    def read(self, name: str) -> torch.Tensor:
        """The tensor, FP8 weights dequantised (fp32)."""
        tensor, scale = self.read_pair(name)
        return tensor if scale is None else dequantize_fp8_block(tensor, scale, self.block)

    def read_pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tensor, None)``, or ``(fp8 weight, its weight_scale_inv)`` for an FP8 weight, both as stored."""
        tensor = self._raw(name)
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return tensor, None
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.where:
            raise CheckpointError(f"fp8 tensor {name!r} in {self.path(name)} has no {scale_name!r}")
        scale = self._raw(scale_name)
        if tensor.dim() != 2:
            raise CheckpointError(
                f"fp8 tensor {name!r} in {self.path(name)} has shape {list(tensor.shape)}; block-quantised fp8 "
                "weights must be matrices"
            )
        b0, b1 = self.block
        want = [math.ceil(tensor.shape[0] / b0), math.ceil(tensor.shape[1] / b1)]
        if list(scale.shape) != want:
            raise CheckpointError(
                f"tensor {scale_name!r} in {self.path(scale_name)} has shape {list(scale.shape)}, "
                f"expected {want} for {b0}x{b1} blocks"
            )
        return tensor, scale

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


# ---- loading ----------------------------------------------------------------------------------------------
def load_weights(
    model: DeepseekForCausalLM,
    model_dir: str | os.PathLike | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> None:
    """Fill ``model``'s weights from ``model_dir`` (``load_format="auto"``/``"safetensors"``) or with seeded
    random values (``"dummy"``, no files read). Raises :class:`CheckpointError` / ``FileNotFoundError``."""
    if load_format in ("dummy", "dummy_portable"):
        init_dummy_weights(model, seed, portable=load_format == "dummy_portable")
        return
    if load_format not in ("auto", "safetensors"):
        raise ValueError(f"unknown load_format {load_format!r}; use 'auto', 'safetensors', 'dummy' or "
                         "'dummy_portable'")
    if model_dir is None:
        raise ValueError("load_weights needs model_dir unless load_format='dummy'")
    model_dir = os.fspath(model_dir)
    where = _index_checkpoint(model_dir)
    cfg = model.config

    # transformers saves V3 configs with num_nextn_predict_layers but no MTP weights: drop empty layers.
    n = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers and not any(name.startswith(f"model.layers.{n}.") for name in where):
        logger.warning("checkpoint has no weights for MTP layer %d; the model runs without MTP", n)
        model.drop_mtp_layers()

    layout = checkpoint_layout(model)
    optional = model.optional_checkpoint_tensors() & layout.keys()
    _check_names(layout, optional, where, model_dir, num_layers=n + cfg.num_nextn_predict_layers,
                 skipped=skipped_checkpoint_names(model))
    reader = _CheckpointReader(model_dir, where, cfg.fp8_block_size or (128, 128))
    try:
        # File by file, so each shard is opened once and read sequentially.
        for name in sorted(layout.keys() & where.keys(), key=lambda k: (where[k], k)):
            slot = layout[name]
            tensor, scale = reader.read_pair(name)
            if scale is not None and (slot.load_fp8 is None or tensor.dtype != torch.float8_e4m3fn):
                tensor, scale = dequantize_fp8_block(tensor, scale, reader.block), None
            if not tensor.is_floating_point():
                raise CheckpointError(
                    f"tensor {name!r} in {reader.path(name)} has dtype {tensor.dtype}; weights must be floating "
                    "point (bf16 / fp16 / fp32, or fp8 with weight_scale_inv)"
                )
            if tuple(tensor.shape) != layout[name].shape:
                raise CheckpointError(
                    f"tensor {name!r} in {reader.path(name)} has shape {list(tensor.shape)}, "
                    f"expected {list(layout[name].shape)}"
                )
            if scale is None:
                slot.load(tensor)
                continue
            try:
                slot.load_fp8(tensor, scale)
            except ValueError as e:
                raise CheckpointError(f"tensor {name!r} in {reader.path(name)}: {e}") from e
    finally:
        reader.close()
    for name in sorted(optional - where.keys()):
        model.tie_missing(name)


def skipped_checkpoint_names(model: torch.nn.Module) -> set[str]:
    """Tensors of the checkpoint this process does not read (routed experts other expert-parallel ranks hold)."""
    skipped: set[str] = set()
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "skipped_checkpoint_tensors"):
            skipped |= {f"{mod_name}.{local}" for local in mod.skipped_checkpoint_tensors()}
    return skipped


def _check_names(
    layout: dict[str, _Slot], optional: set[str], where: dict[str, str], model_dir: str, num_layers: int,
    skipped: set[str] = frozenset(),
) -> None:
    """Raise for the first unexpected or missing tensor, before any weight is read."""

    def ignored(name: str) -> bool:
        # Layers past the model (e.g. MTP layers with num_nextn_predict_layers overridden to 0), the rotary
        # caches some old checkpoints carry and other ranks' experts are not weights of this process.
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return (m is not None and int(m.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq") \
            or name in skipped

    for name, file in sorted(where.items()):
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if base not in layout and not ignored(base):
            path = os.path.join(model_dir, file)
            raise CheckpointError(f"unexpected tensor {name!r} in {path} (not part of the model)")
    files = set(where.values())
    for name in sorted(layout.keys() - where.keys() - optional):
        expected = (
            f"expected in {next(iter(files))}" if len(files) == 1 else f"not in any shard or {INDEX_FILE}"
        )
        raise CheckpointError(f"missing tensor {name!r} ({expected}, model directory {model_dir})")
