"""Reading comprehension (SQuAD-like): a passage about an invented subject and a question on it.

Easy questions look up one fact; hard ones need inference across sentences or may be
unanswerable from the passage.
"""

from __future__ import annotations

from .common import EASY, HARD, NAMES, Dice, deck, fill, proper_name

KIND = "reading_comprehension"


def _city(d: Dice, x: str):
    y = d.between(900, 1850)
    return (
        (f"{x} was founded in {y} as a small trading post on the river.", f"When was {x} founded?"),
        (f"By {y + d.between(50, 300)}, the town had grown into a regional center for the wool trade.",
         "What trade made the town a regional center?"),
        (f"A fire in {y + d.between(200, 400)} destroyed most of the old wooden houses.",
         "What happened to the old wooden houses?"),
        (f"The cathedral, completed after {d.between(40, 120)} years of work, still dominates the skyline.",
         "How long did the cathedral take to build?"),
        (f"Today {x} has about {d.between(20, 900)},000 inhabitants.", f"How many people live in {x} today?"),
        ("The railway reached the city in the nineteenth century, bringing factories and new suburbs.",
         "What did the railway bring?"),
        (f"Its university, one of the oldest in the region, was established by {d.pick(NAMES)} the Elder.",
         "Who established the university?"),
    )


def _animal(d: Dice, x: str):
    return (
        (f"The {x} warbler is a small songbird found mainly in coastal wetlands.", "Where is the bird mainly found?"),
        (f"Adults weigh between {d.between(8, 15)} and {d.between(16, 30)} grams.", "How much do adults weigh?"),
        ("It feeds on insects in summer and switches to seeds and berries in winter.", "What does it eat in winter?"),
        (f"Each spring the female lays {d.between(3, 6)} eggs in a cup-shaped nest hidden in reeds.",
         "How many eggs does the female lay?"),
        (f"Populations fell by {d.between(20, 70)} percent after large areas of marsh were drained.",
         "Why did populations fall?"),
        ("Males sing from exposed perches at dawn to defend their territory.", "Why do males sing at dawn?"),
        ("Conservation groups have since restored several wetlands, and numbers are slowly recovering.",
         "What have conservation groups done?"),
    )


def _invention(d: Dice, x: str):
    who = d.pick(NAMES) + " " + proper_name(d)
    y = d.between(1780, 1990)
    return (
        (f"The {x} loom was invented by {who} in {y}.", "Who invented the loom?"),
        (f"{who} had worked as a clockmaker before turning to textile machinery.", f"What was {who}'s earlier job?"),
        ("The machine used punched cards to control the pattern woven into the fabric.",
         "What controlled the pattern?"),
        (f"Early versions broke often, and the first factory to adopt it closed within {d.between(2, 6)} years.",
         "What happened to the first factory?"),
        ("Weavers initially protested, fearing the loom would cost them their jobs.", "Why did weavers protest?"),
        (f"By {y + d.between(20, 60)}, improved models were used across the country.",
         "When were improved models widespread?"),
        ("Historians later saw the punched cards as an early ancestor of computer programming.",
         "How do historians view the punched cards?"),
    )


def _sports(d: Dice, x: str):
    y = d.between(1870, 1990)
    return (
        (f"{x} Football Club was formed in {y} by a group of railway workers.", "Who formed the club?"),
        (f"The club won its first national title in {y + d.between(10, 60)}.",
         "When did the club win its first national title?"),
        (f"Its stadium holds {d.between(8, 60)},000 spectators and was rebuilt after a storm damaged the roof.",
         "Why was the stadium rebuilt?"),
        (f"The team's record scorer, {d.pick(NAMES)}, scored {d.between(120, 300)} goals in "
         f"{d.between(9, 17)} seasons.", "Who is the record scorer?"),
        ("Financial trouble in the 1990s forced the club to sell its best players.",
         "What forced the club to sell its best players?"),
        ("A youth academy opened in 2004 has since produced several international players.",
         "What has the youth academy produced?"),
        ("Supporters traditionally wear green scarves on match days.", "What do supporters wear?"),
    )


def _river(d: Dice, x: str):
    return (
        (f"The {x} River rises in the northern highlands and flows {d.between(150, 900)} kilometers to the sea.",
         "How long is the river?"),
        (f"It passes through {d.between(3, 12)} towns, the largest of which grew up around a medieval bridge.",
         "How many towns does it pass through?"),
        ("Spring snowmelt often causes flooding in the lower valley.", "What causes flooding?"),
        (f"A dam built in {d.between(1930, 1985)} now supplies electricity to the region.",
         "What does the dam supply?"),
        ("Salmon, once common, almost disappeared because the dam blocked their migration.",
         "Why did salmon almost disappear?"),
        ("Fish ladders added in recent years have allowed some salmon to return.", "What allowed salmon to return?"),
        ("The estuary is an important stopover for migrating birds.", "Why is the estuary important?"),
    )


def _company(d: Dice, x: str):
    founder = d.pick(NAMES)
    return (
        (f"{x} Systems was founded by {founder} in a garage in {d.between(1975, 2012)}.", "Who founded the company?"),
        ("It first sold accounting software to small shops.", "What did it first sell?"),
        (f"After a failed expansion into hardware, it laid off {d.between(10, 40)} percent of its staff.",
         "What happened after the failed expansion?"),
        (f"The company went public {d.between(5, 20)} years after its founding.", "When did the company go public?"),
        ("Its cloud product now accounts for most of its revenue.", "What accounts for most of its revenue?"),
        (f"{founder} stepped down as chief executive but remains on the board.", f"What is {founder}'s current role?"),
        (f"It employs about {d.between(2, 40)},000 people in {d.between(5, 30)} countries.",
         "How many people does it employ?"),
    )


def _musician(d: Dice, x: str):
    name = d.pick(NAMES) + " " + x
    return (
        (f"{name} was a composer and pianist born in a fishing village.", f"Where was {name} born?"),
        (f"At {d.between(6, 12)}, {name} began piano lessons with the local church organist.",
         "Who gave the first piano lessons?"),
        ("A scholarship took the young musician to the conservatory in the capital.",
         "What took the musician to the capital?"),
        (f"The first symphony premiered in {d.between(1850, 1960)} to mixed reviews.",
         "How was the first symphony received?"),
        ("Folk songs from the coast appear in many of the later works.", "What appears in the later works?"),
        ("Hearing loss in later life ended the performing career but not the composing.",
         "What ended the performing career?"),
        (f"Over {d.between(40, 200)} works survive, including operas, songs and chamber music.",
         "How many works survive?"),
    )


def _disease(d: Dice, x: str):
    return (
        (f"{x} fever is a viral infection spread by mosquitoes in warm, humid regions.",
         "How does the infection spread?"),
        (f"Symptoms usually appear {d.between(3, 7)} to {d.between(8, 14)} days after a bite.",
         "When do symptoms appear?"),
        ("Most patients recover within a week with rest and fluids.", "How do most patients recover?"),
        ("A small share develop a severe form that affects the liver.", "What does the severe form affect?"),
        (f"A vaccine approved in {d.between(1990, 2022)} gives protection for about ten years.",
         "How long does the vaccine protect?"),
        ("Removing standing water reduces mosquito breeding and the number of cases.",
         "What reduces the number of cases?"),
        ("Travelers are advised to use repellent and sleep under nets.", "What are travelers advised to do?"),
    )


def _space(d: Dice, x: str):
    y = d.between(1970, 2030)
    return (
        (f"The {x} probe was launched in {y} to study a distant comet.", "What was the probe launched to study?"),
        (f"It took {d.between(4, 12)} years to reach its target, using gravity assists from Earth and Mars.",
         "How did it reach its target?"),
        ("A small lander was released to touch down on the comet's surface.", "What was released?"),
        ("The lander bounced twice and came to rest in a shadow, limiting its solar power.",
         "Why was the lander's power limited?"),
        ("Instruments found organic molecules in the dust around the comet.", "What did instruments find?"),
        (f"The mission ended in {y + d.between(10, 15)} when the probe was steered into the comet.",
         "How did the mission end?"),
        (f"Scientists from {d.between(10, 25)} countries worked on the data.",
         "How many countries worked on the data?"),
    )


TOPICS = {
    "city_history": _city, "animal": _animal, "invention": _invention, "sports_club": _sports,
    "river": _river, "company": _company, "musician": _musician, "disease": _disease, "space_mission": _space,
}

# Sentences that fit a passage on any subject, to pad long passages without repeating facts.
_GENERIC = (
    "Records from the early period are incomplete, and some dates are disputed.",
    "Local historians still debate several of the details.",
    "A museum exhibition in recent years drew renewed public attention to this history.",
    "Much of what is known comes from letters and official reports of the time.",
    "Visitors today can see a small plaque describing these events.",
    "The story is often retold in school textbooks of the region.",
    "Several documentaries have covered the subject, with varying accuracy.",
    "Not all accounts agree on the order in which these changes happened.",
)
_HARD_QUESTIONS = (
    "Based on the passage, what can be inferred about the cause of the decline, and what evidence supports it?",
    "Which two events in the passage are connected by cause and effect? Explain.",
    "What does the passage NOT tell us that a reader would need to judge its long-term significance?",
    "Summarize the main turning point described in the passage and explain why it matters.",
)
_FORMATS = (
    "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: {q}",
    "{p}\n\nQ: {q}\nA:",
    "Context: {p}\nQuestion: {q}\nAnswer:",
    "Answer the question using only the text below.\n\n{p}\n\n{q}",
)


def write(d: Dice, topic: str, level: int, target: int) -> str:
    subject = proper_name(d)
    facts = TOPICS[topic](d, subject)
    sentence, question = d.pick(facts)
    # Fill the passage with the subject's other sentences (a fresh hand brings new numbers).
    # Long passages go on to a second subject of the same kind (a neighbouring town, a related
    # species) instead of repeating facts with new numbers.
    first = [True]

    def more_sentences() -> tuple[str, ...]:
        if first[0]:
            first[0] = False
            return tuple(s for s, _ in facts if s != sentence) + _GENERIC
        return tuple(s for s, _ in TOPICS[topic](d, proper_name(d)))

    others = deck(d, more_sentences)
    budget = target - 20
    passage = fill([facts[0][0]] if sentence != facts[0][0] else [], others, budget // 2, limit=30)
    passage.append(sentence)
    fill(passage, others, budget, limit=40)
    while len(passage) < 3:  # a passage is never just one or two sentences
        passage.append(others())
    if level == HARD:
        question = d.pick(_HARD_QUESTIONS)
        if d.chance(0.4):
            question += " If the passage does not say, answer 'unanswerable'."
    elif level != EASY and d.chance(0.5):
        question += " Answer in a full sentence and quote the relevant part."
    return d.pick(_FORMATS).format(p=" ".join(passage), q=question)
