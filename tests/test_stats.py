"""The sweeps' intervals: the bootstrap over seeds and requests, percentiles, paired differences."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.lab.sim import stats
from gateway.lab.sim.stats import bootstrap, bootstrap_mean, bootstrap_percentile, difference, differences

TRIALS = 200


def _coverage(make, truth: float, statistic="mean") -> float:
    """Share of TRIALS synthetic data sets whose 95% interval holds the true figure."""
    hits = 0
    for trial in range(TRIALS):
        interval = bootstrap(make(np.random.default_rng(1000 + trial)), statistic, replicates=1000, seed=trial)
        hits += interval.lo <= truth <= interval.hi
    return hits / TRIALS


def _crossed(rng, prompt_sd: float, seed_sd: float, noise_sd: float, seeds: int = 5, requests: int = 200):
    """(seeds x requests) values with the sweeps' structure: request i is the same prompt on every seed."""
    return (1.0 + rng.normal(0, prompt_sd, requests)[None, :] + rng.normal(0, seed_sd, seeds)[:, None]
            + rng.normal(0, noise_sd, (seeds, requests)))


def test_one_seed_is_the_plain_bootstrap_and_covers_the_mean():
    assert 0.9 <= _coverage(lambda rng: rng.exponential(1.0, 200), 1.0) <= 0.99


def test_several_seeds_of_the_same_prompts_cover_the_mean():
    # The prompts make most of the spread, as with the workload's labels.
    assert 0.9 <= _coverage(lambda rng: _crossed(rng, prompt_sd=1.0, seed_sd=0.1, noise_sd=1.0), 1.0) <= 0.99


def test_where_the_interval_is_wide_or_narrow():
    """What stats.py's docstring says: independent noise per request is counted by both draws (wide);
    five seeds resample to 4/5 of their own spread (narrow when the seeds make most of it)."""
    noise = _coverage(lambda rng: _crossed(rng, prompt_sd=0.2, seed_sd=0.0, noise_sd=1.0), 1.0)
    seeds = _coverage(lambda rng: _crossed(rng, prompt_sd=0.1, seed_sd=1.0, noise_sd=0.5), 1.0)
    assert noise >= 0.97 and 0.75 <= seeds < 0.95


def test_the_point_is_the_mean_over_seeds_of_each_seeds_figure():
    rng = np.random.default_rng(3)
    x = rng.lognormal(0, 1, (4, 300))
    x[rng.random(x.shape) < 0.1] = np.nan  # e.g. refused requests have no E2E
    per_seed_mean = [np.nanmean(row) for row in x]
    assert bootstrap_mean(x, replicates=200).mean == pytest.approx(np.mean(per_seed_mean))
    for q in (0, 50, 95, 99, 100):
        expected = np.mean(np.nanpercentile(x, q, axis=1))
        interval = bootstrap_percentile(x, q, replicates=200)
        assert interval.mean == pytest.approx(expected) and interval.lo <= interval.mean <= interval.hi


@pytest.mark.parametrize("q", [0.0, 1.0, 50.0, 95.0, 99.0, 100.0])
def test_resampled_percentiles_are_numpys_of_the_drawn_requests(q):
    """The count-matrix shortcut gives what numpy gives on the drawn values themselves."""
    rng = np.random.default_rng(5)
    x = rng.lognormal(0, 1, (3, 400))
    x[rng.random(x.shape) < 0.2] = np.nan
    x[2] = np.nan  # a seed where nothing counts
    figure = stats._prepare({"p": (x, q)})["p"]
    drawn = rng.integers(0, 400, (64, 400))
    got = stats._resampled_per_seed(figure, stats._counts(drawn, 400))
    with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning):  # the all-NaN seed
        want = np.stack([np.nanpercentile(row[drawn], q, axis=1) for row in x], axis=1)
    np.testing.assert_allclose(got, want, equal_nan=True)


def test_throughput_like_figures_resample_the_seeds_alone():
    per_seed = np.array([[8.1], [8.4], [7.9], [8.6], [8.2]])
    interval = bootstrap_mean(per_seed, replicates=500)
    assert interval.mean == pytest.approx(per_seed.mean())
    assert per_seed.min() <= interval.lo < interval.mean < interval.hi <= per_seed.max()
    one = bootstrap_mean(np.array([[8.1]]), replicates=50)
    assert one.lo == one.mean == one.hi  # one run: nothing to resample


def test_pairing_cancels_what_two_cells_share():
    rng = np.random.default_rng(7)
    shared = _crossed(rng, prompt_sd=1.0, seed_sd=0.3, noise_sd=0.5)  # the prompts and arrivals both cells see
    a = shared + 0.05 + rng.normal(0, 0.05, shared.shape)
    paired = difference(a, shared)
    unpaired = difference(a, shared, paired=False)
    assert paired.lo <= 0.05 <= paired.hi
    assert (paired.hi - paired.lo) < 0.2 * (unpaired.hi - unpaired.lo)
    assert paired.mean == pytest.approx(unpaired.mean) == pytest.approx(np.nanmean(a) - np.nanmean(shared))


def test_several_figures_share_their_draws_and_repeat_exactly():
    rng = np.random.default_rng(11)
    a, b = rng.normal(1, 1, (2, 150)), rng.normal(1.2, 1, (2, 150))
    figures_a, figures_b = {"m": (a, "mean"), "p90": (a, 90)}, {"m": (b, "mean"), "p90": (b, 90)}
    assert differences(figures_a, figures_b, replicates=300) == differences(figures_a, figures_b, replicates=300)
    assert differences(figures_a, figures_b, replicates=300)["m"] == difference(a, b, replicates=300)
    assert bootstrap_mean(a, seed=1) != bootstrap_mean(a, seed=2)


def test_bad_inputs_are_refused_and_empty_figures_have_no_interval():
    with pytest.raises(ValueError, match="same seeds"):
        difference(np.zeros((2, 10)), np.zeros((3, 10)))
    with pytest.raises(ValueError, match="outside"):
        bootstrap(np.zeros(10), 101)
    with pytest.raises(ValueError):
        bootstrap_mean(np.zeros((0, 0)))
    nothing = bootstrap_mean(np.full((2, 10), np.nan), replicates=50)
    assert np.isnan(nothing.mean) and np.isnan(nothing.lo) and np.isnan(nothing.hi)
