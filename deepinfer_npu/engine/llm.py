"""``LLM``: the vLLM-style offline entry point (``LLM(...).generate(prompts, sampling_params)``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.llm_engine import LLMEngine
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict | Sequence[int]


class LLM:
    """Generate completions with a DeepSeek-family model.

    ``model=None`` loads the small reference model shipped in the package. Keyword arguments are those of
    :class:`deepinfer_npu.config.EngineConfig` (``backend``, ``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``block_size``, ``num_kv_blocks``, ``seed``, ...).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        backend: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        block_size: int = 64,
        num_kv_blocks: int | None = None,
        seed: int = 0,
        **kwargs,
    ) -> None:
        import dataclasses

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s) {unknown}; engine options are: {sorted(known)}")
        config = EngineConfig(
            model=model, backend=backend, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            block_size=block_size, num_kv_blocks=num_kv_blocks, seed=seed, **kwargs,
        )
        self.llm_engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        All prompts are validated before any is queued, so one bad prompt raises ``ValueError`` (naming its index)
        without leaving the others half-submitted.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        engine = self.llm_engine
        for i, prompt in enumerate(prompts):
            engine._tokenize(f"prompt {i}", prompt)  # raises ValueError naming the prompt index

        ids = []
        for prompt, params in zip(prompts, params_list):
            rid = f"gen-{self._counter}"
            self._counter += 1
            engine.add_request(rid, prompt, params)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm and ids:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, unit="req")
        t0 = time.perf_counter()
        generated = 0
        engine = self.llm_engine
        while len(final) < len(ids) and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in wanted and out.request_id not in final:
                    final[out.request_id] = out
                    generated += len(out.outputs[0].token_ids)
                    if bar is not None:
                        bar.update(1)
                        elapsed = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s")
        if bar is not None:
            bar.close()
        preempted = sum(1 for rid in ids if rid in final and final[rid].outputs[0].finish_reason == "preempted")
        if preempted:
            logger.warning(
                "%d of %d requests were preempted for lack of KV cache blocks and finished early "
                "(finish_reason='preempted'); raise num_kv_blocks / lower max_num_seqs, or pass "
                "stop_preempted_request=False to recompute them instead", preempted, len(ids))
        missing = [rid for rid in ids if rid not in final]
        if missing:
            raise RuntimeError(f"engine stopped with {len(missing)} requests unfinished: {missing[:5]}")
        return [final[rid] for rid in ids]
