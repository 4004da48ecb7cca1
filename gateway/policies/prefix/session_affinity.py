"""`session_affinity`: every request of a conversation to one instance, by rendezvous hashing.

The affinity baseline of the routers in front of vLLM (vllm-router's
`consistent_hash` and `rendezvous_hash` policies, llm-d's session-affinity
scorer): a conversation's turns share their prefix, so sending them all to
one instance reuses its cache without any index of what it holds.

- The key: the request's session (`RouteRequest.session`: OpenAI's `user`
  field live, the conversation in the simulator); without one, the chained
  hash of the prompt's first `prefix_blocks` blocks (fewer if the prompt
  has fewer), so a conversation sent without a session id still sticks by
  its opening (a prompt shorter than `prefix_blocks` blocks keys by all it
  has, so its next, longer turn may move once). Prompts that share an
  opening that long (a long system prompt) share an instance: the price of
  keying by text.
- The instance: highest random weight (rendezvous) hashing. Each candidate's
  weight is a 64-bit blake2b of the key and the instance's name; the heaviest
  takes the request, the rest follow by weight for retries. The hash is the
  same in every process and on every restart, and an instance coming or
  going moves only the keys it wins or won.
- An instance not available (`view.usable`) is skipped: its keys go to their
  next by weight, and come back when it does.
- A request with neither a session nor a hashed prompt (the prompt shorter
  than a block, [scheduler] prefix_cache = "off") goes to the candidate with
  the fewest requests in flight (ties: fewest running and waiting, then at
  random, from a seeded generator).

Load is ignored for keyed requests: a hot conversation stays where it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.prefix.common import cached_tokens, ranked

NAME = "session_affinity"


@section
class SessionAffinityOptions(Section):
    """[policies.session_affinity]: what keys a request without a session id."""

    prefix_blocks: int = option(4, ge=1)  # without a session: the key is the hash of the prompt's first blocks
    seed: int = 0  # tie-breaks of requests without a key (least loaded)


def session_key(req: RouteRequest, prefix_blocks: int) -> bytes | None:
    """What a request sticks by: its session, else its prompt's opening blocks (a chained hash names all before
    it), else None."""
    if req.session:  # an empty `user` names no conversation
        return b"session:" + req.session.encode("utf-8", "surrogatepass")
    if req.prefix:
        return b"prefix:" + str(req.prefix[min(prefix_blocks, len(req.prefix)) - 1]).encode()
    return None


def weight(key: bytes, instance: str) -> int:
    """The rendezvous weight of `instance` for `key`: stable across processes, runs and Python versions."""
    h = hashlib.blake2b(key, digest_size=8)
    h.update(b"\x00" + instance.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "big")


def rendezvous(key: bytes, cands: Sequence[int], names: Sequence[str]) -> list[int]:
    """`cands` by their weight for `key`, heaviest first (ties, which need a 64-bit collision, by name)."""
    return sorted(cands, key=lambda i: (-weight(key, names[i]), names[i]))


class SessionAffinity(Policy):
    name = NAME

    def __init__(self, options: SessionAffinityOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        names = [inst.name for inst in view.instances]
        decisions = []
        for req in batch:
            cands = view.usable(req.candidates)
            key = session_key(req, self.options.prefix_blocks)
            if key is not None:
                order = rendezvous(key, cands, names)
            else:
                idx = np.asarray(cands, dtype=np.int64)
                order = ranked(cands, self.rng, view.in_flight[idx], view.active[idx])
            chosen = order[0]
            cached = cached_tokens(view, req, np.asarray([chosen], dtype=np.int64))
            view.dispatched(chosen, 0.0, req.input_tokens, req.prefix)  # dead reckoning: the next request sees it
            decisions.append(Decision(tuple(order), cached_tokens=None if cached is None else float(cached[0]),
                                      detail="keyed" if key is not None else "least_loaded"))
        return decisions


def build(context: PolicyContext) -> SessionAffinity:
    return SessionAffinity(context.options(NAME))


OPTIONS = {NAME: SessionAffinityOptions}
ENTRIES = (PolicyEntry(NAME, build, "baseline: session affinity: rendezvous hashing of the conversation (its session "
                       "id, else its prompt's opening blocks) onto one instance; without either, the least loaded",
                       reads_prefixes=True),)
