"""One exception tree for everything the gateway answers with an error.

Every error leaves the gateway in one shape, ``{"error": {"message", "type", "param", "code"}}``, with a status
code the official ``openai`` client maps to its exception classes::

    APIError                     500 internal_error
    ├── BadRequest               400 invalid_request_error   (openai.BadRequestError)
    │   └── ContextTooLong       400 (code context_length_exceeded)
    ├── Unauthorized             401 authentication_error    (openai.AuthenticationError)
    ├── Forbidden                403 permission_error        (openai.PermissionDeniedError)
    ├── NotFound                 404 not_found_error         (openai.NotFoundError)
    ├── RateLimited              429 rate_limit_error        (openai.RateLimitError)
    └── EngineError              502 upstream_error          (openai.InternalServerError)
        ├── EngineUnavailable    503 service_unavailable
        └── EngineTimeout        504 timeout

Engines raise these too, so a vLLM 400 (say, a prompt over the context window) reaches the client as the same
400 a local engine would give.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class APIError(Exception):
    status_code = 500
    type = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        # Seconds a client should wait before trying again (sent as Retry-After), for refusals that will pass.
        self.retry_after = retry_after
        # The calls this error ended (recorded failed), named in the response as a success names its calls.
        self.calls: dict[str, str] = {}

    @property
    def headers(self) -> dict[str, str] | None:
        headers = dict(self.calls)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return headers or None

    def of_calls(self, call_ids: Iterable[str], rollout_ids: Iterable[str]) -> None:
        """Name the calls this error ended: a client can look them up (or match them to what was recorded)."""
        self.calls = call_headers(call_ids, rollout_ids)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_anthropic(self) -> dict[str, Any]:
        """The Anthropic Messages API's error shape (the anthropic SDK picks its exception by status code)."""
        return {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(self.status_code, "api_error"), "message": self.message},
        }


def call_headers(call_ids: Iterable[str], rollout_ids: Iterable[str]) -> dict[str, str]:
    """The headers naming a response's calls and their rollouts (a success's and a failure's alike)."""
    return {
        "x-clawgate-call-id": ",".join(call_ids),
        "x-clawgate-rollout-id": ",".join(dict.fromkeys(rollout_ids)),
    }


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


class BadRequest(APIError):
    status_code = 400
    type = "invalid_request_error"


class ContextTooLong(BadRequest):
    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class Unauthorized(APIError):
    status_code = 401
    type = "authentication_error"


class Forbidden(APIError):
    status_code = 403
    type = "permission_error"


class NotFound(APIError):
    status_code = 404
    type = "not_found_error"


class Conflict(APIError):
    """The request contradicts the current state (a version that is not undecided cannot be promoted)."""

    status_code = 409
    type = "conflict_error"


class RateLimited(APIError):
    status_code = 429
    type = "rate_limit_error"


class EngineError(APIError):
    status_code = 502
    type = "upstream_error"


class EngineUnavailable(EngineError):
    status_code = 503
    type = "service_unavailable"


class EngineTimeout(EngineError):
    status_code = 504
    type = "timeout"
