"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ProxyError(Exception):
    """A failure the client sees. `kind` labels the failures metric (None: not counted)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        kind: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.kind = kind
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def overloaded(message: str, retry_after_s: int = 1) -> ProxyError:
    """429: every worker's queue is full (and the proxy's hold bound is reached)."""
    return ProxyError(
        429, message, code="overloaded", kind="overloaded", retry_after_s=retry_after_s
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
