"""`llmd`: llm-d's default scheduling profile: three scorers weighted 3 : 2 : 2, the highest total wins.

llm-d's inference scheduler runs the Gateway API Inference Extension's
endpoint picker; its default profile (kubernetes-sigs/
gateway-api-inference-extension `config/charts/inferencepool/templates/
epp-config.yaml`, `default-plugins.yaml`, which llm-d's inference-scheduling
guide deploys) weights `prefix-cache-scorer` 3, `queue-scorer` 2 and
`kv-cache-utilization-scorer` 2. Each scorer gives every candidate a score
in [0, 1] (the framework clamps it), the profile adds them up times their
weights (`pkg/epp/scheduling/framework/scheduler_profile.go`, a plain
weighted sum, not divided by the weights' total), and `max-score-picker`
takes the highest, ties at random (it shuffles before a stable sort:
`pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go`).

Per candidate i:

- prefix: matched blocks / the prompt's blocks
  (`pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`, `Score`),
  0 for a prompt without a block. Here `cached_tokens[i] / input_tokens`
  from the gateway's prefix index (the last prompt token is never counted
  cached, so a fully held prompt scores just under 1); 0 when the gateway
  looks at no prefixes.
- queue: `(max_q - q_i) / (max_q - min_q)` over the candidates, 1 for all
  when every queue is equal (`pkg/epp/scheduling/framework/plugins/scorer/
  queue.go`). q is the waiting queue only (`WaitingQueueSize`, vLLM's
  `vllm:num_requests_waiting`), running requests are not counted: here
  `view.waiting`.
- KV cache: `1 - kv_usage` (`.../plugins/scorer/kvcache_utilization.go`,
  `KVCacheUsagePercent` as a fraction): here `view.kv_usage`.

Total = 3 prefix + 2 queue + 2 KV (the weights are options). The ranked
list is every usable candidate by total, highest first. Each decision is
dead-reckoned on the view (its prompt blocks, a running or waiting slot), so
later requests of a batch see the earlier ones' prompts; llm-d's scorers
read only the last scrape, so the queue and KV scores move within a batch
only as far as the view's dead reckoning moves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.prefix.common import cached_tokens, match_share, ranked

NAME = "llmd"


@section
class LlmdOptions(Section):
    """[policies.llmd]: the scorers' weights (llm-d's default profile: 3, 2, 2)."""

    prefix_weight: float = option(3.0, ge=0)  # prefix-cache-scorer: share of the prompt's blocks held
    queue_weight: float = option(2.0, ge=0)  # queue-scorer: waiting queue, min-max normalised (1: the shortest)
    kv_weight: float = option(2.0, ge=0)  # kv-cache-utilization-scorer: 1 - KV-cache usage
    seed: int = 0  # tie-breaks


def queue_score(waiting: np.ndarray) -> np.ndarray:
    """llm-d's queue scorer: 1 for the shortest waiting queue, 0 for the longest, linear between; 1 for all when
    every queue is equal."""
    if len(waiting) == 0:
        return np.zeros(0)
    hi, lo = float(waiting.max()), float(waiting.min())
    if hi == lo:
        return np.ones(len(waiting))
    return (hi - waiting) / (hi - lo)


def kv_score(kv_usage: np.ndarray) -> np.ndarray:
    """llm-d's KV-cache utilisation scorer: the free share of the KV cache."""
    return np.clip(1.0 - kv_usage, 0.0, 1.0)


@dataclass(frozen=True, slots=True)
class Scores:
    """One request's scores over its candidates (in `Decision.detail`, for metrics and tests)."""

    candidates: tuple[int, ...]
    prefix: np.ndarray
    queue: np.ndarray
    kv: np.ndarray
    total: np.ndarray


class Llmd(Policy):
    name = NAME

    def __init__(self, options: LlmdOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def scores(self, req: RouteRequest, cands: Sequence[int], view: PoolView) -> tuple[Scores, np.ndarray | None]:
        """The three scores and their weighted total per candidate, and the tokens each holds cached (None: not
        known)."""
        o = self.options
        idx = np.asarray(cands, dtype=np.int64)
        cached = cached_tokens(view, req, idx)
        prefix = match_share(cached, req.input_tokens, len(idx))
        queue = queue_score(view.waiting[idx].astype(float))
        kv = kv_score(view.kv_usage[idx].astype(float))
        total = o.prefix_weight * prefix + o.queue_weight * queue + o.kv_weight * kv
        return Scores(tuple(cands), prefix, queue, kv, total), cached

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        decisions = []
        for req in batch:
            cands = view.usable(req.candidates)
            scores, cached = self.scores(req, cands, view)
            order = ranked(cands, self.rng, -scores.total)  # the highest total first, ties at random
            chosen = order[0]
            held = None if cached is None else float(cached[cands.index(chosen)])
            view.dispatched(chosen, 0.0, req.input_tokens, req.prefix)  # dead reckoning: the next request sees it
            decisions.append(Decision(tuple(order), cached_tokens=held, detail=scores))
        return decisions


def build(context: PolicyContext) -> Llmd:
    return Llmd(context.options(NAME))


OPTIONS = {NAME: LlmdOptions}
ENTRIES = (PolicyEntry(NAME, build, "baseline: llm-d's default scheduling profile: prefix-cache, waiting-queue and "
                       "free-KV-cache scores weighted 3 : 2 : 2, the highest total wins", reads_prefixes=True),)
