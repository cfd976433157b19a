"""``LLM``: the vLLM-style offline entry point (``LLM(...).generate(prompts, sampling_params)``)."""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import threading
import time
from collections.abc import Sequence

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.llm_engine import LLMEngine
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict | Sequence[int]


def create_engine(config: EngineConfig):
    """The engine a configuration asks for: one ``LLMEngine`` in this process, or the front-end over
    data-parallel rank processes (``data_parallel_size > 1``, or one process per rank under torchrun)."""
    from deepinfer_npu.distributed.torchrun import launched_by_torchrun

    if config.data_parallel_size > 1 or launched_by_torchrun():
        from deepinfer_npu.distributed.dp_engine import DPEngine

        return DPEngine(config)
    return LLMEngine(config)


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
        self.llm_engine = create_engine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` uses when given none: the model's ``generation_config.json`` defaults."""
        return self.llm_engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``, one ``RequestOutput``
        per prompt holding ``SamplingParams.n`` completions.

        All prompts and parameters are validated before any is queued, so one bad entry raises ``ValueError`` /
        ``TypeError`` (naming its index) and leaves nothing queued. ``sampling_params=None`` takes
        :meth:`get_default_sampling_params`. Safe to call from several threads at once: concurrent calls share
        the engine's steps and each returns only its own requests; requests added through ``llm_engine``
        keep going to that caller's ``step()``.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Number)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        engine = self.llm_engine
        waiter = _Waiter(len(prompts))
        with engine.lock:
            ids = [f"gen-{next(self._ids)}" for _ in prompts]
            engine.add_requests(zip(ids, prompts, params_list), output_sink=waiter.deliver)
        return self._wait(waiter, ids, use_tqdm)

    def _wait(self, waiter: _Waiter, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until this call's requests finished. Whichever waiting thread holds the engine lock
        steps for all of them; the others check every few milliseconds whether their own requests are done."""
        engine = self.llm_engine
        bar = _ProgressBar(len(ids)) if use_tqdm and ids else None
        try:
            while not waiter.done.is_set():
                if not engine.lock.acquire(timeout=0.005):
                    continue
                try:
                    if waiter.done.is_set():
                        break
                    if not engine.has_unfinished_requests():
                        missing = [rid for rid in ids if rid not in waiter.final]
                        raise RuntimeError(f"engine stopped with {len(missing)} requests unfinished: {missing[:5]}")
                    engine.step_for_sinks()
                finally:
                    engine.lock.release()
                if bar is not None:
                    bar.show(len(waiter.final), waiter.num_tokens())
        finally:
            if bar is not None:
                bar.close(len(waiter.final), waiter.num_tokens())
        outputs = [waiter.final[rid] for rid in ids]
        preempted = sum(1 for o in outputs if any(c.finish_reason == "preempted" for c in o.outputs))
        if preempted:
            logger.warning(
                "%d of %d requests were preempted for lack of KV cache blocks and finished early "
                "(finish_reason='preempted'); raise num_kv_blocks / lower max_num_seqs, or pass "
                "stop_preempted_request=False (CLI: --recompute-preempted) to recompute them instead",
                preempted, len(ids))
        return outputs


class _Waiter:
    """The output sink of one ``generate`` call: token counts so far, final outputs, and ``done`` once all of
    its requests finished. Called by whichever thread runs the step."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests
        self.final: dict[str, RequestOutput] = {}
        self.tokens: dict[str, int] = {}
        self.done = threading.Event()
        if num_requests == 0:
            self.done.set()

    def deliver(self, out: RequestOutput) -> None:
        self.tokens[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self.final[out.request_id] = out
            if len(self.final) == self.num_requests:
                self.done.set()

    def num_tokens(self) -> int:
        return sum(self.tokens.values())


class _ProgressBar:
    """Finished requests as the bar, generated tokens and their rate as the postfix, redrawn as tokens come."""

    MIN_INTERVAL_S = 0.1

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, unit="req")
        self.t0 = self.last_draw = time.perf_counter()

    def show(self, finished: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and finished == self.bar.n and now - self.last_draw < self.MIN_INTERVAL_S:
            return
        self.last_draw = now
        rate = tokens / max(now - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{tokens} tok generated, {rate:.1f} tok/s", refresh=False)
        self.bar.n = finished
        self.bar.refresh()

    def close(self, finished: int, tokens: int) -> None:
        rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{tokens} tok generated, {rate:.1f} tok/s", refresh=False)
        self.bar.n = finished
        self.bar.close()  # draws the final state once
