"""Grammars compiled with xgrammar, off the engine thread.

:class:`GrammarCompilerPool` builds xgrammar's tokenizer info once from the model's tokenizer (``tokenizer.json``'s
vocabulary and decoder type), checks a constraint synchronously when a request arrives (parsing a schema or
regex is cheap, so a bad one is a ``ValueError`` naming it) and compiles it in a thread pool; compiled grammars
are cached by constraint, and a constraint being compiled is shared by every request that asks for it.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import xgrammar as xgr

from deepinfer_npu.structured_output.params import StructuredOutputsParams

__all__ = ["GrammarCompilerPool", "tokenizer_info"]


def _vocab_type(backend_json: str) -> xgr.VocabType:
    decoder = json.loads(backend_json).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` (an engine :class:`~deepinfer_npu.engine.tokenizer.Tokenizer`) for a
    model whose logits have ``vocab_size`` entries (ids the tokenizer lacks are never allowed)."""
    hf = tokenizer.hf_tokenizer
    encoded = [""] * vocab_size
    for token, idx in hf.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    return xgr.TokenizerInfo(encoded, _vocab_type(hf.to_str()), vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids) or None)


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Parse the constraint (raises ``ValueError`` naming it)."""
    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(params.json if isinstance(params.json, str) else json.dumps(params.json),
                                                any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":  # OpenAI's JSON mode: an object, any keys
            return xgr.Grammar.from_json_schema('{"type": "object"}',
                                                any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad input
        raise ValueError(f"structured_outputs.{kind} is invalid: {str(e).strip().splitlines()[0]}") from None


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 2) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._futures: dict[tuple, concurrent.futures.Future] = {}

    def check(self, params: StructuredOutputsParams) -> None:
        """Parse the constraint now; compiling waits for :meth:`compile`."""
        _grammar(params)

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the ``xgr.CompiledGrammar`` (shared by equal constraints; kept once done)."""
        key = params.cache_key()
        with self._lock:
            future = self._futures.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(lambda: self._compiler.compile_grammar(_grammar(params)))
                self._futures[key] = future
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
