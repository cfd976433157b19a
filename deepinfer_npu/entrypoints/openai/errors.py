"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError",
          500: "InternalServerError"}
#: The first word of an engine / SamplingParams error names the parameter ("top_p must be in (0, 1], ...").
_PARAM = re.compile(r"^(?:request '[^']*': )?([a-z_]+(?:\[\d+\])?)\b")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(error: Exception | str, param: str | None = None) -> OpenAIError:
    """A 400 for a client mistake; ``param`` is taken from the message when it starts with a field name."""
    message = str(error)
    if param is None:
        m = _PARAM.match(message)
        param = m.group(1) if m and m.group(1).split("[")[0] in _request_fields() else None
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(int(status), "Error"), "param": param,
                      "code": int(status)}}


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param), status_code=int(e.status), headers=e.headers)


def _request_fields() -> set[str]:
    from deepinfer_npu.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    return set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
