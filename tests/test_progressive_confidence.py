"""Progressive mode's choice among expansions (PICE's Eq. 3, core/progressive.py), the emulator's logprob
signal it reads (emulator/logprobs.py), and the simulator making the same choice the gateway makes on the
emulator's answers (sim/progressive.py)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import pool_config
from gateway.config.sections import ProgressiveConfig
from gateway.config.store import load_config
from gateway.config_schema import ConfigError
from gateway.core.progressive import (
    Candidate,
    ConfidenceWeights,
    FallbackRule,
    ProgressiveLimits,
    Usage,
    choose,
    confidence,
    confidence_score,
    parse_points,
    rouge_l,
)
from gateway.core.progressive_prompts import expansion_prompt, sketch_prompt
from gateway.lab.emulator.logprobs import RHO, TokenLogprobs, answer_mean_logprob, model_bias
from gateway.lab.emulator.outputs import OutputLengths
from gateway.lab.sim.progressive import EMULATOR_SEED, kept, plan_all
from gateway.lab.workload.synthetic import generate

M3, M7, M72 = "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-72B-Instruct"

# --- ROUGE-L ------------------------------------------------------------------------------------------


def test_rouge_l_is_the_f1_of_the_longest_common_subsequence():
    assert rouge_l("rivers carve valleys", "Rivers carve valleys.") == 1.0
    assert rouge_l("rivers carve valleys", "mountains rise") == 0.0
    assert rouge_l("", "anything") == rouge_l("anything", "") == 0.0
    # LCS of (a b c d) and (a x c y d z) is a c d: precision 3/6, recall 3/4, F1 = 0.6
    assert rouge_l("a b c d", "a x c y d z") == pytest.approx(2 * 0.5 * 0.75 / 1.25)
    # a subsequence, not a bag of words: order counts
    assert rouge_l("a b c", "c b a") == pytest.approx(1 / 3)
    assert rouge_l("a b c", "a b c") > rouge_l("a b c", "a b c " + "filler " * 20) > 0


# --- Eq. 3 --------------------------------------------------------------------------------------------


def test_confidence_score_weighs_probability_length_and_rouge():
    w = ConfidenceWeights(0.5, 0.25, length_scale=100)
    assert w.rouge == pytest.approx(0.25)
    point, text = "rivers carve valleys", "rivers slowly carve deep valleys"
    score = confidence_score(math.log(0.8), 40, point, text, w)
    assert score == pytest.approx(0.5 * 0.8 + 0.25 * 0.4 + 0.25 * rouge_l(point, text))
    # the length term saturates at length_scale; no logprobs: no probability term
    assert confidence_score(math.log(0.8), 400, "", "", w) == pytest.approx(0.5 * 0.8 + 0.25)
    assert confidence_score(-math.inf, 0, "", "", w) == 0.0
    with pytest.raises(ValueError):
        ConfidenceWeights(0.8, 0.3)


def test_length_and_rouge_can_overturn_a_higher_token_probability():
    """The paper's reason for Eq. 3: perplexity alone favours whichever model is surer of itself. A terse,
    off-point expansion with the higher logprob loses to a fuller one that keeps to its point, unless all
    the weight is on the logprob."""
    point = "rivers carve valleys over time"
    terse = Candidate("water moves", [-0.2] * 2, Usage(0, 2))
    full = Candidate("Over long time spans rivers carve valleys into rock, " + "deepening them " * 15,
                     [-0.35] * 40, Usage(0, 40))
    assert confidence(terse, point) < confidence(full, point)
    assert choose([terse, full], point) == 1
    assert choose([terse, full], point, ConfidenceWeights(1.0, 0.0)) == 0
    # the point matters: against an unrelated point only the length term helps the full one
    assert confidence(full, point) > confidence(full, "bridges span rivers")


def test_config_weights_reach_the_limits_and_are_validated():
    limits = ProgressiveConfig(confidence_logprob_weight=0.6, confidence_length_weight=0.1,
                               expansion_max_tokens=150).limits()
    assert limits.confidence == ConfidenceWeights(0.6, 0.1, 150)
    with pytest.raises(ConfigError):
        ProgressiveConfig(confidence_logprob_weight=0.7, confidence_length_weight=0.4)


# --- the emulator's signal ----------------------------------------------------------------------------


def _draws(model: str, n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = random.Random(seed)
    q = np.clip([rng.gauss(0.38, 0.22) for _ in range(n)], 0, 1)
    lp = np.array([answer_mean_logprob(model=model, quality=float(qi), prompt=f"prompt {i}", emulator_seed=0,
                                       request_seed=None) for i, qi in enumerate(q)])
    return q, lp


def test_signal_is_partly_correlated_with_quality_and_biased_per_model():
    q, lp3 = _draws(M3, 4000)
    assert np.corrcoef(q, lp3)[0, 1] == pytest.approx(RHO, abs=0.05)  # about 0.3 when the labels' sd is 0.22
    _, lp7 = _draws(M7, 4000)
    # same labels, same prompts: the models differ by their biases (drawn once from their names), not by noise
    assert lp3.mean() - lp7.mean() == pytest.approx(model_bias(M3) - model_bias(M7), abs=0.01)
    assert model_bias(M3) == model_bias(M3) != model_bias(M7)


def test_choosing_by_the_signal_is_not_an_oracle():
    """Of two answers with different labels (one model), the signal ranks the better one first more often
    than a coin would and far from always."""
    q, lp = _draws(M3, 4000)
    a, b = q[::2], q[1::2]
    la, lb = lp[::2], lp[1::2]
    differ = a != b
    agree = np.mean((a[differ] > b[differ]) == (la[differ] > lb[differ]))
    assert 0.55 < agree < 0.75


def test_a_request_seed_draws_another_confidence():
    kw = {"model": M3, "quality": 0.4, "prompt": "p", "emulator_seed": 0}
    assert answer_mean_logprob(**kw, request_seed=1) != answer_mean_logprob(**kw, request_seed=2)
    assert answer_mean_logprob(**kw, request_seed=1) == answer_mean_logprob(**kw, request_seed=1)


# --- the simulator keeps what the gateway keeps -------------------------------------------------------


def test_the_simulator_keeps_the_expansion_the_gateway_would_keep(tmp_path):
    """For labelled questions the simulator sketches: the points it plans are what the gateway parses from
    the emulator's sketch, and for each point the candidate it keeps is the one core `choose` keeps from the
    emulator's answers (text, token logprobs, usage) to the gateway's expansion prompts."""
    cfg = load_config(pool_config(tmp_path))
    models = [M72, M7, M3]
    first = {}
    for inst in cfg.instances:
        first.setdefault(inst.model, inst)
    instances = [first[m] for m in models]
    records = [r for r in generate(400, seed=5) if all(m in r.models for m in models)]
    records = sorted(records, key=lambda r: -r.models[M72].output_length)[:30]  # long answers: sketched
    lengths = OutputLengths.from_records({}, records, seed=EMULATOR_SEED)
    limits = ProgressiveLimits(candidates=2)
    label_length = np.array([[r.models[m].output_length for m in models] for r in records])
    quality = np.array([[r.models[m].score for m in models] for r in records])
    plans = plan_all([r.prompt for r in records], np.full(len(records), 40), label_length,
                     label_length.astype(float), instances, limits, FallbackRule(min_answer_tokens=0))
    assert plans.small == (M3, M7) and len(plans.plans) >= 10
    picks = set()
    for r, plan in plans.plans.items():
        question = records[r].prompt
        sketch = lengths.answer(sketch_prompt(question, limits.max_points), M72)
        points = parse_points(sketch.text(0, min(sketch.tokens, limits.sketch_max_tokens)), limits.max_points)
        assert list(plan.point_texts) == points
        for p in range(1, plan.points + 1):
            prompt = expansion_prompt(question, points, p)
            assert plan.expansion_prompts[p - 1] == prompt
            served, candidates = [], []
            for e in (e for e in plan.expansions if e.point == p):
                answer = lengths.answer(prompt, e.model)
                tokens = min(answer.tokens, limits.expansion_max_tokens)
                lp = TokenLogprobs.for_answer(text=prompt, model=e.model, quality=lengths.quality(prompt, e.model),
                                              tokens=tokens, emulator_seed=EMULATOR_SEED, request_seed=None)
                candidates.append(Candidate(answer.text(0, tokens), list(lp.values), Usage(0, tokens)))
                served.append((e, SimpleNamespace(quality=float(quality[r, models.index(e.model)]),
                                                  completion_tokens=tokens)))
            gateway = choose(candidates, points[p - 1], limits.confidence)
            assert kept(plan, p, served, limits) == gateway
            picks.add(served[gateway][0].model)
    assert picks == {M3, M7}  # both models win some points: the choice is not fixed by the model
