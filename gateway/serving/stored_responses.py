"""Where a stored Responses API response lives, told by its id: the gateway keeps nothing.

vLLM keeps a stored response (`store`, true by default) in the memory of the instance that made it
(VLLM_ENABLE_RESPONSES_API_STORE=1), so a follow-up naming it (`previous_response_id`) must go to that
instance. The id the client gets names the instance, `resp_<tag>_<the instance's id>`, where the tag is
a hash of the instance's name and url (both in the config every worker and replica reads): any of them
routes the follow-up without shared state, and an instance that moved to another server (a new url)
is known not to hold it. The instance itself bounds what it stores and for how long.

A follow-up is routed to that instance alone (within the candidates of the model it names, so a key's
model limits hold); when the instance has left the config, or is cooling down after failures, the
client hears why at once (404, 503) rather than an answer without its history.
"""

from __future__ import annotations

import hashlib

from gateway.api.errors import ApiError
from gateway.config.sections import Config

PREFIX = "resp_"
TAG_CHARS = 12  # hex digits: 48 bits, so two instances of one config never share a tag


def instance_tag(instance) -> str:
    return hashlib.sha256(f"{instance.name}\n{instance.url}".encode()).hexdigest()[:TAG_CHARS]


def client_id(instance, upstream_id: str) -> str:
    """The id the client sees for the instance's response `upstream_id`."""
    return f"{PREFIX}{instance_tag(instance)}_{upstream_id}"


def split_id(given: str) -> tuple[str, str] | None:
    """(tag, the instance's own id) of an id this gateway gave out; None for any other string."""
    tag, sep, upstream = given[len(PREFIX):].partition("_")
    if not given.startswith(PREFIX) or not sep or not upstream or len(tag) != TAG_CHARS \
            or any(c not in "0123456789abcdef" for c in tag):
        return None
    return tag, upstream


def stored_at(cfg: Config, given: str, candidates: tuple[int, ...], routable) -> int:
    """The index of the instance holding the response `given`, if the request may go there; else ApiError.
    `routable(name)`: the instance is not cooling down after failures."""
    parts = split_id(given)
    if parts is None:
        raise ApiError(404, f"Response with id {given!r} not found: it is not an id this gateway gave out",
                       "previous_response_id", "previous_response_not_found")
    tag = parts[0]
    found = next((i for i, inst in enumerate(cfg.instances) if instance_tag(inst) == tag), None)
    if found is None:
        raise ApiError(404, f"the response {given!r} was stored by an instance that is no longer in the pool, so "
                            "it is gone: send the conversation again without previous_response_id",
                       "previous_response_id", "previous_response_gone", final=True)
    inst = cfg.instances[found]
    if found not in candidates:
        raise ApiError(400, f"the response {given!r} was made by the model {inst.model!r}: continue it with that "
                            "model or a routing alias", "model", "previous_response_model")
    if not routable(inst.name):
        raise ApiError(503, f"the instance {inst.name!r} that stored the response {given!r} is down; the response "
                            "can be continued only there, when it is back", "previous_response_id",
                       "previous_response_unavailable", headers={"Retry-After": "2"})
    return found
