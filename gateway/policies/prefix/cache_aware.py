"""`cache_aware`: vllm-router's and SGLang's cache-aware load balancing, on the gateway's prefix index.

The upstream policy (vllm-project/router `src/policies/cache_aware.rs`, and
SGLang's `sgl-router/src/policies/cache_aware.rs` it was forked from) keeps
an approximate radix tree per model of the text of every request it sent to
each worker, and decides each request thus:

1. Load is each worker's count of requests the router has on it (its
   `load()`: active requests, incremented at dispatch and decremented at the
   end). The pool is imbalanced when both
   `max_load - min_load > balance_abs_threshold` and
   `max_load > min_load * balance_rel_threshold`; then the least loaded
   worker takes the request, whatever it holds.
2. Otherwise the worker with the longest prefix match in the tree takes it,
   if its match rate (matched characters / request characters) is above
   `cache_threshold`.
3. Otherwise (a low match): vllm-router sends it to the least loaded worker
   (`low_match = "least_loaded"`, the default, as in the router this gateway
   is compared with); SGLang's router, and vllm-router's own header comment,
   to the worker with the smallest tree, the one with most room to cache
   (`low_match = "smallest_tree"`).

The published defaults are those of vllm-router's command line
(`src/main.rs`: `--cache-threshold 0.3`, `--balance-abs-threshold 64`,
`--balance-rel-threshold 1.5`; its `CacheAwareConfig::default()` in
`src/policies/mod.rs`, 0.5 / 32 / 1.1, is only used when the policy is built
without a config).

Here the tree is the gateway's own prefix index (core/prefix.py): the match
rate is `view.cached_tokens(prefix, input_tokens) / input_tokens` (whole
blocks, tokens rather than characters), the tree size is the number of
blocks the index believes the instance holds, and load is `view.in_flight`
(this gateway's requests on the instance, vllm-router's count). The index
is kept by the loop from what the gateway sends, imbalanced branch
included, as vllm-router's tree learns every routed request. Each decision
is dead-reckoned on the view, so a batch's later requests see the earlier
ones' prompts and load. The policy compares the request's usable
candidates: it is meant for one model's instances, and with several models
it treats them alike, as vllm-router would given one worker list. Ties
(equal load, equal match) go at random from a seeded generator rather than
to the first worker. The ranked list holds the chosen instance first, then
the rest least loaded first, for retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.prefix.common import cached_tokens, match_share, ranked

NAME = "cache_aware"


@section
class CacheAwareOptions(Section):
    """[policies.cache_aware]: vllm-router's three thresholds between cache affinity and load (its defaults)."""

    cache_threshold: float = option(0.3, ge=0, le=1)  # the longest match wins when its share of the prompt is above
    balance_abs_threshold: int = option(64, ge=0)  # imbalanced when max - min requests in flight is above this...
    balance_rel_threshold: float = option(1.5, ge=0)  # ...and max is above min times this
    # Under the cache threshold: "least_loaded" (vllm-router) or "smallest_tree" (SGLang: fewest cached blocks)
    low_match: Literal["least_loaded", "smallest_tree"] = "least_loaded"
    seed: int = 0  # tie-breaks


def imbalanced(load: np.ndarray, abs_threshold: float, rel_threshold: float) -> bool:
    """vllm-router's test: the spread of load is above both the absolute and the relative threshold."""
    if len(load) == 0:
        return False
    hi, lo = float(load.max()), float(load.min())
    return hi - lo > abs_threshold and hi > lo * rel_threshold


def tree_sizes(view: PoolView, idx: np.ndarray) -> np.ndarray:
    """Blocks each candidate is believed to hold: its index and the prompts this batch sent it (0: no index)."""
    sizes = np.zeros(len(idx))
    for k, i in enumerate(idx):
        index = view.prefixes[i] if view.prefixes else None
        if index is None:
            continue
        extra = {h for sent in view.sent.get(int(i), ()) for h in sent if h not in index}
        sizes[k] = len(index) + len(extra)
    return sizes


class CacheAware(Policy):
    name = NAME

    def __init__(self, options: CacheAwareOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        return [self.decide(req, view) for req in batch]

    def decide(self, req: RouteRequest, view: PoolView) -> Decision:
        """One request's decision, dead-reckoned on `view`; `detail` names the branch (vllm-router's labels)."""
        o = self.options
        cands = view.usable(req.candidates)
        idx = np.asarray(cands, dtype=np.int64)
        load = view.in_flight[idx].astype(float)
        by_load = ranked(cands, self.rng, load)  # least loaded first, ties at random
        cached = cached_tokens(view, req, idx)
        if imbalanced(load, o.balance_abs_threshold, o.balance_rel_threshold):
            order, branch = by_load, "load_balance"
        else:
            share = match_share(cached, req.input_tokens, len(cands))
            if share.size and share.max() > o.cache_threshold:
                best = ranked(cands, self.rng, -share)[0]  # the longest match; equal matches at random
                order, branch = [best, *(i for i in by_load if i != best)], "cache_affinity"
            elif o.low_match == "smallest_tree":
                best = ranked(cands, self.rng, tree_sizes(view, idx))[0]
                order, branch = [best, *(i for i in by_load if i != best)], "low_match_smallest_tree"
            else:
                order, branch = by_load, "low_match_min_load"
        chosen = order[0]
        held = None if cached is None else float(cached[cands.index(chosen)])
        view.dispatched(chosen, 0.0, req.input_tokens, req.prefix)  # dead reckoning: the next request sees it
        return Decision(tuple(order), cached_tokens=held, detail=branch)


def build(context: PolicyContext) -> CacheAware:
    return CacheAware(context.options(NAME))


OPTIONS = {NAME: CacheAwareOptions}
ENTRIES = (PolicyEntry(NAME, build, "baseline: vllm-router's and SGLang's cache_aware: the instance holding the "
                       "longest prefix of the prompt, unless load is imbalanced or the match is under a threshold, "
                       "then the one with the fewest requests in flight", reads_prefixes=True),)
