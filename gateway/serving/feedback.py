"""POST /v1/feedback: a client's score for one of its own completions, stored as a "feedback" label.

    {"id": "<the completion's id>", "score": 0.8}      a score in [0, 1] (or a Responses API response's id)
    {"id": "<the completion's id>", "thumbs": "up"}    or "down": 1 or 0

In order: learning must be on (else 404, as for an endpoint that is off) and the caller authenticated
as for completions (401); a key with `learn = false` gets 403; each key, or anonymous client address,
may send `feedback_rate_per_min` calls a minute (429, every call counts); the body is JSON of at most
`feedback_max_bytes` (413) with the fields above (400). The id must be one the gateway still remembers
(gateway/learning/completions.py) and made by the same principal: the same key, or an anonymous request
from the same address; otherwise 404, the same answer for unknown, expired and someone else's ids, so
that no id's existence leaks. An id is rated once: the same score again is answered 200 with
`"duplicate": true`, another score 409. The label is written before the 200, so an accepted feedback
is stored; when the store cannot take it the client hears 503 and may send it again.
"""

from __future__ import annotations

import asyncio
import math
import time

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.config.sections import ApiKey, Config
from gateway.learning.completions import LoggedCompletion, Principal
from gateway.learning.labels import Label
from gateway.learning.store import Added, LabelStoreError
from gateway.serving.body import read_body
from gateway.serving.learner import TrafficLearner
from gateway.serving.metrics import GatewayMetrics
from gateway.tenancy.access import Access
from gateway.tenancy.ratelimit import RateLimiter

THUMBS = {"up": 1.0, "down": 0.0}
FIELDS = ("id", "score", "thumbs")
# Principals whose recent feedback calls are tracked for the rate limit: anonymous clients are counted by
# address, which the traffic chooses, so the one idle longest is forgotten past this many.
MAX_TRACKED_PRINCIPALS = 10_000
_REASONS = {401: "unauthorized", 408: "body_timeout", 413: "too_large"}  # errors raised without a code


class FeedbackHandler:
    def __init__(self, learner: TrafficLearner, access: Access, metrics: GatewayMetrics):
        self.learner = learner
        self.access = access
        self.metrics = metrics
        self.rates = RateLimiter(max_names=MAX_TRACKED_PRINCIPALS)
        # Completion id -> its label's write while it runs: a repeat waits for it rather than answering
        # 200 before the first is stored. Bounded by the feedback calls in flight.
        self._writing: dict[str, asyncio.Future[Added]] = {}

    async def handle(self, request: web.Request, cfg: Config, host: str) -> web.Response:
        try:
            completion_id, duplicate, reason = await self._accept(request, cfg, host)
        except ApiError as e:
            self.metrics.feedback.labels("refused", e.code or _REASONS.get(e.status, str(e.status))).inc()
            raise
        self.metrics.feedback.labels("accepted", reason).inc()
        body = {"id": completion_id, "accepted": True, "source": "feedback", "duplicate": duplicate}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _accept(self, request: web.Request, cfg: Config, host: str) -> tuple[str, bool, str]:
        """(completion id, whether it repeats an accepted feedback, the metric's reason); else ApiError."""
        learner = self.learner
        if learner.store is None or learner.completions is None:
            raise ApiError(404 if not cfg.learning.enabled else 503, f"feedback is not taken: {learner.unavailable}",
                           None, "learning_off")
        key = self.access.authorize(request, cfg, host)
        if key is not None and not key.learn:
            raise ApiError(403, f"learning is off for the key {key.name!r} (learn = false): its feedback is not "
                                "taken", None, "learning_off")
        principal = Principal.of(key.name if key is not None else None, request.remote)
        self._check_rate(principal, cfg)
        raw = await read_body(request, cfg.learning.feedback_max_bytes, cfg.server.body_timeout_s)
        completion_id, score = parse_feedback(raw)
        entry = await learner.completion(completion_id)
        if entry is None or entry.owner != principal:
            raise ApiError(404, f"no completion {completion_id!r} to rate: the id is unknown, has expired "
                                f"(ids are kept {cfg.learning.completion_ttl_s:g} s), or was not answered to "
                                "this caller", "id", "completion_not_found")
        if entry.rating is not None:
            if entry.rating != score:
                raise ApiError(409, f"the completion {completion_id!r} was already rated {entry.rating:g}; a "
                                    "feedback cannot be changed", "score", "feedback_conflict", final=True)
            writing = self._writing.get(completion_id)
            if writing is not None:
                try:
                    _stored(await asyncio.shield(writing))
                except LabelStoreError as e:
                    raise ApiError(503, f"the feedback could not be stored, send it again later: {e}", None,
                                   "label_store_unavailable") from None
            return completion_id, True, "duplicate"
        added = await self._store(entry, score, key, cfg.learning.keep_prompt_text)
        return completion_id, False, "stored" if added == "stored" else "already_labelled"

    def _check_rate(self, principal: Principal, cfg: Config) -> None:
        name = f"key:{principal.key}" if principal.key is not None else f"address:{principal.address}"
        per_minute = cfg.learning.feedback_rate_per_min
        wait = self.rates.allow(name, per_minute, asyncio.get_running_loop().time())
        if wait is not None:
            raise ApiError(429, f"feedback is limited to {per_minute} calls a minute per key or client",
                           None, "rate_limit_exceeded", headers={"Retry-After": str(max(1, round(wait + 0.5)))})

    async def _store(self, entry: LoggedCompletion, score: float, key: ApiKey | None, keep_text: bool) -> Added:
        """Write the feedback label in a thread; the entry counts as rated from now on, unless the write fails."""
        store = self.learner.store
        assert store is not None
        label = Label(entry.prompt_hash, entry.model, "feedback", score, time.time(),
                      entry.prompt if keep_text else None,  # a reload may have turned keeping the text off
                      key=key.name if key is not None else None)
        entry.rating = score
        writing = asyncio.ensure_future(asyncio.to_thread(store.add, label))
        self._writing[entry.id] = writing

        def done(task: asyncio.Future[Added]) -> None:
            self._writing.pop(entry.id, None)
            if task.cancelled() or task.exception() is not None or task.result() == "full":
                entry.rating = None  # not stored: the client may send it again

        writing.add_done_callback(done)
        # Shielded: a client that hangs up does not cancel the write of what it sent.
        try:
            added = _stored(await asyncio.shield(writing))
        except LabelStoreError as e:  # the disk is full, or the store stayed locked: the client may send it again
            raise ApiError(503, f"the feedback could not be stored, send it again later: {e}", None,
                           "label_store_unavailable") from None
        if self.learner.shared is not None:  # so a feedback reaching another process sees this one
            await self.learner.shared.rate(entry.id, score)
        return added


def _stored(added: Added) -> Added:
    """The write's outcome, or the 503 of a store that is full."""
    if added == "full":
        raise ApiError(503, "the label store is full ([learning] max_labels): feedback cannot be stored until "
                            "old labels are deleted or the bound is raised", None, "label_store_full")
    return added


def parse_feedback(raw: bytes) -> tuple[str, float]:
    """(completion id, score in [0, 1]) of a feedback body; ApiError 400 saying what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "the body must be a JSON object: {\"id\": \"<completion id>\", \"score\": 0.0-1.0} or "
                            "{\"id\": ..., \"thumbs\": \"up\"|\"down\"}", None, "invalid_feedback") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got a JSON {type(body).__name__}", None,
                       "invalid_feedback")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (a feedback has: {', '.join(FIELDS)})", unknown[0],
                       "invalid_feedback")
    completion_id = body.get("id")
    if not isinstance(completion_id, str) or not completion_id:
        raise ApiError(400, "id must be the completion's id (a non-empty string, as in the answer's \"id\")", "id",
                       "invalid_feedback")
    if ("score" in body) == ("thumbs" in body):
        raise ApiError(400, "give one of score (a number in [0, 1]) or thumbs (\"up\" or \"down\")", "score",
                       "invalid_feedback")
    if "thumbs" in body:
        thumbs = body["thumbs"]
        if not isinstance(thumbs, str) or thumbs not in THUMBS:
            raise ApiError(400, f"thumbs must be \"up\" or \"down\", got {thumbs!r}", "thumbs", "invalid_feedback")
        return completion_id, THUMBS[thumbs]
    score = body["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
            or not 0 <= score <= 1:
        raise ApiError(400, f"score must be a number in [0, 1], got {score!r}", "score", "invalid_feedback")
    return completion_id, float(score)
