"""Multi-turn chat (LLM-Blender / LMSYS conversations): a short transcript, then the new user turn.

Each topic has its own user turns and assistant sentences, written as templates whose
slots (destination, framework, language, ...) are filled once per conversation so the
turns agree with each other. Harder final turns refer back to earlier ones ("given
everything so far") or change the constraints.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import NAMES, Dice, deck, fill

KIND = "multi_turn_chat"


@dataclass(frozen=True)
class Topic:
    slots: tuple[dict[str, str], ...]  # one is picked per conversation
    user: tuple[str, ...]  # earlier user turns, in story order
    assistant: tuple[str, ...]  # sentences the assistant said earlier
    final: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # the new turn, by difficulty
    extra: tuple[dict[str, tuple[str, ...]], ...] = ()  # slots drawn independently of the main ones


_PARTY = {"party": ("two adults and a toddler", "four friends in our twenties",
                    "my parents, who are in their seventies", "just me, traveling solo", "a couple on our honeymoon",
                    "a family of five with teenagers")}

TOPICS = {
    "trip_planning": Topic(
        slots=(
            {"country": "Portugal", "city": "Lisbon", "city2": "Porto", "day": "Sintra", "sight": "the tiled old town"},
            {"country": "Japan", "city": "Tokyo", "city2": "Kyoto", "day": "Nikko", "sight": "the temples"},
            {"country": "Italy", "city": "Rome", "city2": "Florence", "day": "Orvieto", "sight": "the Forum"},
            {"country": "Spain", "city": "Madrid", "city2": "Barcelona", "day": "Toledo", "sight": "the Prado"},
            {"country": "Mexico", "city": "Mexico City", "city2": "Oaxaca", "day": "Teotihuacan",
             "sight": "the markets"},
            {"country": "Greece", "city": "Athens", "city2": "Thessaloniki", "day": "Delphi", "sight": "the Acropolis"},
            {"country": "Scotland", "city": "Edinburgh", "city2": "Glasgow", "day": "Stirling", "sight": "the castle"},
            {"country": "Vietnam", "city": "Hanoi", "city2": "Hoi An", "day": "Ha Long Bay",
             "sight": "the Old Quarter"},
        ),
        extra=(_PARTY, {"month": ("March", "May", "June", "September", "October", "December")},
               {"budget": ("1,500", "2,000", "3,000", "4,500")},
               {"days": ("five days", "a week", "ten days", "two weeks")}),
        user=("I'm planning {days} in {country} in {month}.", "We're {party}.", "We don't want to drive much.",
              "What about day trips from {city}?", "Is it easy to get from {city} to {city2}?",
              "Our budget is around {budget} euros, flights not included."),
        assistant=("{city} and {city2} make a good two-base trip.", "{day} is an easy day trip from {city}.",
                   "{month} is usually a pleasant time to go.", "Trains between {city} and {city2} are frequent.",
                   "Staying near public transport saves a lot of effort.", "Book tickets for {sight} in advance.",
                   "Leave one day unplanned for rest."),
        final=(("Thanks! Which city should we start in?", "ok and where should we stay in {city}?"),
               ("Can you turn that into a day-by-day plan?", "What would you cut if we only had five days?"),
               ("Given everything so far, redo the plan so no day has more than two hours of travel, keep the total "
                "under {budget} euros, and explain the trade-offs.",)),
    ),
    "coding_help": Topic(
        slots=(
            {"fw": "Flask", "route": "login", "err": "KeyError: 'user_id'", "store": "a cookie session"},
            {"fw": "Django", "route": "checkout", "err": "OperationalError: database is locked", "store": "SQLite"},
            {"fw": "FastAPI", "route": "upload", "err": "422 Unprocessable Entity", "store": "a Pydantic model"},
            {"fw": "Express", "route": "profile", "err": "Cannot read properties of undefined (reading 'id')",
             "store": "JWT tokens"},
            {"fw": "Spring Boot", "route": "orders", "err": "LazyInitializationException", "store": "Hibernate"},
            {"fw": "Rails", "route": "signup", "err": "ActiveRecord::RecordNotUnique", "store": "Postgres"},
        ),
        extra=({"server": ("gunicorn with 4 workers", "Docker on a small VPS", "Heroku", "Kubernetes", "AWS Lambda")},),
        user=("My {fw} app fails on the {route} route.", "Here's the error: {err}.", "I'm using {store}.",
              "It works locally but not on the server.", "In production it runs on {server}.",
              "I already checked the environment variables."),
        assistant=("That error usually means the data isn't what the {route} handler expects.",
                   "Check that the configuration is identical on every instance.",
                   "Log the incoming request at the start of the {route} handler.",
                   "With {store}, concurrency problems often only show up in production.",
                   "Try reproducing it locally with the production settings.", "A failing test would pin this down."),
        final=(("That fixed it, thanks!", "What does that setting actually do?"),
               ("Now how do I make it work with several servers behind a load balancer?",
                "Can you show the fixed {route} handler?"),
               ("Putting all of that together, write a minimal but production-ready version of the {route} flow in "
                "{fw} with tests, and explain why the original bug happened.",)),
    ),
    "cooking": Topic(
        slots=(
            {"diet": "vegetarian", "diet2": "gluten-free", "dish": "a big vegetable curry", "side": "rice"},
            {"diet": "vegan", "diet2": "nut-free", "dish": "a chickpea and spinach stew", "side": "flatbread"},
            {"diet": "lactose-intolerant", "diet2": "pescatarian", "dish": "a baked salmon with herbs",
             "side": "roast potatoes"},
            {"diet": "on a low-carb diet", "diet2": "vegetarian", "dish": "stuffed peppers", "side": "a green salad"},
            {"diet": "allergic to shellfish", "diet2": "halal", "dish": "a chicken tagine", "side": "couscous"},
        ),
        extra=({"n": ("four", "six", "eight", "ten", "twelve")},
               {"when": ("Saturday", "Sunday lunch", "Friday night", "Christmas Eve")}),
        user=("I want to make dinner for {n} people on {when}.", "One guest is {diet} and one is {diet2}.",
              "I only have one oven.", "I'm not a very experienced cook.", "Could I prepare something the day before?"),
        assistant=("I'd suggest {dish} with {side}; it covers both restrictions.",
                   "Roasted vegetables can share the oven with the main dish.",
                   "Most stews taste better the next day.", "Check every label for hidden ingredients.",
                   "A simple dessert like poached pears can be made ahead."),
        final=(("What should I serve for dessert?", "How much {side} do I need for {n}?"),
               ("Can you write a shopping list for all of it?", "Give me a timeline for {when}."),
               ("Combine everything into one schedule starting the day before, with oven use never overlapping, and "
                "list which steps are risky for a beginner and how to recover if they go wrong.",)),
    ),
    "language_learning": Topic(
        slots=(
            {"lang": "Japanese", "point": "particles", "pair": "wa and ga", "tool": "Anki"},
            {"lang": "Spanish", "point": "the two verbs for 'to be'", "pair": "ser and estar", "tool": "Duolingo"},
            {"lang": "German", "point": "cases", "pair": "the dative and the accusative", "tool": "a textbook"},
            {"lang": "French", "point": "the subjunctive", "pair": "the subjunctive and the indicative",
             "tool": "podcasts"},
            {"lang": "Korean", "point": "speech levels", "pair": "the polite and the formal endings",
             "tool": "a tutor"},
            {"lang": "Russian", "point": "verb aspect", "pair": "perfective and imperfective verbs",
             "tool": "flashcards"},
        ),
        extra=({"months": ("three months", "six months", "a year", "two years")},),
        user=("I'm learning {lang} and I'm stuck on {point}.", "What's the difference between {pair}?",
              "My textbook's explanation confuses me.", "I've been studying for {months}.", "I use {tool} every day."),
        assistant=("The short version: they look similar but mark different things.",
                   "Native speakers rarely think about the rule.",
                   "Contrast examples side by side help more than definitions.",
                   "Reading lots of simple sentences helps more than memorizing rules.",
                   "Try graded readers at your level.", "Mistakes with {point} are normal for a long time."),
        final=(("Can you give me one more example?", "Is that a common mistake?"),
               ("Give me five practice sentences and tell me which form to use.", "Make a short quiz on {pair}."),
               ("Based on the mistakes I made above, write a two-week study plan for {point} in {lang}, with daily "
                "exercises that increase in difficulty and a way to check my progress.",)),
    ),
    "fitness": Topic(
        slots=(
            {"sport": "running", "issue": "my knees hurt", "event": "a 5k"},
            {"sport": "swimming", "issue": "my shoulder clicks", "event": "a one-mile open-water swim"},
            {"sport": "cycling", "issue": "my lower back aches", "event": "a 100 km charity ride"},
            {"sport": "strength training", "issue": "my wrists get sore", "event": "my first powerlifting meet"},
            {"sport": "rowing", "issue": "my hamstrings are tight", "event": "a 2,000 m test"},
        ),
        extra=({"age": ("35", "40", "48", "55", "62")}, {"days": ("two", "three", "four")}),
        user=("I want to start {sport}.", "I'm {age} and haven't exercised in years.", "After long walks {issue}.",
              "I can only manage a few minutes at a time right now.", "I have time {days} days a week."),
        assistant=("A gradual program is the safest way to start.",
                   "Good technique matters more than intensity at first.",
                   "Increase total time by no more than about ten percent a week.",
                   "Strength work protects the joints.", "Rest days matter as much as training days at the beginning.",
                   "If the pain comes back, ease off and see a physio."),
        final=(("What gear do I need?", "Should I train every day?"),
               ("Make me an 8-week plan based on that.", "What strength exercises should I add?"),
               ("The pain came back in week three of the plan you gave me. Adjust the plan from here, explain which "
                "warning signs mean I should stop and see a doctor, and keep me on track for {event}.",)),
    ),
    "job_search": Topic(
        slots=(
            {"role": "data analyst", "task": "a take-home SQL task", "co": "a mid-size retailer"},
            {"role": "nurse", "task": "a scenario-based panel interview", "co": "a children's hospital"},
            {"role": "software engineer", "task": "a live coding round", "co": "a fintech startup"},
            {"role": "high school teacher", "task": "a demo lesson", "co": "a public school"},
            {"role": "marketing manager", "task": "a presentation of a campaign plan", "co": "a consumer brand"},
            {"role": "project manager", "task": "a case study", "co": "a construction company"},
        ),
        extra=({"gap": ("three years", "five years", "a decade", "eighteen months")},),
        user=("I have an interview for a {role} job next week.", "It's my first interview in {gap}.",
              "They asked me to prepare {task}.", "I'm nervous about the behavioral questions.",
              "The employer is {co}."),
        assistant=("Prepare three stories using the situation, task, action, result format.",
                   "Research the company's recent news.",
                   "For {task}, explain your assumptions clearly.", "It's fine to ask clarifying questions.",
                   "Practice answering out loud, not just in your head.",
                   "Have a short answer ready about your time away from work."),
        final=(("What should I wear?", "What questions should I ask them?"),
               ("Help me answer 'tell me about a time you failed'.", "Can you do a mock interview with me?"),
               ("Use what I told you about my background to write three STAR stories for a {role} role, then critique "
                "each as a tough interviewer would and rewrite the weakest one.",)),
    ),
    "story_writing": Topic(
        slots=(
            {"genre": "mystery", "hero": "a retired librarian", "place": "a book fair", "clue": "a torn bookmark"},
            {"genre": "science fiction", "hero": "a ship's cook", "place": "a generation ship",
             "clue": "a log entry that shouldn't exist"},
            {"genre": "fantasy", "hero": "an apprentice cartographer", "place": "a floating city",
             "clue": "a map that redraws itself"},
            {"genre": "ghost story", "hero": "a night-shift nurse", "place": "an old hospital",
             "clue": "a call button that keeps ringing"},
            {"genre": "heist comedy", "hero": "a nervous accountant", "place": "a museum gala",
             "clue": "a misplaced invitation"},
        ),
        extra=({"name": NAMES},),
        user=("Let's write a {genre} story together.", "The main character is {hero} called {name}.",
              "It takes place at {place}.", "Can we add a rival?", "Make the tone a bit funny."),
        assistant=("{name} notices something odd at {place} on the first page.", "Chapter one ends with a scream.",
                   "The rival could want the same thing for a better reason.", "{clue} is the first real clue.",
                   "{name} is annoyed that nobody follows the rules, even now."),
        final=(("What happens next?", "Give me a title."),
               ("Write chapter two.", "Introduce a new suspect."),
               ("Write the final chapter where {name} resolves everything, making sure every clue introduced earlier, "
                "including {clue}, is explained and the twist is fair to the reader.",)),
    ),
    "personal_finance": Topic(
        slots=(
            {"income": "4,000", "debt": "$12,000 in student loans", "rent": "1,300", "perk": "a 401(k) match"},
            {"income": "2,800", "debt": "$5,000 on a credit card", "rent": "900", "perk": "no retirement plan"},
            {"income": "6,500", "debt": "a $22,000 car loan", "rent": "2,100", "perk": "stock options"},
            {"income": "3,300", "debt": "$30,000 in student loans", "rent": "1,100", "perk": "a pension"},
        ),
        user=("I just got my first full-time job.", "I earn about ${income} a month after tax.", "I have {debt}.",
              "My rent is ${rent}.", "I have no savings yet.", "My employer offers {perk}."),
        assistant=("Start with a small emergency fund, about one month of expenses.",
                   "Take any free employer money first.",
                   "Your interest rate decides whether to pay the debt off faster.",
                   "A simple budget is 50% needs, 30% wants, 20% savings.",
                   "Automatic transfers on payday make saving easier."),
        final=(("What's an emergency fund for?", "Is the employer benefit worth it?"),
               ("Make me a monthly budget with those numbers.", "How long until the debt is paid off?"),
               ("With all the numbers above, compare paying the debt off aggressively versus investing more, over "
                "five years, with your assumptions spelled out and what would change your recommendation.",)),
    ),
    "home_repair": Topic(
        slots=(
            {"fix": "bathroom sink", "symptom": "drains really slowly", "part": "the P-trap"},
            {"fix": "toilet", "symptom": "keeps running after flushing", "part": "the flapper"},
            {"fix": "kitchen faucet", "symptom": "drips all night", "part": "the cartridge"},
            {"fix": "shower", "symptom": "has very low pressure", "part": "the shower head"},
            {"fix": "bathtub", "symptom": "won't drain at all", "part": "the drain stopper"},
        ),
        extra=({"age": ("20", "40", "60", "90")},),
        user=("My {fix} {symptom}.", "I tried the obvious things already.", "The house is about {age} years old.",
              "There's a weird noise too.", "I don't want to use harsh chemicals."),
        assistant=("Buildup around {part} is the most common cause.",
                   "Turn off the water supply before opening anything.",
                   "A cheap replacement {part} costs only a few dollars.", "Older houses often have corroded fittings.",
                   "Take a photo before taking anything apart."),
        final=(("Where is {part}?", "What tools do I need?"),
               ("It's still not fixed after all that. What next?", "How do I replace {part}?"),
               ("None of that worked and now another fixture has the same problem. Explain what that suggests about "
                "the plumbing, what I can still check myself, and when I must call a plumber.",)),
    ),
    "studying": Topic(
        slots=(
            {"subject": "biology", "unit": "cell biology and genetics", "concept": "mitosis"},
            {"subject": "chemistry", "unit": "stoichiometry and equilibrium", "concept": "Le Chatelier's principle"},
            {"subject": "history", "unit": "the interwar years", "concept": "the causes of the Great Depression"},
            {"subject": "statistics", "unit": "hypothesis testing", "concept": "p-values"},
            {"subject": "economics", "unit": "market structures", "concept": "price elasticity"},
            {"subject": "physics", "unit": "electricity and magnetism", "concept": "Faraday's law"},
        ),
        extra=({"weeks": ("one week", "two weeks", "three weeks", "a month")},),
        user=("I have a {subject} exam in {weeks}.", "It covers {unit}.", "I keep forgetting what I read.",
              "I work part-time in the evenings.", "Flashcards haven't worked for me."),
        assistant=("Active recall works better than rereading.", "Try explaining each topic out loud without notes.",
                   "Spaced repetition helps you remember over weeks.",
                   "Past exam papers show what is asked most often.", "Short focused sessions beat long tired ones."),
        final=(("How long should each session be?", "Explain {concept} simply."),
               ("Make a study schedule for the {weeks}.", "Quiz me on {concept}."),
               ("Given my schedule and what hasn't worked, design a plan for the next {weeks} that mixes active "
                "recall and practice questions on {unit}, and explain how to adjust it after a bad practice test.",)),
    ),
}

_FOLLOW_UPS = (
    "Thanks, that helps.", "Hmm, can you say more about that?", "I'm not sure I follow.", "OK, what else?",
    "Good point, I hadn't thought of that.", "Wait, is that always true?", "That sounds complicated.",
    "Can you give an example?", "Got it.", "What would you do in my place?", "Is there a cheaper option?",
    "And if that doesn't work?",
)


def write(d: Dice, topic: str, level: int, target: int) -> str:
    t = TOPICS[topic]
    slots = dict(d.pick(t.slots))
    for extra in t.extra:
        slots.update({key: d.pick(values) for key, values in extra.items()})
    # The user's turns keep their order (they tell a story); after them come generic follow-ups.
    users = iter(t.user[d.below(2):])
    follow_up = deck(d, lambda: _FOLLOW_UPS)
    said = deck(d, lambda: t.assistant)

    def exchange() -> str:
        reply = " ".join(said() for _ in range(d.between(1, 3)))
        return f"User: {next(users, None) or follow_up()}\nAssistant: {reply}"

    final = "User: " + d.pick(t.final[level])
    turns = fill([exchange()], exchange, target - len(final) // 4, sep="\n", limit=20)
    return "\n".join([*turns, final]).format(**slots)
