"""Who may do what at the edge: API keys and their limits, the admin token, JSON-only POSTs.

The rules live in gateway/tenancy/ (keys, rates) and the config; this module
applies them to an aiohttp request and answers in the OpenAI error shape.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.config.sections import ApiKey, Config
from gateway.tenancy.keys import KeyRing, anonymous_allowed, bearer_token
from gateway.tenancy.ratelimit import RateLimiter

JSON_TYPES = frozenset({"application/json"})


class Access:
    """The keys of the current config, and each key's recent requests."""

    def __init__(self, cfg: Config):
        self.keys = KeyRing(cfg.auth)
        self.rates = RateLimiter()

    def reconfigure(self, cfg: Config) -> None:
        self.keys = KeyRing(cfg.auth)
        self.rates.retain(k.name for k in cfg.auth.keys)

    def authorize(self, request: web.Request, cfg: Config, host: str) -> ApiKey | None:
        """The request's key, None for an anonymous request that may be served; else 401."""
        token = bearer_token(request.headers.get("Authorization"))
        if self.keys:
            key = self.keys.lookup(token) if token is not None else None
            if key is not None:
                return key
            if token is None and cfg.auth.allow_anonymous:
                return None
            raise ApiError(401, "Incorrect API key provided" if token is not None else
                           "You didn't provide an API key: send 'Authorization: Bearer <key>'",
                           None, "invalid_api_key")
        if anonymous_allowed(cfg.auth, host):
            return None  # no keys: whatever the client sends as its key (SDKs always send one) is ignored
        raise ApiError(401, f"this gateway listens on {host} and has no API keys; it serves no anonymous requests",
                       None, "invalid_api_key")

    def permit(self, key: ApiKey | None, req: CompletionRequest, now: float) -> None:
        """The key's rate, model and preset limits; 429 or 403 (every request counts against the rate)."""
        if key is None:
            return
        self.permit_model(key, req.model, now)
        if key.presets:
            if req.routing.weights is not None:
                raise ApiError(403, f"the key {key.name!r} may use only the presets {', '.join(key.presets)}, "
                                    f"not its own weights", "routing.weights", "preset_not_allowed")
            if req.routing.preset is not None and req.routing.preset not in key.presets:
                raise ApiError(403, f"the key {key.name!r} may not use the preset {req.routing.preset!r} "
                                    f"(allowed: {', '.join(key.presets)})", "routing.preset", "preset_not_allowed")

    def permit_model(self, key: ApiKey | None, model: str, now: float) -> None:
        """The key's rate and model limits (what every request answers to, an embeddings one included)."""
        if key is None:
            return
        if key.requests_per_minute is not None:
            wait = self.rates.allow(key.name, key.requests_per_minute, now)
            if wait is not None:
                raise ApiError(429, f"the key {key.name!r} is limited to {key.requests_per_minute} requests a minute",
                               None, "rate_limit_exceeded", headers={"Retry-After": str(max(1, round(wait + 0.5)))})
        if not may_name(key, model):
            raise ApiError(403, f"the key {key.name!r} may not use the model {model!r} "
                                f"(allowed: {', '.join(key.models)})", "model", "model_not_allowed")


def preset_for(key: ApiKey | None, requested: str | None, default: str) -> str | None:
    """The preset a request runs with when its key restricts presets (None: the request's own choice stands)."""
    if key is None or not key.presets or requested is not None:
        return requested
    return default if default in key.presets else key.presets[0]


def request_preset(cfg: Config, routing, key: ApiKey | None) -> str:
    """The preset a request runs with: its own, else one its key allows, else the configured one."""
    return preset_for(key, routing.preset, cfg.scheduler.preset) or cfg.scheduler.preset


def check_admin(request: web.Request, cfg: Config) -> None:
    """Admin endpoints: off (404) without [server].admin_token; else the token, compared in constant time."""
    token = cfg.server.admin_token
    if token is None:
        raise ApiError(404, "admin endpoints are off: set [server].admin_token to use them")
    given = bearer_token(request.headers.get("Authorization")) or ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin_token>'")


@web.middleware
async def json_posts_only(request: web.Request, handler):
    """A POST with a body must say it is JSON: a browser page can post text/plain or a form cross-site
    without a preflight, never application/json."""
    if request.method == "POST" and request.body_exists and request.content_type not in JSON_TYPES:
        raise ApiError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    return await handler(request)


def may_name(key: ApiKey | None, model: str) -> bool:
    """May a request of `key` (None: anonymous) name `model` (a pool model or a routing alias)?"""
    return key is None or not key.models or model in key.models
