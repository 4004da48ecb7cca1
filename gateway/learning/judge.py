"""Scores for answers: an LLM judge behind any OpenAI-compatible endpoint ([judge]), and a verifier rule for
answers whose prompt comes with a reference answer.

The judge is sent the rubric with the prompt and the answer filled in, and its reply is read for one number in
[0, 1] (`parse_score`); anything else is a JudgeError saying what came back, never a guessed score. Calls are
bounded (at most `max_concurrency` in flight, each within `timeout_s` whole, a reply of at most
MAX_REPLY_BYTES). A judge that is not one of the pool's instances sees prompts only where the config allows it
(`outside_pool_problem`).

The parsing and the reference rule are plain functions, so they are tested without a server. No lab code here:
shadow judging while serving uses the same Judge.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

# The judge is asked for "Score: X" alone; this leaves room for a short preamble. A judge that reasons at length
# before its score is cut off and its reply refused (no number), rather than paid for by the page.
JUDGE_REPLY_TOKENS = 32
MAX_REPLY_BYTES = 1 << 20  # a judge's HTTP reply larger than this is refused, not buffered
CUT_MARK = "\n[... answer cut at {n} characters]"

# A number standing on its own: not the "2.5" of "Qwen2.5", not part of a word.
_NUMBER = r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?![\w])"
_MARKED = re.compile(r"score[\s:=*]*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_PLACEHOLDER = re.compile(r"\{(prompt|answer)\}")


class JudgeSettings(Protocol):
    """The [judge] section as read here (gateway/config/sections.py JudgeConfig has these fields; this module
    does not import the config, so mypy checks it reads nothing else)."""

    @property
    def url(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def rubric(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def max_answer_chars(self) -> int: ...
    @property
    def outside_pool_may_see_prompts(self) -> bool: ...


class JudgeError(Exception):
    """An answer could not be judged: the reason, and whether asking again may help (a timeout, a refused
    connection, HTTP 429 or 5xx are transient; a reply without a score is not)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


# --- the judge's prompt and reply ---------------------------------------------------------------------------


def cut_answer(answer: str, max_chars: int) -> str:
    """The answer as the judge sees it: at most max_chars characters, and a mark saying it was cut."""
    if len(answer) <= max_chars:
        return answer
    return answer[:max_chars] + CUT_MARK.format(n=max_chars)


def fill_rubric(rubric: str, prompt: str, answer: str) -> str:
    """The rubric with {prompt} and {answer} replaced in one pass (a prompt that itself says "{answer}" stays
    as written; other braces are not placeholders)."""
    values = {"prompt": prompt, "answer": answer}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)


def reply_text(body: Any) -> str:
    """The text of an OpenAI chat completion's first choice; JudgeError when the body has none."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise JudgeError("the judge's reply has no choices[0].message.content") from None
    if not isinstance(content, str):
        raise JudgeError("the judge's reply has no text (choices[0].message.content is not a string)")
    return content


def parse_score(text: str) -> float:
    """The one number in [0, 1] a judge's reply gives: the last one marked "Score:", else the only number in
    it. JudgeError when there is none, several unmarked ones, or one outside [0, 1]."""
    marked = _MARKED.findall(text)
    if marked:
        found = marked[-1]
    else:
        numbers = _ANY_NUMBER.findall(text)
        if not numbers:
            raise JudgeError(f"no number in the judge's reply {_clip(text)!r}")
        if len({float(n) for n in numbers}) > 1:
            raise JudgeError(f"several numbers and none marked 'Score:' in the judge's reply {_clip(text)!r}")
        found = numbers[0]
    value = float(found)
    if not 0.0 <= value <= 1.0:
        raise JudgeError(f"the judge's score {found} is outside [0, 1] (reply {_clip(text)!r})")
    return value


def _clip(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


# --- the reference rule --------------------------------------------------------------------------------------

_BOXED = "\\boxed{"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*", re.IGNORECASE)
_FRAC = re.compile(r"\\d?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}")
# Thousands separators are allowed ("1,000"); a fraction is a number too ("3/4").
_REF_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+"
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])(?:" + _REF_NUMBER + r")(?![\w])")
_QUOTES = ("''", '""', "``")


def reference_score(answer: str, reference: str) -> float:
    """1.0 when the answer's final answer matches the reference, else 0.0.

    The final answer is the last \\boxed{...}, else what follows the last "answer is" / "answer:" on its line,
    else the answer's last non-empty line. A reference that is a number (1,000, -2.5, 3/4, \\frac{3}{4}) is
    compared as a number with the last number of the final answer; any other reference by exact match once
    both are normalised (case, surrounding $ and quotes, a closing full stop, runs of spaces).
    """
    final = final_answer(answer)
    expected = as_number(reference)
    if expected is not None:
        numbers = [as_number(n) for n in _NUMBER_IN_TEXT.findall(_plain_fractions(final))]
        got = numbers[-1] if numbers else None
        return 1.0 if got is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if normalised(final) == normalised(reference) else 0.0


def final_answer(text: str) -> str:
    """Where an answer states its result (see reference_score)."""
    start = text.rfind(_BOXED)
    if start >= 0:
        boxed = _braced(text, start + len(_BOXED))
        if boxed is not None:
            return boxed
    marks = list(_ANSWER_IS.finditer(text))
    if marks:
        rest = text[marks[-1].end():].strip()
        return rest.splitlines()[0] if rest else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _braced(text: str, start: int) -> str | None:
    """The text up to the brace that closes one opened just before `start` (None: never closed)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _plain_fractions(text: str) -> str:
    return _FRAC.sub(r"\1/\2", text)


def as_number(text: str) -> float | None:
    """The number a short text is (after normalising), or None when it is not one."""
    text = normalised(_plain_fractions(text)).removeprefix("$").strip()
    if not re.fullmatch(_REF_NUMBER, text):
        return None
    try:
        return float(Fraction(text.replace(",", "")))
    except (ValueError, ZeroDivisionError):
        return None


def normalised(text: str) -> str:
    """Text for an exact match: case folded, runs of spaces made one, a closing full stop and surrounding $
    (LaTeX) or matching quotes removed."""
    text = " ".join(text.split()).casefold()
    changed = True
    while changed and text:
        before = text
        text = text.removesuffix(".").strip()
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$").strip()
        if len(text) >= 2 and text[0] + text[-1] in _QUOTES:
            text = text[1:-1].strip()
        changed = text != before
    return text


# --- which judge may see the prompts -------------------------------------------------------------------------


def _origin(url: str) -> tuple[str, str, int | None, str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def outside_pool_problem(judge: JudgeSettings, pool_urls: Iterable[str]) -> str | None:
    """Why this judge must not be sent prompts (None: it may): its URL is none of the pool's instances and the
    config does not allow prompts to leave the pool."""
    if judge.url is None or judge.outside_pool_may_see_prompts:
        return None
    root = judge.url.removesuffix("/v1")
    if _origin(root) in {_origin(u) for u in pool_urls}:
        return None
    return (f"the judge at {judge.url} is not one of the pool's instances, so it would see your prompts and "
            "answers: set [judge] outside_pool_may_see_prompts = true to allow that, or point [judge] url at a "
            "pool instance (its url followed by /v1)")


# --- the judge -------------------------------------------------------------------------------------------------


class Judge:
    """Scores answers with the [judge] endpoint. Use as `async with Judge(...) as judge`.

    Raises JudgeError at construction when there is no judge (url unset), when the judge may not see prompts
    (outside_pool_problem), or when api_key_env names a variable that is not set.
    """

    def __init__(self, config: JudgeSettings, pool_urls: Iterable[str], environ: Mapping[str, str] = os.environ):
        if config.url is None or config.model is None:
            raise JudgeError("no judge: set [judge] url and model in the config")
        problem = outside_pool_problem(config, pool_urls)
        if problem:
            raise JudgeError(problem)
        self.config = config
        self.url = config.url + "/chat/completions"
        self.model = config.model
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = environ.get(config.api_key_env)
            if not key:
                raise JudgeError(f"[judge] api_key_env names {config.api_key_env}, which is not set in the "
                                 "environment")
            self._headers["Authorization"] = f"Bearer {key}"
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._client: httpx.AsyncClient | None = None

    @property
    def identity(self) -> str:
        """What a score depends on besides the answer: the judge's model, endpoint and rubric (a cached score
        from another judge or rubric is not this judge's)."""
        rubric = hashlib.sha256(self.config.rubric.encode()).hexdigest()[:12]
        return f"judge:{self.model}@{self.config.url}:rubric-{rubric}"

    async def __aenter__(self) -> Judge:
        limits = httpx.Limits(max_connections=self.config.max_concurrency)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout_s), limits=limits)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def score(self, prompt: str, answer: str) -> float:
        """The judge's score of `answer` to `prompt`, in [0, 1]; JudgeError saying why there is none."""
        text = fill_rubric(self.config.rubric, prompt, cut_answer(answer, self.config.max_answer_chars))
        async with self._slots:
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    body = await self._ask(text)
            except (TimeoutError, httpx.TimeoutException):
                raise JudgeError(f"no answer from the judge at {self.config.url} within "
                                 f"{self.config.timeout_s:g} s", transient=True) from None
        return parse_score(reply_text(body))

    async def _ask(self, text: str) -> Any:
        if self._client is None:
            raise RuntimeError("use the Judge as `async with Judge(...) as judge`")
        payload = {"model": self.model, "messages": [{"role": "user", "content": text}],
                   "max_tokens": JUDGE_REPLY_TOKENS, "temperature": 0}
        try:
            async with self._client.stream("POST", self.url, json=payload, headers=self._headers) as reply:
                data = await _read_bounded(reply)
                status = reply.status_code
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as e:
            raise JudgeError(f"could not reach the judge at {self.config.url}: {type(e).__name__} {e}",
                             transient=True) from None
        if status != 200:
            raise JudgeError(f"the judge answered HTTP {status}: {_clip(data.decode('utf-8', 'replace'))}",
                             transient=status == 429 or status >= 500)
        try:
            return json.loads(data)
        except ValueError:
            raise JudgeError(f"the judge's reply is not JSON: {_clip(data.decode('utf-8', 'replace'))}") from None


async def _read_bounded(reply: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in reply.aiter_bytes():
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise JudgeError(f"the judge's reply is larger than {MAX_REPLY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
