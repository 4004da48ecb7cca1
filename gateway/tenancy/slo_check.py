"""A live request's SLOs: where they come from, and whether the answer met them.

The request's own `routing.slo_s` / `routing.tpot_slo_ms` (or their headers)
win; then its key's defaults; then the config's end-to-end SLO for the
request's preset. The judgement itself (core/slo.py) is shared with
the simulator; this shell adds the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.config.sections import ApiKey, Config
from gateway.core.slo import slo_class, slo_met, tpot_met
from gateway.tenancy.access import request_preset


def resolve_slo(cfg: Config, routing, key: ApiKey | None) -> tuple[float | None, float | None]:
    """(end-to-end SLO in seconds, time-per-token bound in seconds) of a request; None where it has none."""
    slo_s = routing.slo_s
    if slo_s is None and key is not None:
        slo_s = key.slo_s
    if slo_s is None:
        slo_s = cfg.slo.presets.get(request_preset(cfg, routing, key))
    tpot_ms = routing.tpot_slo_ms
    if tpot_ms is None and key is not None:
        tpot_ms = key.tpot_slo_ms
    return slo_s, None if tpot_ms is None else tpot_ms / 1000.0


@dataclass(slots=True)
class SloCheck:
    """Judges one request against its SLOs when its usage goes out (the answer's end)."""

    slo_s: float | None
    tpot_slo_s: float | None
    start: float  # when the request arrived, on `clock`
    clock: Callable[[], float]
    classes: Mapping[str, float]  # the config's SLO classes
    met: bool | None = None  # judged: the end-to-end SLO held
    tpot_met: bool | None = None

    @property
    def any(self) -> bool:
        return self.slo_s is not None or self.tpot_slo_s is not None

    @property
    def slo_class(self) -> str:
        return slo_class(self.slo_s, self.classes)

    def annotate(self, usage: dict, completion_tokens: int) -> None:
        """Costing's hook: the verdicts, into the usage object the client gets."""
        self.judge(completion_tokens)
        if self.met is not None:
            usage["slo_met"] = self.met
        if self.tpot_met is not None:
            usage["tpot_slo_met"] = self.tpot_met

    def judge(self, completion_tokens: int) -> None:
        e2e = self.clock() - self.start
        if self.slo_s is not None:
            self.met = slo_met(e2e, self.slo_s)
        if self.tpot_slo_s is not None:
            self.tpot_met = tpot_met(e2e, completion_tokens, self.tpot_slo_s)

    def headers(self) -> dict[str, str]:
        out = {}
        if self.met is not None:
            out["X-Route-SLO-Met"] = "true" if self.met else "false"
        if self.tpot_met is not None:
            out["X-Route-TPOT-SLO-Met"] = "true" if self.tpot_met else "false"
        return out
