"""General chat (LMSYS-Chat-like): short everyday questions, sometimes with a line or two of context.

Easy ones are factual one-liners; hard ones ask for nuance, comparison or a careful
explanation.
"""

from __future__ import annotations

from .common import EASY, Dice, deck, fill, voice

KIND = "general_chat"

_BOOKS = ("The Martian", "Pride and Prejudice", "Dune", "The Hobbit", "Sapiens", "Gone Girl", "Project Hail Mary",
          "The Night Circus", "Educated", "1984")
_SHOWS = ("Breaking Bad", "The Office", "Dark", "Succession", "Stranger Things", "The Crown", "Severance", "Fleabag")
_CITIES = ("Lisbon", "Kyoto", "Mexico City", "Prague", "Cape Town", "Vancouver", "Istanbul", "Hanoi", "Edinburgh",
           "Buenos Aires", "Seoul", "Marrakech")
_DISHES = ("lasagna", "pad thai", "banana bread", "chicken curry", "risotto", "sourdough", "shakshuka", "ramen",
           "chili", "pancakes", "guacamole", "paella")
_GADGETS = ("iPhone", "Android phone", "laptop", "Windows PC", "MacBook", "smart TV", "printer", "router",
            "Bluetooth headphones")


def _recommend(d: Dice, level: int) -> str:
    b, s = d.pick(_BOOKS), d.pick(_SHOWS)
    genre = d.pick(("sci-fi", "horror", "romantic comedy", "mystery", "fantasy", "historical", "feel-good", "thriller"))
    subject = d.pick(("history", "science", "true crime", "economics", "psychology", "space", "music", "cooking"))
    return d.by_level(level, (
        f"Recommend a book like {b}.", f"What should I watch after {s}?", f"Any good podcasts about {subject}?",
        f"Suggest a {genre} movie for a rainy Sunday.", f"What's a good {genre} book for a teenager?",
        f"Recommend a {genre} series like {s}.",
    ), (
        f"I loved {b} and {s}. What else would I probably enjoy, and why?",
        "Give me five albums to get into jazz, in the order I should listen to them.",
    ), (
        f"Compare {b} with two similar books in terms of themes and writing style, and tell me which to read next "
        f"given I found {s} too slow.",
    ))


_COUNTRIES = ("Australia", "Canada", "Brazil", "Kenya", "Norway", "Vietnam", "Peru", "Turkey", "New Zealand",
              "Morocco", "Switzerland", "Indonesia", "Chile", "Egypt", "Poland")
_ANIMALS = (("cats", "purr"), ("dogs", "wag their tails"), ("birds", "migrate"), ("whales", "sing"),
            ("bees", "dance"), ("owls", "hunt at night"), ("zebras", "have stripes"), ("camels", "have humps"))
_PAIRS = (("a crocodile", "an alligator"), ("weather", "climate"), ("a virus", "bacteria"), ("a latte", "a cappuccino"),
          ("a hurricane", "a typhoon"), ("a frog", "a toad"), ("baking soda", "baking powder"), ("RAM", "storage"))


def _trivia(d: Dice, level: int) -> str:
    animals, habit = d.pick(_ANIMALS)
    x, y = d.pick(_PAIRS)
    return d.by_level(level, (
        f"What's the capital of {d.pick(_COUNTRIES)}?", "How far is the moon?", "Who painted the Mona Lisa?",
        f"How many people live in {d.pick(_COUNTRIES)}?", f"What's the difference between {x} and {y}?",
        f"When did {d.pick(('World War 2', 'the Cold War', 'the Roman Empire', 'the Middle Ages'))} end?",
        "Why is the sky blue?", f"Why do {animals} {habit}?", f"What language do they speak in {d.pick(_COUNTRIES)}?",
    ), (
        "Why did the Roman Empire fall?", "How do vaccines work?", "Why do we have leap years?",
        "How does a refrigerator actually keep things cold?",
    ), (
        "Explain why time runs slower near a massive object, in a way a smart teenager would understand, without "
        "hand-waving.",
        "What really caused the 2008 financial crisis? Give the main competing explanations.",
    ))


def _travel(d: Dice, level: int) -> str:
    c = d.pick(_CITIES)
    days = d.between(2, 10)
    return d.by_level(level, (
        f"What's the best time of year to visit {c}?", f"Is {c} safe for tourists?", f"What should I eat in {c}?",
    ), (
        f"Plan {days} days in {c} for someone who likes food and museums.",
        f"Is it better to stay near the center or outside {c} on a budget?",
    ), (
        f"I have {days} days and about $1500 for {c} and one nearby city. Compare routes, transport and where to stay, "
        "and flag anything I should book in advance.",
    ))


def _cooking(d: Dice, level: int) -> str:
    dish = d.pick(_DISHES)
    return d.by_level(level, (
        f"How long do I bake {dish}?", f"Can I freeze {dish}?", f"What goes well with {dish}?",
    ), (
        f"Give me a recipe for {dish} that doesn't need an oven.", f"Why did my {dish} turn out dry?",
        f"How do I make {dish} vegan?",
    ), (
        f"Explain the chemistry of what goes wrong when {dish} fails, and how to adjust the recipe at high altitude.",
    ))


def _health(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "How much water should I drink a day?", "Is coffee bad for you?", "How many steps a day is healthy?",
        "What's a good stretch for lower back pain?",
    ), (
        "Make me a 3-day beginner workout plan.", "Why do I wake up tired even after 8 hours of sleep?",
        "Is intermittent fasting actually better for weight loss?",
    ), (
        "Summarize what the evidence says about creatine for people over 50, including the weak spots in the research.",
    ))


def _relationships(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "How do I make friends as an adult?", "What's a good first date idea?", "How do I say no politely?",
    ), (
        "My best friend hasn't replied in weeks. Should I reach out again?",
        "How do I tell my partner I need more space without hurting them?",
    ), (
        "My sister and my wife don't get along and both want me to take sides about a holiday plan. How do I handle "
        "this fairly?",
    ))


def _creative(d: Dice, level: int) -> str:
    thing = d.pick(("cats", "Mondays", "coffee", "the ocean", "programmers", "my dog", "autumn", "pizza"))
    return d.by_level(level, (
        f"Tell me a joke about {thing}.", f"Write a haiku about {thing}.", f"Give me a pun about {thing}.",
    ), (
        f"Write a short poem about {thing} in the style of Dr. Seuss.", f"Write a limerick about {thing}.",
    ), (
        f"Write a sonnet about {thing} with a proper volta, and explain the rhyme scheme you used.",
    ))


def _tech(d: Dice, level: int) -> str:
    g = d.pick(_GADGETS)
    return d.by_level(level, (
        f"How do I take a screenshot on my {g}?", f"My {g} won't turn on. What do I do?",
        f"How do I update my {g}?",
    ), (
        f"My {g} has been really slow lately. What can I do to speed it up?",
        "Should I buy a laptop or a tablet for university?",
    ), (
        f"My {g} keeps dropping the wifi connection but other devices are fine. Walk me through a systematic "
        "troubleshooting process.",
    ))


def _language(d: Dice, level: int) -> str:
    lang = d.pick(("French", "Spanish", "German", "Japanese", "Italian", "Portuguese", "Korean"))
    return d.by_level(level, (
        f"How do you say 'good morning' in {lang}?", f"Translate 'where is the train station' into {lang}.",
        "What's the difference between affect and effect?",
    ), (
        f"What's the fastest way to learn basic {lang} for a trip?", "When do I use 'whom' instead of 'who'?",
    ), (
        f"Explain the difference between the two past tenses in {lang} with examples where the choice changes the "
        "meaning.",
    ))


def _opinion(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "What's the meaning of life?", "Are cats better than dogs?", "Is a hot dog a sandwich?",
    ), (
        "Do you think AI will take most jobs?", "Is it worth going to college nowadays?",
    ), (
        "Steelman both sides of the free will debate and tell me which argument you find weakest.",
    ))


def _money(d: Dice, level: int) -> str:
    return d.by_level(level, (
        "What is a credit score?", "Should I pay off debt or save first?", "What's an index fund?",
    ), (
        f"I make ${d.between(30, 120)}k a year. How much should I put into retirement?",
        "Explain how a mortgage works like I'm 12.",
    ), (
        "Compare renting versus buying in a high-cost city over ten years, listing the assumptions that matter most.",
    ))


TOPICS = {
    "recommendations": _recommend, "trivia": _trivia, "travel": _travel, "cooking": _cooking,
    "health": _health, "relationships": _relationships, "creative": _creative, "tech_help": _tech,
    "language": _language, "opinion": _opinion, "money": _money,
}

# Context people add: some about the topic, some about themselves.
_TOPIC_CONTEXT = {
    "recommendations": ("I mostly read on the train.", "I like slow-burn stories.", "Nothing too violent please.",
                        "I just finished a long series and need something new."),
    "trivia": ("My kid asked me this and I didn't know.", "We learned this in school but I forgot.",
               "I saw a documentary about it."),
    "travel": ("It's my first trip abroad.", "I'm traveling with my partner.", "I don't speak the language.",
               "We'll be there in the spring."),
    "cooking": ("I have a gas stove.", "I'm cooking for my in-laws.", "I don't own a stand mixer.",
                "I followed the recipe exactly."),
    "health": ("I'm not a very active person.", "I sit at a desk all day.", "My doctor said I'm healthy overall.",
               "I sleep about six hours a night."),
    "relationships": ("We've been together three years.", "I'm pretty shy.", "I just moved to a new city.",
                      "I don't want to make things awkward."),
    "creative": ("It's for my friend's birthday card.", "Make it funny.", "It's for a school assignment.",
                 "Keep it clean, it's for kids."),
    "tech_help": ("I already tried restarting it.", "It's about two years old.", "I'm not very good with computers.",
                  "It started after the last update."),
    "language": ("I'm a complete beginner.", "I'm going there next month.", "My partner's family speaks it.",
                 "I studied it in school years ago."),
    "opinion": ("Be honest, not diplomatic.", "I've been thinking about this a lot lately.",
                "Just curious what you think."),
    "money": ("I have some credit card debt.", "I just started my first job.", "I'm self-employed.",
              "I don't know much about investing."),
}
_CONTEXT = (
    "I'm {age}.", "Thanks in advance!", "Sorry if this is a dumb question.",
    "My friends and I were arguing about this.",
    "Keep it short please.", "I'm on a tight budget.", "I'm asking for my mom.", "It's been bugging me all week.",
)


def write(d: Dice, topic: str, level: int, target: int) -> str:
    pieces = [TOPICS[topic](d, level)]
    context = deck(d, lambda: tuple(c.replace("{age}", str(d.between(18, 70)))
                                     for c in (*_TOPIC_CONTEXT[topic], *_CONTEXT)))
    if level != EASY or d.chance(0.5):
        fill(pieces, context, target, at=0 if d.chance(0.5) else None, limit=4)
    return voice(d, " ".join(pieces))
