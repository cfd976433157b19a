"""Builds the drafter named by ``EngineConfig.speculative_method`` (None, "mtp" or "dflash")."""

from __future__ import annotations

from pathlib import Path

from deepinfer_npu.config import EngineConfig

from .drafter import Drafter


def build_drafter(config: EngineConfig, runner) -> Drafter | None:
    method = config.speculative_method
    if method is None:
        return None
    k = config.num_speculative_tokens
    if method == "mtp":
        from .mtp_drafter import MtpDrafter

        return MtpDrafter(runner.model, k, runner.num_kv_blocks, runner.block_size, runner.dtype, runner.device,
                          max_model_len=runner.max_model_len, cache_layout=(runner.kv_dim, runner.kv_cache_dtype))
    if method == "dflash":
        from .dflash import DFlashDrafter

        path = Path(config.speculative_model) if config.speculative_model else config.model_dir / "dflash"
        if not (path / "dflash_config.json").exists():
            raise FileNotFoundError(
                f"speculative_method='dflash' needs a DFlash drafter directory with dflash_config.json; "
                f"none at {path} (pass speculative_model=PATH)"
            )
        _warn_if_other_target(path, config.model_dir)
        num_slots = int(config.max_num_seqs * config.state_slot_ratio) + 1
        return DFlashDrafter.load(path, runner.model, runner.backend, num_state_slots=num_slots,
                                  num_speculative_tokens=k, dtype=runner.dtype)
    raise ValueError(f"unknown speculative_method {method!r}")


def _warn_if_other_target(drafter_dir: Path, model_dir: Path) -> None:
    """A drafter only drafts well for the target it was trained against: warn when the weights differ."""
    import hashlib
    import json
    import logging

    try:
        target = json.loads((drafter_dir / "dflash_config.json").read_text()).get("target") or {}
        want = target.get("model_sha256")
        weights = model_dir / "model.safetensors"
        if want and weights.is_file():
            got = hashlib.sha256(weights.read_bytes()).hexdigest()
            if got != want:
                logging.getLogger(__name__).warning(
                    "DFlash drafter %s was trained against a target with model.safetensors sha256 %s..., but %s has "
                    "%s...: outputs stay exact, acceptance may be poor", drafter_dir, want[:12], model_dir, got[:12])
    except (OSError, ValueError):
        pass
