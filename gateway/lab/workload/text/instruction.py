"""Instruction following (MixInstruct / RewardBench-like): write, rewrite, summarize, extract or plan,
often with explicit constraints on format and length, sometimes over a pasted text.

Harder prompts stack more constraints, which is what separates models here.
"""

from __future__ import annotations

from .common import EASY, HARD, NAMES, Dice, a, deck, fill, proper_name, voice

KIND = "instruction_following"

_PRODUCTS = ("pair of noise-cancelling headphones", "standing desk", "reusable water bottle", "electric toothbrush",
             "hiking backpack", "smart thermostat", "espresso machine", "yoga mat", "e-reader", "air purifier")
_AUDIENCES = ("busy parents", "college students", "small business owners", "retirees", "software engineers",
              "first-time home buyers", "nurses", "high school teachers")
_SUBJECTS = ("remote work", "urban gardening", "the history of tea", "electric cars", "sleep hygiene", "volunteering",
             "learning a second language", "minimalism", "public libraries", "renewable energy", "budget travel",
             "board games", "beekeeping", "street food", "the four-day work week", "recycling", "home composting",
             "video game design", "birdwatching", "personal finance apps")


def _email(d: Dice, level: int) -> str:
    who = d.pick(("my manager", "a client", "my landlord", "a professor", "the HR team", "a supplier", "my team"))
    why = d.pick(("asking for a deadline extension", "declining a meeting invitation",
                  "following up on an unpaid invoice", "requesting a day off next Friday",
                  "apologizing for a delayed shipment", "introducing a new colleague", "reporting a broken heater"))
    return d.by_level(level, (
        f"Write a short email to {who} {why}.", f"Write an email to {who} {why}.",
    ), (
        f"Write a polite but firm email to {who} {why}. Keep it under 150 words.",
        f"Draft an email to {who} {why}. Use a friendly tone and end with a clear next step.",
    ), (
        f"Write an email to {who} {why}. It must be under 120 words, contain exactly three paragraphs, not use the "
        "word 'sorry', and end with a question.",
    ))


def _summarize(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "Summarize the following text in one sentence.", "Give me a short summary of this:", "TL;DR this:",
    ), (
        "Summarize the text below in three bullet points.", "Summarize the following for a busy executive.",
    ), (
        "Summarize the text below in exactly 50 words, then list any claims in it that would need a source, and "
        "finish with one question the author leaves unanswered.",
    ))


def _rewrite(d: Dice, level: int) -> str:
    tone = d.pick(("more formal", "friendlier", "more concise", "more persuasive", "simpler", "more professional"))
    return d.by_level(level, (
        f"Make this {tone}:", "Fix the grammar in this paragraph:", f"Rewrite this to sound {tone}:",
    ), (
        f"Rewrite the following paragraph to be {tone}, keeping all the facts.",
        "Paraphrase this text so it doesn't repeat any of the original sentences.",
    ), (
        f"Rewrite the text below to be {tone} for an audience of {d.pick(_AUDIENCES)}, keep it the same length, keep "
        "every number exactly, and mark each change you made in brackets.",
    ))


def _brainstorm(d: Dice, level: int) -> str:
    topic = d.pick(_SUBJECTS)
    k = d.between(3, 12)
    return d.by_level(level, (
        f"Give me {k} ideas for a blog post about {topic}.", f"List {k} names for a podcast about {topic}.",
    ), (
        f"Brainstorm {k} fundraising ideas for a school that involve {topic}. Rank them by cost.",
        f"List {k} interview questions about {topic}, grouped by difficulty.",
    ), (
        f"Give {k} startup ideas related to {topic} for {d.pick(_AUDIENCES)}. For each, give the target customer, a "
        "one-line pitch and the biggest risk, formatted as a table.",
    ))


def _product(d: Dice, level: int) -> str:
    p = d.pick(_PRODUCTS)
    aud = d.pick(_AUDIENCES)
    return d.by_level(level, (
        f"Write a product description for {a(p)}.", f"Write a tagline for {a(p)}.",
        f"Write a short ad for {a(p)} aimed at {aud}.", f"Give me a catchy name for a new {p}.",
    ), (
        f"Write a product description for {a(p)} aimed at {aud}. Mention three features.",
        f"Write an Instagram caption for {a(p)} launch with two hashtags.",
    ), (
        f"Write three versions of a landing-page headline and subheadline for {a(p)} aimed at {aud}: one playful, one "
        "premium, one data-driven. Each headline must be under 10 words.",
    ))


def _explain(d: Dice, level: int) -> str:
    topic = d.pick(_SUBJECTS)
    return d.by_level(level, (
        f"Write a paragraph about {topic}.", f"Explain {topic} to a child.",
        f"Write a short intro about {topic} for {d.pick(_AUDIENCES)}.", f"Give me three fun facts about {topic}.",
    ), (
        f"Write a 300-word essay on the benefits and drawbacks of {topic}.",
        f"Explain {topic} to {d.pick(_AUDIENCES)} using an analogy.",
    ), (
        f"Write a balanced 500-word essay on {topic} with an introduction, two arguments for, two against, and a "
        "conclusion; use no first-person pronouns and cite the kind of evidence each argument would need.",
    ))


def _extract(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "List all the names mentioned in this text:", "What is the sentiment of this review: positive or negative?",
    ), (
        "Extract every date and amount of money from the text below as a list.",
        "Classify each sentence of the following text as fact or opinion.",
    ), (
        "Extract all people, organizations and dates from the text below and return them as JSON with keys `people`, "
        "`orgs`, `dates`; dates in ISO format; no extra commentary.",
    ))


def _story(d: Dice, level: int) -> str:
    hero = d.pick(NAMES)
    setting = d.pick(("a lighthouse", "a space station", "a small bakery", "a haunted library", "a desert town",
                      "a submarine", "a mountain village"))
    return d.by_level(level, (
        f"Write a short story about {hero} in {setting}.", f"Write a poem about {setting}.",
    ), (
        f"Write a 200-word story set in {setting} with a twist ending.",
        f"Write a story for children about {hero}, who lives in {setting}, that teaches sharing.",
    ), (
        f"Write a story set in {setting} in exactly six sentences, where each sentence starts with the next letter of "
        f"the name {hero.upper()[:6]}, and the last sentence reveals the narrator's identity.",
    ))


def _plan(d: Dice, level: int) -> str:
    weeks = d.between(2, 12)
    goal = d.pick(("run a 10k", "learn basic Spanish", "prepare for a job interview", "read 12 books", "save $2,000",
                   "learn to cook", "pass a statistics exam", "declutter my home"))
    return d.by_level(level, (
        f"Make a plan to {goal}.", f"Give me a checklist to {goal}.", f"List five tips to {goal} in {weeks} weeks.",
    ), (
        f"Create a {weeks}-week plan to {goal}. Put it in a table with one row per week.",
    ), (
        f"Create a {weeks}-week plan to {goal} for someone with only 30 minutes a day, with weekly milestones, a "
        "fallback if a week is missed, and a way to measure progress.",
    ))


def _format(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "Turn this into a bulleted list:", "Convert this text into a table:",
    ), (
        "Convert the following notes into a markdown table with columns Name, Role and Deadline.",
        "Turn the text below into a numbered list of action items.",
    ), (
        "Convert the notes below into valid YAML with a list of tasks, each with owner, due date and status; infer "
        "missing statuses as 'open' and list what you inferred.",
    ))


TOPICS = {
    "email": _email, "summarize": _summarize, "rewrite": _rewrite, "brainstorm": _brainstorm,
    "product_copy": _product, "explain": _explain, "extract": _extract, "story": _story, "plan": _plan,
    "format": _format,
}
# These instructions act on a pasted text, so they always carry one.
NEEDS_TEXT = {"summarize", "rewrite", "extract", "format"}


def _source_sentences(d: Dice):
    """Sentences of a memo, review or news item to paste under an instruction."""
    org = proper_name(d) + d.pick((" Ltd", " Council", " Labs", " Foundation", " Group"))
    person, other = d.sample(NAMES, 2)

    def options() -> tuple[str, ...]:
        return (
            f"{person} from {org} said the project is {d.between(2, 9)} weeks behind schedule.",
            f"The budget for the next quarter was set at ${d.between(10, 900)},000.",
            f"On {d.pick(('March', 'June', 'October', 'January'))} {d.between(1, 28)}, the team agreed to move the "
            "launch.",
            f"Customers complained that the {d.pick(_PRODUCTS)} stopped working after a week.",
            f"{other} will own the supplier contracts until the new hire starts.",
            "Honestly I think the new design looks much better than the old one.",
            f"Attendance at the event rose by {d.between(5, 60)} percent compared with last year.",
            f"The council plans to open {d.between(2, 8)} new cycling lanes before the summer.",
            "Several people raised concerns about the lack of parking near the venue.",
            f"{person} asked everyone to submit their reports by Friday.",
            "The delivery arrived two days late and one box was damaged.",
            f"Overall satisfaction was {d.between(55, 95)}% in the latest survey.",
            "I would not recommend it to anyone who travels a lot.",
            f"{org} announced a partnership with a regional hospital.",
        )

    return deck(d, options)


_CONSTRAINTS = (
    "Use bullet points.", "Keep it under 100 words.", "Don't use jargon.", "Use British spelling.",
    "Write it in the second person.", "Include a title.", "End with a call to action.", "Avoid exclamation marks.",
    "Make it sound human, not like AI.", "Use a warm tone.", "Add a short conclusion.", "No more than five sentences.",
)


def write(d: Dice, topic: str, level: int, target: int) -> str:
    pieces = [TOPICS[topic](d, level)]
    constraints = deck(d, lambda: _CONSTRAINTS)
    n_constraints = (0, 1, 2)[level] if d.chance(0.6) else 0
    pieces.extend(constraints() for _ in range(n_constraints))
    head = " ".join(pieces)
    if topic in NEEDS_TEXT or target > 60:
        source = fill([], _source_sentences(d), max(target - len(head) // 4 - 4, 20), limit=30)
        lead = "" if topic in NEEDS_TEXT else d.pick(("Use these notes:", "Background:", "Some context from my notes:",
                                                      "Base it on this:")) + "\n"
        return head + "\n\n" + lead + " ".join(source)
    if level != EASY:
        fill(pieces, constraints, target, limit=3 if level == HARD else 1)
        return " ".join(pieces)
    return voice(d, " ".join(pieces))
