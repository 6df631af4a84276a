"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the handlers raise; the app turns it into an OpenAI-style JSON response."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers or self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


def from_status(status: int, message: str) -> APIError:
    """An APIError for a plain HTTP status (unknown route, wrong method, ...)."""
    return APIError(message, status, _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"))
