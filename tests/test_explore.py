"""Models without labels: explored within their bound (serving/explore.py), and learned from traffic until their
share of the picks settles near the share they get when trained offline on the same labels
(lab/experiments/learning_curve.py replays labelled prompts as traffic through the refit a refresh runs)."""

from __future__ import annotations

import numpy as np

from gateway.core.request import Estimates
from gateway.estimators.crossfit import Pricing, eq1_picks
from gateway.estimators.refit import RefitSettings, TrafficLabels, fit_traffic
from gateway.lab.experiments.learning_curve import CurveSpec, replay
from gateway.serving.explore import WINDOW, Explorer


class Inst:
    def __init__(self, model: str):
        self.model = model


def test_exploration_stays_within_its_share_its_spend_and_the_keys_that_allow_it():
    instances = [Inst("known"), Inst("new"), Inst("new")]
    explorer = Explorer(seed=1)
    explored = []
    for _ in range(40):
        est = Estimates(np.full((50, 3), 0.2), np.full((50, 3), 100.0))
        eligible = [r % 5 != 0 for r in range(50)]  # one request in five comes from a key that does not learn
        rows = explorer.apply(est, {"new": (0, 0.0)}, instances, eligible, share=0.1, usd_per_day=10.0)
        assert not any(rows[r] for r in range(50) if not eligible[r])
        for r, chosen in enumerate(rows):
            # an explored row offers every instance of the model at quality 1; the others keep the prior
            assert est.quality[r, 1] == est.quality[r, 2] == (1.0 if chosen else 0.2)
        explored += rows
    share = np.mean(explored)
    assert 0.05 < share <= 0.1  # about share x eligible, never past the bound
    assert sum(explored[-WINDOW:]) <= 0.1 * WINDOW
    explorer.spent(10.0)  # today's cap reached: no more exploring
    est = Estimates(np.full((200, 3), 0.2), np.full((200, 3), 100.0))
    assert not any(explorer.apply(est, {"new": (0, 0.0)}, instances, [True] * 200, share=1.0, usd_per_day=10.0))
    # nothing unlabelled: nothing explored
    assert not any(Explorer().apply(est, {}, instances, [True] * 200, share=1.0, usd_per_day=10.0))


def test_an_explored_request_is_offered_the_least_labelled_model():
    instances = [Inst("known"), Inst("young"), Inst("newest")]
    est = Estimates(np.full((400, 3), 0.3), np.full((400, 3), 100.0))
    rows = Explorer(seed=2).apply(est, {"young": (12, 6.0), "newest": (3, 3.0)}, instances, [True] * 400, share=1.0,
                                  usd_per_day=1e9)
    assert 0 < sum(rows) <= 400 * 1.0
    explored = est.quality[np.array(rows)]
    assert (explored[:, 2] == 1.0).all() and (explored[:, 1] == 0.3).all() and (explored[:, 0] == 0.3).all()


def planted(n: int = 900, seed: int = 0):
    """Three models: A cheap and right where the first coordinate is high, B dear and right 70% of the time,
    C (the late one) mid-priced and right where the first coordinate is above a lower bar."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    first = x[:, 0] * 4  # about unit spread
    labels = np.column_stack([first > 0.5, rng.random(n) < 0.7, first > -0.5]).astype(np.float64)
    lengths = np.full((n, 3), 100.0)
    price = np.array([1e-7, 2e-6, 6e-7])
    input_len = np.full(n, 50.0)
    return x.astype(np.float32), labels, lengths, Pricing(price, price, input_len,
                                                          input_len[:, None] * price + lengths * price)


def test_a_model_added_without_labels_is_explored_and_its_share_settles_near_its_offline_share():
    x, labels, lengths, pricing = planted()
    models = ("A", "B", "C")
    spec = CurveSpec(weights=(0.8, 0.0, 0.2), refresh_every=25, explore_share=0.1, min_labels=20, added="C",
                     added_at=200)
    # offline: heads fitted on every label of every model, the same rule picking
    everything = TrafficLabels(np.repeat(x, 3, axis=0), np.tile(np.arange(3), len(x)), labels.reshape(-1),
                               np.ones(labels.size), np.zeros(labels.size, bool), np.repeat(np.arange(len(x)), 3))
    fit = fit_traffic(None, (), everything, everything_lengths(x, lengths), models, RefitSettings(min_labels=20))
    q, ln = np.zeros_like(labels), lengths.copy()
    fit.apply(x, models, q, ln)
    offline = (eq1_picks(q, ln, pricing, np.arange(len(x)), spec.weights) == 2).mean()
    assert offline > 0.3  # C earns a real share offline

    shares = []
    for seed in range(3):
        run = replay(x, labels, lengths, pricing, models, None, (), spec, seed)
        assert not (run.picks[:spec.added_at] == 2).any()  # not in the pool before it joins
        assert run.explored.mean() <= spec.explore_share + 0.03
        shares.append((run.picks[-300:] == 2).mean())  # the last third: settled
    assert abs(np.mean(shares) - offline) <= 0.15, (shares, offline)


def everything_lengths(x, lengths) -> TrafficLabels:
    return TrafficLabels(np.repeat(x, 3, axis=0), np.tile(np.arange(3), len(x)), lengths.reshape(-1),
                         np.ones(lengths.size), np.zeros(lengths.size, bool), np.repeat(np.arange(len(x)), 3))
