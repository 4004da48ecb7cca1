"""Shared pieces for the prompt writers: cheap seeded choices, vocabulary, and length filling."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from gateway.tokens import CHARS_PER_TOKEN  # how a record's input_len is estimated

T = TypeVar("T")

MAX_PROMPT_TOKENS = 950  # the paper's longest test prompt is under 1,000 tokens

# Difficulty levels passed to every writer (synthetic.py maps the latent difficulty onto them).
EASY, MEDIUM, HARD = 0, 1, 2


class Dice:
    """Scalar choices from a numpy Generator, drawn in blocks so a prompt costs one numpy call or two."""

    def __init__(self, rng: np.random.Generator, block: int = 128):
        self._rng = rng
        self._block = block
        self._buf: list[float] = []
        self._i = 0

    def random(self) -> float:
        if self._i >= len(self._buf):
            self._buf = self._rng.random(self._block).tolist()
            self._i = 0
        u = self._buf[self._i]
        self._i += 1
        return u

    def below(self, n: int) -> int:
        return min(int(self.random() * n), n - 1)

    def pick(self, seq: Sequence[T]) -> T:
        return seq[self.below(len(seq))]

    def between(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi], both ends included."""
        return lo + self.below(hi - lo + 1)

    def chance(self, p: float) -> bool:
        return self.random() < p

    def sample(self, seq: Sequence[T], k: int) -> list[T]:
        """k distinct items in random order (all of them if k >= len(seq))."""
        pool = list(seq)
        k = min(k, len(pool))
        for i in range(k):
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]

    def by_level(self, level: int, easy: Sequence[T], medium: Sequence[T], hard: Sequence[T]) -> T:
        return self.pick((easy, medium, hard)[level])


def deck(d: Dice, options: Callable[[], Sequence[str]]) -> Callable[[], str]:
    """Deal ``options()`` in a shuffled order without repeats; a fresh hand (new numbers) when it runs out."""
    hand: list[str] = []

    def deal() -> str:
        if not hand:
            fresh = options()
            hand.extend(d.sample(fresh, len(fresh)))
        return hand.pop()

    return deal


_OPENERS = ("", "", "", "", "hey, ", "Hi! ", "Quick question: ", "Serious question: ", "Can you help? ", "ok so ",
            "Hello. ", "I need help. ", "Question: ", "Honest question: ")
_CLOSERS = ("", "", "", "", " Thanks.", " Thanks!", " pls", " Please help.", " Thank you in advance.", " ??",
            " Asking for a reason.", " Be brief.", " Any ideas?", " ty")


def voice(d: Dice, text: str) -> str:
    """How people actually type a short request: greetings, sign-offs, lower case, missing punctuation."""
    text = d.pick(_OPENERS) + text + d.pick(_CLOSERS)
    if d.chance(0.15):
        text = text.lower()
    if d.chance(0.15) and text.endswith(("?", ".")):
        text = text[:-1]
    return text


def fill(pieces: list[str], more: Callable[[], str], target: int, *, at: int | None = None, sep: str = " ",
         limit: int = 60) -> list[str]:
    """Insert pieces from ``more()`` (at index ``at``, default the end) until the joined text reaches
    ``target`` tokens; never past MAX_PROMPT_TOKENS and at most ``limit`` additions."""
    target = min(target, MAX_PROMPT_TOKENS)
    chars = sum(len(p) for p in pieces) + len(sep) * max(len(pieces) - 1, 0)
    pos = len(pieces) if at is None else at
    for _ in range(limit):
        if chars // CHARS_PER_TOKEN >= target:
            break
        piece = more()
        if (chars + len(piece)) // CHARS_PER_TOKEN > MAX_PROMPT_TOKENS:
            break
        pieces.insert(pos, piece)
        pos += 1
        chars += len(piece) + len(sep)
    return pieces


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def listing(items: Sequence[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def plural(noun: str, k: int = 2) -> str:
    """English plural of a simple noun phrase ("loaf of bread" -> "loaves of bread"); singular if k == 1."""
    if k == 1:
        return noun
    head, sep, rest = noun.partition(" of ")
    words = head.split(" ")
    w = words[-1]
    if w.endswith("f"):
        w = w[:-1] + "ves"
    elif w.endswith(("s", "x", "ch", "sh")):
        w += "es"
    elif w.endswith("y") and w[-2:-1] not in ("a", "e", "i", "o", "u"):
        w = w[:-1] + "ies"
    else:
        w += "s"
    return " ".join([*words[:-1], w]) + sep + rest


def count(k: int, noun: str) -> str:
    return f"{k} {plural(noun, k)}"


def money(x: float) -> str:
    return f"${x:,.2f}" if x != int(x) else f"${int(x):,}"


def proper_name(d: Dice) -> str:
    """An invented place or family name from syllables (so passages are not about real facts)."""
    first = ("Val", "Mar", "Ost", "Bel", "Cor", "Tal", "Ren", "Kel", "Dor", "Lin", "Sar", "Aber", "Mor", "Tre",
             "Hal", "Quen", "Ast", "Bran", "El", "Fen")
    mid = ("", "", "a", "e", "i", "o", "en", "ar", "il")
    last = ("dor", "mere", "wick", "stad", "ford", "ria", "holm", "via", "ton", "gard", "burg", "lyn", "sk", "more",
            "vale", "rin", "dale", "ora")
    return d.pick(first) + d.pick(mid) + d.pick(last)


NAMES = (
    "Maya", "Liam", "Sofia", "Noah", "Aisha", "Mateo", "Chen", "Priya", "Oliver", "Fatima", "Lucas", "Yuki",
    "Emma", "Kwame", "Isabella", "Diego", "Hannah", "Omar", "Zara", "Ethan", "Mei", "Carlos", "Nadia", "Jonas",
    "Grace", "Ravi", "Leila", "Samuel", "Ingrid", "Tariq", "Chloe", "Ivan", "Amara", "Felix", "Rosa", "Kenji",
    "Olivia", "Hassan", "Elena", "Marcus", "Ana", "Daniel", "Sara", "Tomás", "Julia", "Ahmed", "Nora", "Victor",
    "Lena", "Arjun", "Bianca", "Theo", "Esther", "Malik", "Clara", "Pedro", "Hiro", "Alice", "Femi", "Rachel",
)
