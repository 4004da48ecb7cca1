"""What the scheduler knows of the pool at one instant: one named array per instance column.

A view is a working copy: a policy adds each of its dispatches to it (dead
reckoning), so the next request of the batch sees the work the earlier ones
added. The instance columns are also the instance half of the TPOT heads'
features (estimators/latency.py), in STATE_FEATURES order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.core.settings import InstanceSettings

# The instance state the scheduler tracks, and its order in a TPOT head's feature row.
STATE_FEATURES = (
    "running",  # vllm:num_requests_running at the last scrape, or the gateway's own count
    "waiting",  # vllm:num_requests_waiting at the last scrape, or the gateway's own overflow
    "kv_usage",  # vllm:kv_cache_usage_perc at the last scrape (0..1)
    "decode_rate",  # generation tokens/s between the last two scrapes
    "in_flight",  # requests the gateway has on the instance now
    "pending_prefill_tokens",  # prompt tokens of those without a first token yet
    "pending_decode_tokens",  # predicted answer tokens still to stream for those in flight
)


def tier_key(model: str, gpu: str) -> str:
    """A tier is a (served model, GPU) pair: its instances share one TPOT head and one prior."""
    return f"{model}@{gpu}"


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

    @property
    def active(self) -> np.ndarray:
        """Requests on each instance, running or waiting."""
        return self.running + self.waiting

    def state_row(self, i: int) -> np.ndarray:
        """Instance i's columns in STATE_FEATURES order (a TPOT head's instance features)."""
        return np.array([self.running[i], self.waiting[i], self.kv_usage[i], self.decode_rate[i], self.in_flight[i],
                         self.pending_prefill[i], self.pending_decode[i]])

    def usable(self, candidates: Sequence[int]) -> list[int]:
        """Candidates that are available, or all of them if none is (better to try than to refuse)."""
        up = [i for i in candidates if self.available[i]]
        return up or list(candidates)

    def dispatched(self, i: int, tokens: float, input_tokens: float = 0.0) -> None:
        """Dead reckoning: instance i got one more request of `tokens` predicted answer tokens."""
        # A request queues behind others already waiting (no free KV), or when every slot runs.
        if self.running[i] < self.max_num_seqs[i] and self.waiting[i] == 0:
            self.running[i] += 1
        else:
            self.waiting[i] += 1
        self.in_flight[i] += 1
        self.pending_prefill[i] += input_tokens
        self.pending_decode[i] += tokens
