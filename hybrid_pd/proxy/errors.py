"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.kind = kind

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
