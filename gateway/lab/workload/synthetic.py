"""A synthetic labelled workload calibrated to the RouteBalance paper's dataset (DESIGN.md,
"Synthetic workload calibration"; routebalance.txt section 6).

Every record is drawn from a small latent model, and the prompt text is written to
show that latent state, so an estimator that only sees the text (a sentence
embedding and nearest neighbours) can recover part of the labels and no more:

    kind        one of seven request families              visible: vocabulary, format
    topic       a subskill within the kind (~10 per kind)   visible: topic words, entities
    difficulty  d in [0, 1]                                visible: wording (EASY/MEDIUM/HARD
                                                           phrasing, constraints, steps) and length
    noise       per prompt and per (prompt, model)         invisible

Quality of model m on a prompt (before clipping to [0, 1]):

    q_m = base[kind] + topic_shift + slope * (0.5 - d)          how hard the prompt is, for everyone
          + (gain[m] * kind_gap[kind] + affinity[kind, topic, level, m]) * ramp(d)
                                                                 what size buys, which vanishes on
                                                                 easy prompts (small models tie there)
          + common noise + own noise[m] * spread(d)              judge and sampling noise

``affinity`` gives each topic, and each difficulty level within it, its own ranking of
the models (a 7B may beat a 14B on some topics), which is the part of "which model is
best" that neighbours in embedding space can learn.
The own-model noise is what makes the per-prompt oracle far better than any model,
and what keeps the best model only partly predictable.

Answer length of model m: a per-model mean scaled by the kind, the topic and the
difficulty, times a per-prompt factor shared by all models (a prompt that needs a
long answer gets long answers from every model) and a per-model factor; capped at
1,024 and at least 1.

The constants below were tuned by measuring generate(18608) (see tests/test_workload.py
for the tolerances and the report in ``python -m gateway.lab.workload``).

Determinism: record i depends only on (seed, i): its text and its labels come from two
numpy Generators seeded with (seed, i, stream). So generate(n, seed) is a prefix of
generate(m, seed) for n < m. The "world" (per-topic shifts, affinities, length factors)
does not depend on the seed at all: it is fixed by the kind and topic names, so data
from different seeds agree about which model is good at what.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gateway.records import MAX_OUTPUT_TOKENS, ModelLabel, Record, prompt_key
from gateway.tokens import estimate_tokens

from . import text
from .text import EASY, HARD, MEDIUM, Dice

POOL_MODELS = (
    "Qwen/Qwen2.5-3B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen2.5-14B-Instruct",
    "Qwen/Qwen2.5-72B-Instruct",
)
PAPER_SIZE = 18608  # prompts in the authors' released estimator dataset


@dataclass(frozen=True)
class ModelProfile:
    # Mean quality gain over the 3B model on a prompt of full difficulty (before the kind's weight).
    gain: float
    # Answer length in tokens before the prompt's factors; gateway/core/engine/profiles.py's
    # mean_output_tokens (the emulator's default when a prompt has no label) is the measured mean.
    mean_output_tokens: float
    # How much longer than its mean the model answers a hard prompt: x (1 + answer_hard * (d - 0.5)),
    # at most 2 (at 2 the factor runs from 0 to 2 with d). The largest model explains its reasoning
    # on exactly the prompts it is chosen for, and answers its easiest ones in a few tokens.
    answer_hard: float = 0.0

    def __post_init__(self):
        if not 0 <= self.answer_hard <= 2:
            raise ValueError("answer_hard must be in [0, 2]: above 2 an easy prompt's length would go negative")


# Paper: always-3B 0.346, always-14B 0.398; 7B between, 72B above. A gain is the advantage at full
# difficulty; the mean of kind_gap * ramp(d) over the workload is about 0.49. The 72B's gain is
# smaller than its size suggests: its wide topic spread (AFFINITY_SCALE) lifts its mean once scores
# are clipped to [0, 1]. Answer lengths: the 72B is the slow tier per request (~195 tokens at
# 47.4 ms/token, longer on the hard prompts it is chosen for), the 14B the concise one. These and
# the tiers' batch slopes (engine/profiles.py) were tuned with `routebalance calibrate`.
MODELS = {
    "Qwen/Qwen2.5-3B-Instruct": ModelProfile(gain=0.0, mean_output_tokens=155),
    "Qwen/Qwen2.5-7B-Instruct": ModelProfile(gain=0.07, mean_output_tokens=145),
    "Qwen/Qwen2.5-14B-Instruct": ModelProfile(gain=0.122, mean_output_tokens=87),
    "Qwen/Qwen2.5-72B-Instruct": ModelProfile(gain=0.07, mean_output_tokens=185, answer_hard=2.0),
}


@dataclass(frozen=True)
class KindProfile:
    share: float  # of all prompts
    length_median: float  # prompt tokens, before the difficulty stretch
    length_sigma: float  # log-normal spread of prompt length
    difficulty: tuple[float, float]  # Beta(a, b) of the latent difficulty
    base: float  # 3B quality at mid difficulty, before topic effects and noise (sets the kind's level)
    gap: float  # how much model size matters for this kind (1 = average)
    answer: float  # answer length relative to the model's overall mean


# Shares follow the paper's sources (RewardBench, CodeUltraFeedback, BeaverTails, LLM-Blender,
# LMSYS-Chat, GSM8K, SQuAD); the safety share matches its 671-of-3,534 safety-flagged test prompts.
# Prompt lengths: short chat and safety asks, GSM8K-sized math, long passages and transcripts; the
# mix gives the paper's mean ~85, median ~55, p90 ~200, p99 ~460 tokens.
# Quality: math and code separate the models most; safety refusals and extractive reading
# comprehension least. Answers: code and long-form longest, refusals and extractive answers shortest.
KINDS = {
    "instruction_following": KindProfile(0.16, 42, 0.90, (2.0, 2.0), 0.325, 1.0, 1.25),
    "code": KindProfile(0.14, 62, 1.00, (2.2, 1.8), 0.275, 1.35, 1.6),
    "safety": KindProfile(0.18, 19, 0.60, (2.0, 2.2), 0.405, 0.6, 0.55),
    "multi_turn_chat": KindProfile(0.12, 118, 0.80, (2.0, 2.0), 0.315, 1.05, 1.0),
    "math": KindProfile(0.11, 46, 0.35, (2.2, 1.8), 0.245, 1.5, 0.9),
    "reading_comprehension": KindProfile(0.11, 162, 0.40, (1.8, 2.2), 0.35, 0.75, 0.45),
    "general_chat": KindProfile(0.18, 20, 0.80, (1.8, 2.2), 0.355, 0.8, 0.95),
}
assert set(KINDS) == set(text.KINDS) and abs(sum(k.share for k in KINDS.values()) - 1) < 1e-9

# Difficulty: easy below 1/3, hard above 2/3 (Beta(2, 2) gives about 26% / 48% / 26%).
LEVEL_CUTS = (1 / 3, 2 / 3)
DIFFICULTY_SLOPE = 0.30  # hard prompts score lower for every model
LENGTH_STRETCH = (0.7, 0.6)  # target length x (0.7 + 0.6 d): hard prompts carry more steps/context
MAX_TARGET_TOKENS = 900

# Noise. Own-model noise grows with difficulty: on easy prompts every model writes about the same
# answer, so scores sit close together; on hard ones they diverge. Its size sets the oracle
# (mean of the per-prompt best, paper 0.582) and, against the systematic gaps, how often the
# best model can be predicted (paper: 34.8% for MiniLM + KNN, 25% at random).
COMMON_NOISE = 0.13
OWN_NOISE = (0.10, 0.16)  # sd = a + b * d
TOPIC_SHIFT_SD = 0.04  # topic-level quality shift shared by all models
# Per-model deviations from the size ranking: one per topic, and one per (topic, difficulty level)
# on top (a topic's hard prompts may favour a different model than its easy ones). Neighbours in
# embedding space share topic and, less reliably, level, so these are what KNN can learn.
AFFINITY_SD = 0.12
LEVEL_AFFINITY_SD = 0.10
# Per pool model, how far its topic rankings stray. The 72B's stray far: on some topics it is far
# ahead of every other model, on others no better than the 14B. That is what makes the quality
# preset send it a fifth of the traffic (paper: "concentrating on 72B") while its mean stays
# only a little above the 14B's; the smaller models' small spread keeps the best model only
# partly predictable.
AFFINITY_SCALE = (0.6, 0.6, 0.6, 5.5)
assert len(AFFINITY_SCALE) == len(POOL_MODELS)

# Answer lengths (log-normal): per-prompt factor shared across models, per-model factor, and a
# topic factor from the world table. The kind's `answer` and the difficulty scale the mean.
ANSWER_SHARED_SIGMA = 0.55
ANSWER_OWN_SIGMA = 0.35
ANSWER_TOPIC_SIGMA = 0.25
ANSWER_DIFFICULTY = (0.7, 0.6)  # x (0.7 + 0.6 d): hard prompts get longer answers
# Divides out the mean of the multiplicative factors and the cap so a model's overall mean lands
# near its mean_output_tokens (measured on generate(18608); the 72B's answer_hard moves its mean
# up, to about 190 tokens).
ANSWER_NORMALISER = 1.195


def ramp(d: float) -> float:
    """How much of a model's size advantage shows at difficulty d: none on easy prompts."""
    return min(max((d - 0.2) / 0.6, 0.0), 1.0)


# --- the fixed world: per-topic tables -----------------------------------------------------------


@dataclass(frozen=True)
class TopicTraits:
    shift: float  # quality shift for every model
    affinity: np.ndarray  # [level, model]: per difficulty level and pool model (POOL_MODELS order)
    answer: float  # answer length factor


def _world_rng(*names: str) -> np.random.Generator:
    digest = hashlib.blake2b("/".join(names).encode(), digest_size=8, person=b"wl-world").digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


@functools.cache  # one table per world's affinity scales
def _build_world(affinity_scale: tuple[float, ...] = AFFINITY_SCALE) -> dict[tuple[str, str], TopicTraits]:
    traits = {}
    for kind in KINDS:
        for topic in text.topics(kind):
            rng = _world_rng(kind, topic)
            shift, answer = rng.normal(0, 1, 2)
            affinity = (rng.normal(0, AFFINITY_SD, len(POOL_MODELS))
                        + rng.normal(0, LEVEL_AFFINITY_SD, (3, len(POOL_MODELS)))) * np.array(affinity_scale)
            traits[kind, topic] = (shift * TOPIC_SHIFT_SD, affinity, answer * ANSWER_TOPIC_SIGMA)
    # Centre the topic tables (weighted by how often each topic occurs), so they move prompts
    # around without moving the per-model means that the paper pins down.
    weights = {kt: KINDS[kt[0]].share / len(text.topics(kt[0])) for kt in traits}
    mean_shift = sum(w * traits[kt][0] for kt, w in weights.items())
    mean_aff = sum(w * traits[kt][1].mean(axis=0) for kt, w in weights.items())
    mean_answer = sum(w * traits[kt][2] for kt, w in weights.items())
    world = {}
    for kt, (shift, aff, ans) in traits.items():
        aff = aff - mean_aff
        aff.setflags(write=False)
        world[kt] = TopicTraits(float(shift - mean_shift), aff, math.exp(ans - mean_answer))
    return world


# --- one record ---------------------------------------------------------------------------------

_KIND_NAMES = tuple(KINDS)
_KIND_CDF = np.cumsum([KINDS[k].share for k in _KIND_NAMES])


@dataclass(frozen=True)
class Latent:
    kind: str
    topic: str
    difficulty: float
    level: int


def _draw_latent(rng: np.random.Generator) -> tuple[Latent, int]:
    u_kind, u_topic, z_len = rng.random(), rng.random(), rng.standard_normal()
    kind = _KIND_NAMES[min(int(np.searchsorted(_KIND_CDF, u_kind, side="right")), len(_KIND_NAMES) - 1)]
    profile = KINDS[kind]
    topics = text.topics(kind)
    topic = topics[min(int(u_topic * len(topics)), len(topics) - 1)]
    d = float(rng.beta(*profile.difficulty))
    level = EASY if d < LEVEL_CUTS[0] else MEDIUM if d < LEVEL_CUTS[1] else HARD
    median = profile.length_median * (LENGTH_STRETCH[0] + LENGTH_STRETCH[1] * d)
    target = int(min(median * math.exp(profile.length_sigma * z_len), MAX_TARGET_TOKENS))
    return Latent(kind, topic, d, level), max(target, 4)


def _write_prompt(dice: Dice, latent: Latent, target: int, seen: set[str]) -> str:
    """The prompt text; rewritten (new random choices) if an earlier record already has it."""
    for _ in range(50):
        prompt = text.write(dice, latent.kind, latent.topic, latent.level, target)
        if prompt not in seen:
            return prompt
        target += 3  # short prompts collide most: let the retry add a little context
    raise RuntimeError(f"could not write a new {latent.kind}/{latent.topic} prompt")


@dataclass(frozen=True)
class LabelConstants:
    """What a world sets of the labels (worlds.py): per model and per kind, and the topics' affinity scales."""

    models: Mapping[str, ModelProfile]
    kinds: Mapping[str, KindProfile]  # only base, gap and answer are read: the prompts stay this module's
    affinity_scale: tuple[float, ...]


CALIBRATED = LabelConstants(MODELS, KINDS, AFFINITY_SCALE)


def _labels(rng: np.random.Generator, latent: Latent, models: Sequence[str],
            world_constants: LabelConstants = CALIBRATED) -> dict[str, ModelLabel]:
    kind = world_constants.kinds[latent.kind]
    world = _build_world(world_constants.affinity_scale)[latent.kind, latent.topic]
    d = latent.difficulty
    # One draw of every noise term for all pool models, whatever subset is asked for, so a
    # model's labels do not depend on which other models are listed.
    common, *own = rng.standard_normal(1 + len(POOL_MODELS))
    shared_len, *own_len = rng.standard_normal(1 + len(POOL_MODELS))

    everyone = kind.base + world.shift + DIFFICULTY_SLOPE * (0.5 - d) + COMMON_NOISE * common
    spread = OWN_NOISE[0] + OWN_NOISE[1] * d
    answer = (kind.answer * world.answer * (ANSWER_DIFFICULTY[0] + ANSWER_DIFFICULTY[1] * d)
              * math.exp(ANSWER_SHARED_SIGMA * shared_len) / ANSWER_NORMALISER)
    labels = {}
    for name in models:
        i = POOL_MODELS.index(name)
        profile = world_constants.models[name]
        q = everyone + (profile.gain * kind.gap + world.affinity[latent.level, i]) * ramp(d) + spread * own[i]
        length = (profile.mean_output_tokens * answer * (1 + profile.answer_hard * (d - 0.5))
                  * math.exp(ANSWER_OWN_SIGMA * own_len[i]))
        labels[name] = ModelLabel(
            score=round(float(min(max(q, 0.0), 1.0)), 4),
            output_length=int(min(max(round(length), 1), MAX_OUTPUT_TOKENS)),
        )
    return labels


def _binarised(rng: np.random.Generator, labels: dict[str, ModelLabel]) -> dict[str, ModelLabel]:
    """0/1 scores with P(1) = the graded score; one draw per pool model whatever subset is labelled."""
    draws = dict(zip(POOL_MODELS, rng.random(len(POOL_MODELS)), strict=True))
    return {m: ModelLabel(score=float(draws[m] < lab.score), output_length=lab.output_length)
            for m, lab in labels.items()}


def latents(n: int = PAPER_SIZE, seed: int = 0) -> list[Latent]:
    """The hidden state behind generate(n, seed)[i] (kind, topic, difficulty, level), without the text.

    For analysis and tests: how much of the labels a given estimator recovers.
    """
    return [_draw_latent(np.random.default_rng((seed, i, 0)))[0] for i in range(n)]


def generate(n: int = PAPER_SIZE, seed: int = 0, models: Sequence[str] = POOL_MODELS,
             binary: bool = False, world: LabelConstants = CALIBRATED) -> list[Record]:
    """n labelled records, deterministic for (n, seed); generate(n) is a prefix of generate(m > n).

    binary: each score becomes a 0/1 judgement drawn with the graded score as its probability
    (correct or not, as many real data sets label answers); same prompts, same lengths.
    world: the labels' constants (worlds.py); the prompts are the same in every world.
    """
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"no synthetic calibration for {unknown}; known: {list(MODELS)}")
    records: list[Record] = []
    seen: set[str] = set()
    for i in range(n):
        text_rng = np.random.default_rng((seed, i, 0))
        latent, target = _draw_latent(text_rng)
        prompt = _write_prompt(Dice(text_rng), latent, target, seen)
        seen.add(prompt)
        labels = _labels(np.random.default_rng((seed, i, 1)), latent, models, world)
        if binary:
            labels = _binarised(np.random.default_rng((seed, i, 2)), labels)
        records.append(Record(
            id=prompt_key(prompt), prompt=prompt, kind=latent.kind,
            input_len=estimate_tokens(prompt), models=labels,
        ))
    return records
