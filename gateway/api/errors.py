"""OpenAI-shaped errors: every failure the edge reports goes through here."""

from __future__ import annotations

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_budget",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ApiError(Exception):
    """An error to answer with, as OpenAI would: status, message, and the offending param.

    `final` marks a refusal that an immediate retry cannot change (an infeasible SLO, a QoS drop, a policy
    that cannot run): it carries `x-should-retry: false`, which the OpenAI SDKs obey before their own rule
    (they retry 408, 409, 429 and 5xx), so a client hears it once instead of three times.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, final: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if final:
            self.headers["x-should-retry"] = "false"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=self.headers)
