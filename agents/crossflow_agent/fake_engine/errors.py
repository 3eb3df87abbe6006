"""Errors the fake engine answers with, in the two shapes it speaks.

:class:`ApiError` is an OpenAI-style error (the API routes, as vLLM and SGLang answer them):
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``.
:class:`ControlError` is the fake's own control routes' shape: ``{"error": "field: message"}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import ValidationError

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "InternalServerError")
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> web.Response:
        return web.json_response({"error": self.message}, status=self.status)


def first_error(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """The first validation error as (field path, message): ``("messages.0.role", "...")``."""
    err = exc.errors(include_url=False)[0]
    path = ".".join(str(p) for p in err["loc"])
    field = f"{prefix}.{path}" if prefix and path else (prefix or path or "body")
    return field, str(err["msg"])


def bad_request(exc: ValidationError, prefix: str = "") -> ApiError:
    field, msg = first_error(exc, prefix)
    return ApiError(400, f"{field}: {msg}", field)
