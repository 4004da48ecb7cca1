"""Exploring pool models the estimators have no labels for, within a bound.

A model added to the pool after training has no quality estimate of its own. It is routed on a
pessimistic prior (no better than the worst labelled model for that prompt: Estimators.for_instances),
which keeps an unknown model from taking traffic it has not earned. To earn labels, a bounded share of
requests explores: such a request is offered the unknown model with the fewest traffic labels so far (as
of the last refresh) at the best quality there is (1), and the policy then decides as always: the key's
allowed models, its budget and SLO filter the candidates first, so exploring never breaks them, and a
model far dearer or slower than the rest can still lose. Explored requests land on prompts drawn at
random, so the labels they earn are an unbiased sample of the model's quality. Once the model has
min_labels labels a refresh gives it its own head and it is no longer explored.

(A Thompson draw from the model's labels, tried first, explores too slowly under a share bound: with few
labels the draw seldom beats a labelled model, so a model added late gathered its first labels over
hundreds of requests, and in one replay of three it never did; tests/test_explore.py replays that.)

Bounds ([learning]): explore_share of the requests at most (a Bernoulli draw per request, and a hard
count over the last WINDOW decisions), and explore_usd_per_day of predicted spend on explored requests
per UTC day. Keys with learn = false, and requests of other policies than those reading estimates,
are never explored.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gateway.core.request import Estimates
from gateway.serving.daily_spend import DailySpend

WINDOW = 1000  # decisions the hard share bound counts over


class Explorer:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self._recent: deque[bool] = deque(maxlen=WINDOW)  # whether each recent decision explored
        self._recent_explored = 0  # how many of them did (kept, not summed per request)
        self.spend = DailySpend()

    def apply(self, estimates: Estimates, unlabelled: dict[str, tuple[int, float]], instances, eligible: list[bool],
              share: float, usd_per_day: float) -> list[bool]:
        """The optimistic offer into `estimates.quality` for the chosen requests (rows); which rows explore.
        `unlabelled`: model -> (traffic labels, their summed score) for the models without an estimate."""
        chosen = [False] * len(eligible)
        columns = {m: [j for j, inst in enumerate(instances) if inst.model == m] for m in unlabelled}
        columns = {m: c for m, c in columns.items() if c}
        if not columns or share <= 0:
            for _ in chosen:
                self._remember(False)
            return chosen
        within_spend = self.spend.today_usd < usd_per_day
        for row, ok in enumerate(eligible):
            room = within_spend and self._recent_explored < share * WINDOW
            if ok and room and self.rng.random() < share:
                chosen[row] = True
                model = least_labelled({m: unlabelled[m][0] for m in columns}, self.rng)
                estimates.quality[row, columns[model]] = 1.0
            self._remember(chosen[row])
        return chosen

    def _remember(self, explored: bool) -> None:
        if len(self._recent) == WINDOW:
            self._recent_explored -= self._recent[0]  # the decision the append pushes out
        self._recent.append(explored)
        self._recent_explored += explored

    def spent(self, usd: float) -> None:
        """Book an explored request's predicted cost against today's cap."""
        self.spend.add(usd)


def least_labelled(labels: dict, rng: np.random.Generator):
    """The key (a model) with the fewest labels (ties: at random): what an explored request is offered."""
    fewest = min(labels.values())
    keys = [k for k, n in labels.items() if n == fewest]
    return keys[int(rng.integers(len(keys)))]
