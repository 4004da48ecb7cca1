"""What the scheduler knows of the pool at one instant: one named array per instance column.

A view is a working copy: a policy adds each of its dispatches to it (dead
reckoning), so the next request of the batch sees the work the earlier ones
added. The instance columns are also the instance half of the TPOT heads'
features (estimators/latency.py), in STATE_FEATURES order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict

import numpy as np

from gateway.core.budget import predicted_cost
from gateway.core.prefix import PrefixIndex, cacheable_blocks
from gateway.core.request import Estimates, RouteRequest
from gateway.core.scoring import no_free_slot
from gateway.core.settings import InstanceSettings

# The instance state the scheduler tracks, and its order in a TPOT head's feature row.
STATE_FEATURES = (
    "running",  # vllm:num_requests_running at the last scrape, or the gateway's own count
    "waiting",  # vllm:num_requests_waiting at the last scrape, or the gateway's own overflow
    "kv_usage",  # vllm:kv_cache_usage_perc at the last scrape (0..1)
    "decode_rate",  # generation tokens/s between the last two scrapes
    "in_flight",  # requests the gateway has on the instance now
    "pending_prefill_tokens",  # prompt tokens still to compute (less what is cached) of those without a first token
    "pending_decode_tokens",  # predicted answer tokens still to stream for those in flight
)


def tier_key(model: str, gpu: str) -> str:
    """A tier is a (served model, GPU) pair: its instances share one TPOT head and one prior."""
    return f"{model}@{gpu}"


class Predicted(TypedDict):
    """A decision's predictions for the instance it puts first (Decision's fields of the same names)."""

    quality: float
    tokens: float
    cost_usd: float


@dataclass(slots=True)
class PoolView:
    """Per-instance arrays, in config order."""

    instances: Sequence[InstanceSettings]
    available: np.ndarray  # bool: not known to be down
    running: np.ndarray
    waiting: np.ndarray
    kv_usage: np.ndarray
    decode_rate: np.ndarray
    in_flight: np.ndarray
    pending_prefill: np.ndarray
    pending_decode: np.ndarray
    max_num_seqs: np.ndarray
    price_in: np.ndarray  # USD per input token
    price_out: np.ndarray  # USD per output token
    tpot_prior_s: np.ndarray  # the tier's low-load seconds per output token
    tiers: tuple[str, ...]  # tier_key of each instance
    now: float = 0.0  # the instant the view describes (the driver's clock: real or virtual seconds)
    # What each instance is believed to hold in its prefix cache (None: it does not cache); () when the gateway
    # looks at no prefix ([scheduler] prefix_cache = "off").
    prefixes: tuple[PrefixIndex | None, ...] = ()
    block_size: int = 16  # tokens a prefix block holds
    prefill_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the tier's seconds per computed prompt token
    # Prompts dispatched by this working copy (dead reckoning), per instance: later requests of the batch find them.
    sent: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    @property
    def active(self) -> np.ndarray:
        """Requests on each instance, running or waiting."""
        return self.running + self.waiting

    def state_row(self, i: int) -> np.ndarray:
        """Instance i's columns in STATE_FEATURES order (a TPOT head's instance features)."""
        return np.array([self.running[i], self.waiting[i], self.kv_usage[i], self.decode_rate[i], self.in_flight[i],
                         self.pending_prefill[i], self.pending_decode[i]])

    @property
    def knows_prefixes(self) -> bool:
        return bool(self.prefixes)

    def cached_tokens(self, prefix: Sequence[int], input_tokens: int) -> np.ndarray:
        """Per instance, the prompt tokens it is believed to hold cached: its longest run of the prompt's leading
        blocks, never the last prompt token (always computed). Zeros when prefixes are not looked at."""
        if not self.prefixes or not prefix:
            return np.zeros(len(self.instances))
        hashes = self._cacheable(prefix, input_tokens)
        held = np.array([self._blocks_held(i, hashes) for i in range(len(self.instances))], dtype=float)
        return held * self.block_size

    def _cacheable(self, prefix: Sequence[int], input_tokens: float) -> Sequence[int]:
        """The prompt's leading blocks an instance could take from its cache (`cacheable_blocks`)."""
        return prefix[:cacheable_blocks(int(input_tokens), self.block_size)]

    def _blocks_held(self, i: int, hashes: Sequence[int]) -> int:
        """Leading `hashes` instance i holds: in its index, or in a prompt this working copy dispatched there."""
        index = self.prefixes[i]
        if index is None:
            return 0
        n = index.match(hashes)
        for other in self.sent.get(i, ()):
            n = max(n, _common(other, hashes))
        return n

    def predicted(self, request: RouteRequest, estimates: Estimates, r: int, i: int) -> Predicted:
        """What a decision predicts of the batch's request r (its row of `estimates`) served by instance i: its
        model's quality and answer tokens, and the cost of those tokens (times the request's choices) at i's
        prices, as Decision's fields."""
        tokens = float(estimates.length[r, i])
        cost = predicted_cost(request.input_tokens, tokens * request.n, self.price_in[i], self.price_out[i])
        return Predicted(quality=float(estimates.quality[r, i]), tokens=tokens, cost_usd=float(cost))

    def probe(self) -> PoolView:
        """A copy to try decisions on: its dead reckoning does not reach this view (the index is shared, read
        only)."""
        return replace(self, running=self.running.copy(), waiting=self.waiting.copy(),
                       in_flight=self.in_flight.copy(), pending_prefill=self.pending_prefill.copy(),
                       pending_decode=self.pending_decode.copy(),
                       sent={i: list(sent) for i, sent in self.sent.items()})

    def usable(self, candidates: Sequence[int]) -> list[int]:
        """Candidates that are available, or all of them if none is (better to try than to refuse)."""
        up = [i for i in candidates if self.available[i]]
        return up or list(candidates)

    def dispatched(self, i: int, tokens: float, input_tokens: float = 0.0, prefix: tuple[int, ...] = ()) -> None:
        """Dead reckoning: instance i got one more request of `tokens` predicted answer tokens (and its prompt's
        blocks, which it will hold cached). Its pending prefill is what it must compute: the prompt less what
        the instance holds."""
        cached = 0
        if prefix and self.prefixes and self.prefixes[i] is not None:
            cached = self._blocks_held(i, self._cacheable(prefix, input_tokens)) * self.block_size
            self.sent.setdefault(i, []).append(prefix)
        if no_free_slot(self.running[i], self.waiting[i], self.kv_usage[i], self.max_num_seqs[i]):
            self.waiting[i] += 1
        else:
            self.running[i] += 1
        self.in_flight[i] += 1
        self.pending_prefill[i] += input_tokens - cached
        self.pending_decode[i] += tokens


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chains share (chained hashes: equal at k means equal before k)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
