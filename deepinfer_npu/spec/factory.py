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

        return MtpDrafter(runner.model, k, runner.num_kv_blocks, runner.block_size, runner.dtype, runner.device)
    if method == "dflash":
        from .dflash import DFlashDrafter

        path = Path(config.speculative_model) if config.speculative_model else config.model_dir / "dflash"
        if not (path / "dflash_config.json").exists():
            raise FileNotFoundError(
                f"speculative_method='dflash' needs a DFlash drafter directory with dflash_config.json; "
                f"none at {path} (pass speculative_model=PATH)"
            )
        num_slots = int(config.max_num_seqs * config.state_slot_ratio) + 1
        return DFlashDrafter.load(path, runner.model, runner.backend, num_state_slots=num_slots,
                                  num_speculative_tokens=k, dtype=runner.dtype)
    raise ValueError(f"unknown speculative_method {method!r}")
