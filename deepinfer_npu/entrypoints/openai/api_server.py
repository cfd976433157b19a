"""The FastAPI application: OpenAI-compatible routes over an :class:`AsyncLLM`.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (200 while the
engine runs, 503 after it died), ``GET /metrics`` (Prometheus text). Every client mistake is a 400 with an
OpenAI-style error body naming the field; a full waiting queue is a 503 with ``Retry-After``; the engine keeps
serving everyone else. A client that disconnects has its requests aborted.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer_npu.entrypoints.async_llm import AsyncLLM
from deepinfer_npu.entrypoints.chat_template import ChatTemplate
from deepinfer_npu.entrypoints.metrics import ServerMetrics
from deepinfer_npu.entrypoints.openai.errors import OpenAIError, error_body, error_response
from deepinfer_npu.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer_npu.entrypoints.openai.serving_base import now_s, until_disconnected
from deepinfer_npu.entrypoints.openai.serving_chat import OpenAIServingChat
from deepinfer_npu.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(llm: AsyncLLM, served_model_name: str, chat_template: ChatTemplate | None,
              metrics: ServerMetrics | None = None, retry_after_s: int = 1) -> FastAPI:
    app = FastAPI(title="deepinfer_npu", docs_url=None, redoc_url=None)
    completion = OpenAIServingCompletion(llm, served_model_name, retry_after_s)
    chat = OpenAIServingChat(llm, served_model_name, chat_template, retry_after_s)
    app.state.llm = llm
    created = now_s()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return JSONResponse(error_body(503, llm._dead_message()), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "deepinfer_npu", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response(status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _run(serving, body, request: Request):
        if body.stream:
            lines = await serving.start_stream(body)
            return StreamingResponse(lines, media_type="text/event-stream", headers=SSE_HEADERS)
        result = await until_disconnected(request, serving.create(body))
        if result is None:  # the client went away; its requests were aborted
            return Response(status_code=499)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _run(completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _run(chat, body, request)

    return app


def describe_routes(app: FastAPI) -> list[dict[str, Any]]:
    """``[{"path", "methods"}]`` of the served routes (printed at start-up)."""
    return [{"path": r.path, "methods": sorted(getattr(r, "methods", []) or [])} for r in app.routes
            if getattr(r, "path", "").startswith(("/v1", "/health", "/metrics"))]

