"""The prefill rate Eq. 1's cache term prices: the profile's prior, refined from vLLM's prefill histograms."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.config.sections import Instance
from gateway.config.store import default_config_path, load_config
from gateway.core.engine.profiles import prefill_s_per_token
from gateway.core.pool_state import EngineSnapshot, PoolState
from gateway.core.prefill_rate import MAX_FACTOR, PrefillFit

PRIOR = 1e-4  # seconds per token
STEP = 0.02  # seconds a prefill takes whatever its length (the decode step beside it)


def intervals(fit: PrefillFit, rate: float, scrapes: int, seed: int = 0) -> None:
    """`scrapes` intervals of 0-6 finished requests of 20-4,000 computed tokens each, every request taking
    STEP + its tokens at `rate`, give or take 20%."""
    rng = np.random.default_rng(seed)
    for _ in range(scrapes):
        tokens = rng.integers(20, 4000, size=rng.integers(0, 7))
        seconds = (STEP + tokens * rate) * rng.uniform(0.8, 1.2, size=tokens.size)
        fit.observe(tokens.size, float(tokens.sum()), float(seconds.sum()))


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_the_fit_finds_the_rate_the_instance_measures_not_the_fixed_part(factor):
    fit = PrefillFit()
    intervals(fit, factor * PRIOR, 400)
    assert fit.rate(PRIOR, STEP) == pytest.approx(factor * PRIOR, rel=0.05)
    # A ratio of the sums would count the fixed part too: 20 ms over some 2,000 tokens, 1e-5 s a token more.
    assert fit.ny / fit.nx - factor * PRIOR > STEP / 2000 * 0.8


def test_a_few_requests_barely_move_the_prior_and_old_ones_are_forgotten():
    fit = PrefillFit()
    fit.observe(2, 1024, 2 * STEP + 1024 * 3 * PRIOR)
    assert PRIOR < fit.rate(PRIOR, STEP) < 1.3 * PRIOR
    intervals(fit, 3 * PRIOR, 400)
    intervals(fit, 1 * PRIOR, 1500, seed=1)  # the instance got faster (say, a new driver): the fit follows
    assert fit.rate(PRIOR, STEP) == pytest.approx(PRIOR, rel=0.1)


def test_a_counter_reset_is_skipped_and_a_wild_fit_stays_within_its_bound():
    fit = PrefillFit()
    fit.observe(-40, -80_000, -9.0)  # the instance restarted: its counters fell
    fit.observe(3, 0, 1.0)
    assert fit.requests == 3
    for _ in range(500):
        fit.observe(1, 100, 100 * 1.0)  # a second a token: far beyond any GPU
    assert fit.rate(PRIOR, STEP) == pytest.approx(MAX_FACTOR * PRIOR)
    assert PrefillFit().rate(PRIOR, STEP) == PRIOR


def test_tier_mates_share_what_one_of_them_measured_and_other_tiers_keep_theirs():
    scheduler = load_config(default_config_path()).scheduler
    instances = tuple(Instance(name=name, url=f"http://127.0.0.1:{9001 + k}", model=model, gpu="A30-24GB",
                               price_input_per_mtok=0.1, price_output_per_mtok=0.2, tpot_prior_ms=20.0)
                      for k, (name, model) in enumerate([("a", "Qwen/Qwen2.5-7B-Instruct"),
                                                         ("b", "Qwen/Qwen2.5-7B-Instruct"),
                                                         ("c", "Qwen/Qwen2.5-3B-Instruct")]))
    priors = np.array([prefill_s_per_token(i.model, i.gpu) for i in instances])
    state = PoolState()
    assert np.allclose(state.snapshot(instances, 0.0, 10.0, scheduler).prefill_s, priors)
    requests = tokens = seconds = 0.0
    rng = np.random.default_rng(0)
    for t in range(300):  # instance a reports prefills at twice its prior; c's page has no such histogram
        for n in rng.integers(1, 4, size=1):
            for computed in rng.integers(50, 3000, size=n):
                requests, tokens, seconds = requests + 1, tokens + computed, seconds + 0.02 + computed * 2 * priors[0]
        state.of("a").scraped(EngineSnapshot(1, 0, 0.1, 0, 0, prefills=requests, prefill_seconds=seconds,
                                             prefill_computed_tokens=tokens), float(t))
        state.of("c").scraped(EngineSnapshot(1, 0, 0.1, 0, 0, prefills=requests, prefill_seconds=seconds), float(t))
    view = state.snapshot(instances, 300.0, 10.0, scheduler)
    assert view.prefill_s[0] == view.prefill_s[1] == pytest.approx(2 * priors[0], rel=0.03)
    assert view.prefill_s[2] == priors[2]
