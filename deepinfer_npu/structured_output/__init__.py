"""Structured output with xgrammar: constraint parameters, grammar compilation off the engine thread, a grammar
matcher per request and the token bitmask the sampler applies."""

from deepinfer_npu.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
