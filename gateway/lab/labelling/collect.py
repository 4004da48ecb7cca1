"""`routebalance collect`: every prompt of a file, answered by every pool model, stored for `judge`.

Requests go straight to the pool's instances (not through a gateway): a model's requests take its instances
in turn (round robin), so what the labels say about a model is what that model wrote, with no router in
between. That works the same against real vLLM servers, `routebalance emulate` and `routebalance up` (whose
emulated instances listen at the config's instance URLs).

Before anything is sent it prints what the run would cost at most (prompt tokens counted with gateway.tokens,
every answer at --max-tokens, each model at its dearest instance's prices) and stops there unless --yes; above
--max-cost it refuses. The run is bounded (--concurrency requests in flight, fed from a bounded queue), each
request within --timeout whole and tried at most 1 + --retries times (each retry on the model's next instance),
and resumable: each answer is appended to the answers file as it arrives (gateway/lab/labelling/answers.py), and a rerun
asks only for the (prompt, model) pairs not in it yet.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.lab.labelling.answers import CollectedAnswer, PromptRow, read_answers, read_prompts
from gateway.lab.labelling.appendlog import AppendLog, ProgressLine
from gateway.tokens import TokenCounter

RETRY_PAUSE_S = 0.5  # before the first retry; doubled after each
# Answers that a retry on another instance may fix: the instance was overloaded, failing, or not serving the model.
RETRIED_STATUSES = frozenset({404, 408, 429, 500, 502, 503, 504})
SHOWN_REASONS = 10  # distinct failure reasons printed at the end (an answer's error text makes many distinct)


@dataclass(frozen=True, slots=True)
class CollectSettings:
    models: tuple[str, ...]  # empty: every pool model
    max_tokens: int = 1024
    concurrency: int = 8
    max_cost_usd: float | None = None
    send: bool = False  # --yes
    timeout_s: float | None = None  # None: the config's [upstream] response_timeout_s
    retries: int = 2

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not 1 <= self.concurrency <= 256:
            raise ValueError(f"--concurrency must be between 1 and 256, got {self.concurrency}")
        if self.max_cost_usd is not None and not self.max_cost_usd >= 0:
            raise ValueError(f"--max-cost must be a number of USD >= 0, got {self.max_cost_usd}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if not 0 <= self.retries <= 10:
            raise ValueError(f"--retries must be between 0 and 10, got {self.retries}")


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to make: a prompt for a model, its counted prompt tokens."""

    row: PromptRow
    model: str
    prompt_tokens: int


class AskFailed(Exception):
    def __init__(self, reason: str, *, retry: bool):
        super().__init__(reason)
        self.retry = retry


# --- planning --------------------------------------------------------------------------------------------------


def pool_models(config, wanted: Sequence[str]) -> tuple[str, ...]:
    """The models to ask: `wanted` (each a pool model) or every pool model."""
    pool = config.models()
    for model in wanted:
        if model not in pool:
            raise ValueError(f"--models: {model!r} is not a model of the pool; the pool's ([[instances]] model): "
                             f"{', '.join(pool)}")
    return tuple(dict.fromkeys(wanted)) or pool


def done_pairs(prompts: Sequence[PromptRow], answers: Sequence[CollectedAnswer], out: Path) -> set[tuple[str, str]]:
    """(prompt id, model) pairs already answered; ValueError when an answer's id now names another prompt (the
    prompts file changed under the same ids: those answers are not answers to these prompts)."""
    by_id = {p.id: p for p in prompts}
    for a in answers:
        row = by_id.get(a.id)
        if row is not None and row.prompt != a.prompt:
            raise ValueError(f"{out}:{a.line}: the answer to id {a.id!r} is to another prompt than line {row.line} "
                             "of the prompts file has under that id; write to another --out, or remove those lines")
    return {(a.id, a.model) for a in answers}


def too_long(config, asks: Sequence[Ask], max_tokens: int) -> tuple[list[Ask], Counter[str]]:
    """The asks every instance of their model can take, and the others counted by why: the prompt and
    max_tokens together would not fit the instances' max_model_len (the server would refuse them)."""
    limit = {m: min(i.max_model_len for i in config.instances if i.model == m) for m in config.models()}
    fit, refused = [], Counter[str]()
    for ask in asks:
        if ask.prompt_tokens + max_tokens > limit[ask.model]:
            refused[f"{ask.model}: prompt + --max-tokens above max_model_len {limit[ask.model]}"] += 1
        else:
            fit.append(ask)
    return fit, refused


@dataclass(frozen=True, slots=True)
class Estimate:
    total_usd: float
    by_model: dict[str, tuple[int, float]]  # model -> (requests, USD)
    prompt_tokens: int


def estimate_cost(config, asks: Sequence[Ask], max_tokens: int) -> Estimate:
    """An upper bound of what the asks cost: their prompt tokens, max_tokens answer tokens each, each model at
    its dearest instance's input and output prices."""
    prices = {m: (max(i.price_input_per_mtok for i in config.instances if i.model == m),
                   max(i.price_output_per_mtok for i in config.instances if i.model == m)) for m in config.models()}
    by_model: dict[str, tuple[int, float]] = {}
    for ask in asks:
        price_in, price_out = prices[ask.model]
        n, usd = by_model.get(ask.model, (0, 0.0))
        by_model[ask.model] = (n + 1, usd + (ask.prompt_tokens * price_in + max_tokens * price_out) / 1e6)
    return Estimate(sum(usd for _, usd in by_model.values()), by_model, sum(a.prompt_tokens for a in asks))


def format_estimate(estimate: Estimate, max_tokens: int, counter: TokenCounter) -> str:
    lines = [f"cost estimate, at most {estimate.total_usd:.6f} USD: {estimate.prompt_tokens:,} prompt tokens "
             f"(counted: {counter.method}) and {max_tokens} answer tokens a request, each model at its dearest "
             "instance's prices"]
    width = max((len(m) for m in estimate.by_model), default=5)
    for model, (n, usd) in estimate.by_model.items():
        lines.append(f"  {model:<{width}}  {n:>6} requests  {usd:.6f} USD")
    return "\n".join(lines)


# --- asking ----------------------------------------------------------------------------------------------------


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


async def ask_once(client: httpx.AsyncClient, instance, ask: Ask, max_tokens: int, timeout_s: float,
                   max_bytes: int, counter: TokenCounter) -> CollectedAnswer:
    """One request to one instance; AskFailed saying why (and whether another try may help)."""
    body = {"model": ask.model, "messages": chat_messages(ask.row.prompt), "max_tokens": max_tokens,
            "temperature": 0}  # greedy: a rerun of the collection gives the same labels
    headers = {"Authorization": f"Bearer {instance.api_key}"} if instance.api_key else {}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", instance.url + "/v1/chat/completions", json=body,
                                     headers=headers) as reply:
                data = await _read_bounded(reply, max_bytes)
                status = reply.status_code
    except (TimeoutError, httpx.TimeoutException):
        raise AskFailed(f"no answer within {timeout_s:g} s", retry=True) from None
    except httpx.HTTPError as e:
        raise AskFailed(f"{type(e).__name__} from {instance.name}", retry=True) from None
    if status != 200:
        raise AskFailed(f"HTTP {status}: {_error_message(data)}", retry=status in RETRIED_STATUSES)
    return _answer(data, instance, ask, counter)


async def _read_bounded(reply: httpx.Response, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in reply.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise AskFailed(f"an answer larger than {max_bytes} bytes ([upstream] max_response_bytes)", retry=False)
        chunks.append(chunk)
    return b"".join(chunks)


def _error_message(data: bytes) -> str:
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data.decode("utf-8", "replace")
    return " ".join(str(message).split())[:200]


def _answer(data: bytes, instance, ask: Ask, counter: TokenCounter) -> CollectedAnswer:
    try:
        body = json.loads(data)
        choice = body["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise AskFailed("the answer is not a chat completion with choices[0].message", retry=False) from None
    if not isinstance(text, str):
        raise AskFailed("the answer has no text (choices[0].message.content is not a string)", retry=False)
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    completion = usage.get("completion_tokens")
    if _is_count(completion):
        length, length_from = int(completion), "usage"
    else:  # a server that sends no usage: counted with the pool's tokenizer, and said so
        length, length_from = counter.count(text), "counted"
    prompt_tokens = usage.get("prompt_tokens")
    prompt_tokens = int(prompt_tokens) if _is_count(prompt_tokens) else ask.prompt_tokens
    cost = (prompt_tokens * instance.price_input_per_mtok + length * instance.price_output_per_mtok) / 1e6
    reason = choice.get("finish_reason")
    return CollectedAnswer(id=ask.row.id, model=ask.model, prompt=ask.row.prompt, answer=text, output_length=length,
                           finish_reason=reason if isinstance(reason, str) else None, length_from=length_from,
                           prompt_tokens=prompt_tokens, instance=instance.name, cost_usd=cost,
                           reference=ask.row.reference, task=ask.row.task)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(slots=True)
class RunTally:
    answered: int = 0
    spent_usd: float = 0.0
    failed: Counter[str] = field(default_factory=Counter)  # "model: reason" -> asks


async def collect_answers(config, asks: Sequence[Ask], settings: CollectSettings, log: AppendLog,
                          progress: ProgressLine) -> RunTally:
    """Ask every ask, appending each answer to `log` as it arrives; failures counted by model and reason."""
    rotation: dict[str, Iterator] = {m: itertools.cycle([i for i in config.instances if i.model == m])
                                     for m in config.models()}
    timeout_s = settings.timeout_s or config.upstream.response_timeout_s
    counter = TokenCounter()
    tally = RunTally()
    failed = tally.failed
    queue: asyncio.Queue[Ask | None] = asyncio.Queue(maxsize=2 * settings.concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while (ask := await queue.get()) is not None:
            for attempt in range(settings.retries + 1):
                try:
                    answer = await ask_once(client, next(rotation[ask.model]), ask, settings.max_tokens, timeout_s,
                                            config.upstream.max_response_bytes, counter)
                except AskFailed as e:
                    if e.retry and attempt < settings.retries:
                        await asyncio.sleep(RETRY_PAUSE_S * 2**attempt)
                        continue
                    failed[f"{ask.model}: {e}"] += 1
                else:
                    log.append(answer.to_json())
                    tally.answered += 1
                    tally.spent_usd += answer.cost_usd
                break
            progress.update(tally.answered + failed.total(), failed.total())

    limits = httpx.Limits(max_connections=settings.concurrency)
    timeout = httpx.Timeout(timeout_s, connect=config.upstream.connect_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(min(settings.concurrency, len(asks)))]

        async def feed() -> None:
            for ask in asks:
                await queue.put(ask)
            for _ in workers:
                await queue.put(None)

        tasks = [asyncio.create_task(feed()), *workers]
        try:
            await asyncio.gather(*tasks)  # a worker that fails stops the run (no feeder left waiting on it)
        finally:
            for task in tasks:
                task.cancel()
    return tally


# --- the command -----------------------------------------------------------------------------------------------


def run(config, prompts_path: Path, out: Path, settings: CollectSettings) -> int:
    """The `collect` command: 0 when every pair is answered (or nothing was to be sent), 1 when some failed
    (a rerun asks for those again), 2 when refused (--max-cost), 130 when interrupted."""
    prompts = read_prompts(prompts_path)
    models = pool_models(config, settings.models)
    # A line torn by a stopped run is cut off only by a run that will append after it.
    answers, note = read_answers(out, repair=settings.send)
    if note:
        print(note, file=sys.stderr)
    done = done_pairs(prompts, answers, out)
    counter = TokenCounter()
    tokens = {p.id: counter.count_chat(chat_messages(p.prompt)) for p in prompts}
    pending = [Ask(p, m, tokens[p.id]) for p in prompts for m in models if (p.id, m) not in done]
    asks, unfit = too_long(config, pending, settings.max_tokens)
    print(f"{len(prompts)} prompts x {len(models)} models: {len(prompts) * len(models) - len(pending)} answers "
          f"already in {out}, {len(asks)} to ask")
    for why, n in unfit.most_common():
        print(f"  not asked, {n}: {why}")
    estimate = estimate_cost(config, asks, settings.max_tokens)
    print(format_estimate(estimate, settings.max_tokens, counter))
    if settings.max_cost_usd is not None and estimate.total_usd > settings.max_cost_usd:
        print(f"error: the estimate ({estimate.total_usd:.6f} USD) is above --max-cost {settings.max_cost_usd:g}: "
              "nothing sent (lower --max-tokens, ask fewer --models or prompts, or raise --max-cost)",
              file=sys.stderr)
        return 2
    if not asks:
        return 1 if unfit else 0
    if not settings.send:
        print("nothing sent: run again with --yes to send these requests")
        return 0
    log = AppendLog(out)
    progress = ProgressLine("answers", len(asks))
    started = time.monotonic()
    try:
        tally = asyncio.run(collect_answers(config, asks, settings, log, progress))
    except KeyboardInterrupt:
        print(f"\ninterrupted: the answers received so far are in {out}; run the same command again to ask for "
              "the rest", file=sys.stderr)
        return 130
    finally:
        log.close()
    progress.update(tally.answered + tally.failed.total(), tally.failed.total(), final=True)
    print(f"{tally.answered} answers in {time.monotonic() - started:.1f} s, costing {tally.spent_usd:.6f} USD "
          f"(their usage at the serving instances' prices), appended to {out}")
    if tally.failed or unfit:
        reasons = tally.failed.most_common()
        for why, n in reasons[:SHOWN_REASONS]:
            print(f"  failed, {n}: {why}")
        if len(reasons) > SHOWN_REASONS:
            print(f"  ... and {len(reasons) - SHOWN_REASONS} other reasons")
        print(f"{tally.failed.total() + unfit.total()} pairs have no answer; run the same command again to retry "
              "the failed ones")
        return 1
    return 0
