"""Grade-school math word problems (GSM8K-like) plus a little algebra and probability.

Harder problems have more steps (more sentences) and ask for the work to be shown.
"""

from __future__ import annotations

from .common import EASY, HARD, NAMES, Dice, count, deck, fill, money, plural

KIND = "math"

ITEMS = (("notebook", 3), ("pen", 1.5), ("backpack", 28), ("water bottle", 9), ("pair of socks", 4),
         ("sandwich", 6), ("book", 12), ("board game", 25), ("candle", 5), ("plant pot", 7), ("mug", 8),
         ("phone case", 15), ("ticket", 18), ("bag of apples", 4), ("loaf of bread", 3))
# (vehicle, typical speed range in km/h, in steps of 5)
VEHICLES = (("train", 12, 30), ("cyclist", 3, 6), ("bus", 6, 14), ("car", 10, 24), ("ferry", 4, 8), ("runner", 2, 3),
            ("delivery van", 8, 18), ("hiker", 1, 1))
GROUPS = (("students", "school club"), ("guests", "wedding"), ("runners", "marathon"), ("players", "chess tournament"),
          ("volunteers", "beach clean-up"), ("employees", "company picnic"), ("members", "library book club"))
FOODS = (("cookies", "cups of flour"), ("pancakes", "eggs"), ("muffins", "cups of sugar"), ("loaves", "cups of water"),
         ("servings of soup", "carrots"), ("cupcakes", "tablespoons of butter"))
JOBS = (("painters", "paint a fence"), ("pumps", "fill a pool"), ("printers", "print a batch of flyers"),
        ("workers", "pack 600 boxes"), ("bakers", "bake 240 rolls"))


def _n(d: Dice, lo: int, hi: int) -> int:
    return d.between(lo, hi)


def _shopping(d: Dice, level: int):
    name = d.pick(NAMES)
    item, price = d.pick(ITEMS)
    k = _n(d, 2, 9)
    setup = [f"{name} buys {count(k, item)} for {money(price)} each."]

    def step() -> tuple[str, ...]:
        other, p = d.pick(ITEMS)
        return (
            f"{name} also picks up {count(_n(d, 2, 6), other)} at {money(p)} apiece.",
            f"At the next shop, {name} spends {money(p * _n(d, 2, 4))} on {plural(other)}.",
            f"The store gives a discount of {money(_n(d, 1, 5))} on every purchase over {money(_n(d, 10, 30))}.",
            f"Sales tax of {_n(d, 5, 9)}% is added to the total at the register.",
            f"{name} returns one {item} because it was damaged and gets a full refund.",
        )

    question = d.pick((
        f"If {name} pays with {a_bill(d)}, how much change does {name} get back?",
        f"How much money does {name} spend in total?",
        f"How much more would {name} have paid without any discounts?",
    ))
    return setup, step, question


def a_bill(d: Dice) -> str:
    return "a " + money(d.pick((50, 100, 200))) + " bill"


def _travel(d: Dice, level: int):
    v, lo, hi = d.pick(VEHICLES)
    speed = _n(d, lo, hi) * 5
    hours = d.pick((1.5, 2, 2.5, 3, 4))
    setup = [f"A {v} travels at {speed} kilometers per hour for {hours} hours."]
    other, lo2, hi2 = d.pick(VEHICLES)

    def step() -> tuple[str, ...]:
        return (
            f"It then stops for {_n(d, 10, 45)} minutes to rest.",
            f"After that it speeds up by {_n(d, 1, 2) * 5} kilometers per hour for the next "
            f"{count(_n(d, 1, 3), 'hour')}.",
            f"Because of a detour, it has to go back {_n(d, 5, 30)} kilometers.",
            f"For the final stretch it slows to {max(speed - 5 * _n(d, 1, 2), 5)} kilometers per hour.",
        )

    question = d.pick((
        "How far does it travel altogether?",
        "What is its average speed for the whole trip, including stops?",
        "How long does the whole trip take, in hours and minutes?",
        f"A {other} leaves from the same place an hour later at {_n(d, lo2, hi2) * 5} km/h. When does it catch up, if "
        "it does?",
    ))
    return setup, step, question


def _fractions(d: Dice, level: int):
    who, where = d.pick(GROUPS)
    total = _n(d, 4, 30) * 12
    setup = [f"There are {total} {who} at the {where}."]
    fracs = ("one third", "a quarter", "two fifths", "half", "three quarters", "one sixth")

    def step() -> tuple[str, ...]:
        return (
            f"{d.pick(fracs).capitalize()} of them arrive before noon.",
            f"Of the rest, {d.pick(fracs)} wear blue shirts.",
            f"{_n(d, 3, 20)} more {who} join later in the afternoon.",
            f"{d.pick(fracs).capitalize()} of the remaining {who} leave early.",
            f"Twice as many {who} sign up for the morning session as for the evening one.",
        )

    question = d.pick((
        f"How many {who} are still there at the end of the day?",
        f"How many {who} did not wear blue shirts?",
        f"What fraction of the original {who} stayed the whole time?",
    ))
    return setup, step, question


def _percent(d: Dice, level: int):
    name = d.pick(NAMES)
    price = _n(d, 4, 60) * 5
    thing = d.pick(("jacket", "bicycle", "laptop", "sofa", "pair of boots", "camera", "guitar"))
    setup = [f"A {thing} normally costs {money(price)}, and {name} wants to buy it."]

    def step() -> tuple[str, ...]:
        return (
            f"This week it is on sale for {_n(d, 2, 8) * 5}% off.",
            f"{name} has a coupon for an extra {_n(d, 1, 3) * 5}% off the sale price.",
            f"{name} earns {money(_n(d, 8, 25))} an hour and works {_n(d, 3, 12)} hours a week.",
            f"The shop charges {_n(d, 5, 12)}% tax on the final price.",
            f"Last month the price went up by {_n(d, 1, 4) * 5}% before the sale started.",
        )

    question = d.pick((
        "What is the final price?",
        f"How many weeks does {name} need to work to afford it?",
        "By what percent did the price change overall?",
    ))
    return setup, step, question


def _work_rate(d: Dice, level: int):
    who, task = d.pick(JOBS)
    k = _n(d, 2, 6)
    h = _n(d, 3, 12)
    setup = [f"{k} {who} working together can {task} in {h} hours."]

    def step() -> tuple[str, ...]:
        return (
            f"After {count(_n(d, 1, 3), 'hour')}, {_n(d, 1, 2)} more {who} join them.",
            f"One of the {who} works at only half the speed of the others.",
            f"They take a {_n(d, 15, 60)} minute break halfway through.",
            f"The job is then made {_n(d, 2, 3)} times bigger.",
        )

    question = d.pick((
        f"How long would it take {k + _n(d, 1, 4)} {who} to do the same job?",
        "How many hours does the whole job take?",
        f"How long would it take one of the {who} working alone?",
    ))
    return setup, step, question


def _ages(d: Dice, level: int):
    a, b = d.sample(NAMES, 2)
    setup = [f"{a} is {_n(d, 2, 4)} times as old as {b}."]

    def step() -> tuple[str, ...]:
        c = d.pick(NAMES)
        return (
            f"In {_n(d, 3, 12)} years, {a} will be twice as old as {b}.",
            f"{c} is {_n(d, 2, 9)} years younger than {a}.",
            f"The sum of their ages is {_n(d, 30, 90)}.",
            f"{_n(d, 4, 10)} years ago, {b} was a third of {a}'s age.",
        )

    question = d.pick((f"How old is {b} now?", f"How old will {a} be in 5 years?", "What are their current ages?"))
    return setup, step, question


def _geometry(d: Dice, level: int):
    shape = d.pick(("rectangular garden", "square patio", "rectangular pool", "circular pond", "triangular plot"))
    width, length = _n(d, 4, 20), _n(d, 6, 40)
    setup = [f"A {shape} measures {width} meters by {length} meters."]

    def step() -> tuple[str, ...]:
        return (
            f"A path {_n(d, 1, 3)} meter wide runs all the way around it.",
            f"Fencing costs {money(_n(d, 6, 30))} per meter.",
            f"Tiles are {_n(d, 20, 60)} centimeters on each side and come in boxes of {_n(d, 10, 40)}.",
            f"One corner, {_n(d, 2, 5)} by {_n(d, 2, 5)} meters, is left as grass.",
            f"Soil is added to a depth of {_n(d, 10, 40)} centimeters.",
        )

    question = d.pick((
        "What is the area that needs to be covered?",
        "How much will the fencing cost in total?",
        "How many boxes of tiles are needed?",
        "What volume of soil is needed, in cubic meters?",
    ))
    return setup, step, question


def _recipes(d: Dice, level: int):
    food, ingredient = d.pick(FOODS)
    n, q = _n(d, 12, 48), _n(d, 2, 6)
    name = d.pick(NAMES)
    setup = [f"A recipe makes {n} {food} and uses {q} {ingredient}."]

    def step() -> tuple[str, ...]:
        return (
            f"{name} needs to make {_n(d, 2, 8) * n // 2} {food} for a bake sale.",
            f"{name} only has {_n(d, 3, 20)} {ingredient} left in the pantry.",
            f"Each batch takes {_n(d, 15, 50)} minutes in the oven, and the oven holds one batch at a time.",
            f"A bag of {ingredient.split(' of ')[-1]} costs {money(_n(d, 2, 9))}.",
        )

    question = d.pick((
        f"How many {ingredient} does {name} need?",
        "How long will all the baking take?",
        f"How many {food} can {name} make with what is left?",
    ))
    return setup, step, question


def _schedule(d: Dice, level: int):
    name = d.pick(NAMES)
    start = _n(d, 6, 10)
    setup = [f"{name} starts work at {start}:{d.pick(('00', '15', '30', '45'))} a.m."]

    def step() -> tuple[str, ...]:
        return (
            f"Each meeting lasts {_n(d, 20, 90)} minutes and {name} has {_n(d, 2, 5)} of them.",
            f"Lunch takes {_n(d, 30, 60)} minutes.",
            f"The commute home takes {_n(d, 20, 75)} minutes.",
            f"{name} spends {_n(d, 2, 4)} hours answering emails in blocks of {_n(d, 15, 45)} minutes.",
            f"On Fridays the day is {count(_n(d, 1, 2), 'hour')} shorter.",
        )

    question = d.pick((
        f"At what time does {name} get home?",
        f"How many hours does {name} work in a five-day week?",
        f"How much free time does {name} have before 6 p.m.?",
    ))
    return setup, step, question


def _probability(d: Dice, level: int):
    r, b, g = _n(d, 2, 9), _n(d, 2, 9), _n(d, 1, 6)
    setup = [f"A bag holds {r} red marbles, {b} blue marbles and {g} green marbles."]

    def step() -> tuple[str, ...]:
        return (
            "Two marbles are drawn one after another without replacement.",
            f"{_n(d, 1, 3)} blue marbles are removed before the draw.",
            "After each draw the marble is put back and the bag is shaken.",
            f"A fair six-sided die is also rolled, and you win if it shows more than {_n(d, 2, 4)}.",
        )

    question = d.pick((
        "What is the probability that both marbles are red?",
        "What is the probability of drawing at least one green marble?",
        "What is the chance of winning? Give the answer as a fraction.",
    ))
    return setup, step, question


def _algebra(d: Dice, level: int):
    a_, b, c = _n(d, 2, 9), _n(d, 1, 30), _n(d, 10, 90)
    setup = [d.pick((
        f"Solve for x: {a_}x + {b} = {c}.",
        f"Find all real solutions of x^2 - {a_ + b}x + {a_ * b} = 0.",
        f"The sum of two numbers is {c} and their difference is {b}.",
        f"A line passes through the points ({a_}, {b}) and ({a_ + 3}, {c}).",
    ))]

    def step() -> tuple[str, ...]:
        return (
            f"Also, y = {a_}x - {_n(d, 1, 9)}.",
            f"Assume x is a positive integer less than {_n(d, 20, 60)}.",
            "Then check the result by substituting it back into the original equation.",
            f"Then find where it crosses the line y = {_n(d, 1, 9)}x.",
        )

    question = d.pick(("What is x?", "What are the two numbers?", "What is the slope and the y-intercept?",
                       "Give the exact answer."))
    return setup, step, question


TOPICS = {
    "shopping": _shopping, "travel": _travel, "fractions": _fractions, "percent": _percent,
    "work_rate": _work_rate, "ages": _ages, "geometry": _geometry, "recipes": _recipes,
    "schedule": _schedule, "probability": _probability, "algebra": _algebra,
}

_EASY_ASKS = ("", "", "Just give the number.", "Quick one:")
_HARD_ASKS = ("Show your work step by step and double-check the final answer.",
              "Explain each step of your reasoning carefully before giving the final answer.",
              "Work through it rigorously, state any assumptions, and verify the result.")


def write(d: Dice, topic: str, level: int, target: int) -> str:
    setup, step, question = TOPICS[topic](d, level)
    pieces = fill(list(setup), deck(d, step), target - 10, limit=len(step()))
    pieces.append(question)
    if level == HARD:
        pieces.append(d.pick(_HARD_ASKS))
    elif level == EASY:
        ask = d.pick(_EASY_ASKS)
        if ask == "Quick one:":
            pieces.insert(0, ask)
        elif ask:
            pieces.append(ask)
    elif d.chance(0.3):
        pieces.append("Explain your answer.")
    return " ".join(pieces)
