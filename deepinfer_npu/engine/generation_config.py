"""Sampling defaults from a model directory's ``generation_config.json``, read as vLLM does.

vLLM takes ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty`` from the checkpoint's
generation config as the defaults of requests that give no ``SamplingParams`` (``do_sample`` is not consulted).
Other keys are left out, and so are values ``SamplingParams`` would reject, with a warning.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from deepinfer_npu.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def load_generation_defaults(model_dir: str | Path) -> dict:
    """``{"temperature": ..., "top_k": ..., ...}`` (only the keys present); ``{}`` without the file."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: not readable JSON (%s)", path, e)
        return {}
    if not isinstance(data, dict):
        logger.warning("ignoring %s: expected a JSON object", path)
        return {}
    defaults = {k: data[k] for k in _KEYS if data.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        logger.warning("ignoring the sampling defaults of %s: %s", path, e)
        return {}
    return defaults
