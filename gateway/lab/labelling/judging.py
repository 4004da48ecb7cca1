"""`routebalance judge`: scores for the answers `collect` stored, and the workload file `train --workload` reads.

Each answer gets a score in [0, 1]: by the reference rule (gateway/learning/judge.py `reference_score`) where
its prompt came with a reference answer, else by the [judge] endpoint. Judge scores are cached beside the
output (OUT.scores.jsonl, appended as they arrive), keyed by the prompt, the model, the answer's hash and the
judge (its model, URL and rubric): a rerun asks the judge only for what it has not scored, and a changed
answer, judge or rubric is scored afresh. The judge is asked within [judge]'s bounds (max_concurrency calls in
flight, fed from a bounded queue, each within timeout_s); a transient failure (a timeout, HTTP 429 or 5xx) is
tried again, at most TRIES times in all.

The workload (gateway/records.py's shape) has one record per prompt with a score and a length for every model
of the answers file: `train` refuses a model labelled in some records only. The others are counted by the
first thing they lack. A length cut at max_tokens is written as it is, marked `"length_censored": true`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.lab.labelling.answers import CollectedAnswer, read_answers
from gateway.lab.labelling.appendlog import AppendLog, ProgressLine, read_log
from gateway.learning.judge import Judge, JudgeError, reference_score
from gateway.tokens import TokenCounter

SCORES_SUFFIX = ".scores.jsonl"
TRIES = 3  # calls to the judge for one answer at most, when the failures are transient
RETRY_PAUSE_S = 1.0  # before the second call; doubled before the third
SHOWN_ERRORS = 5  # the judge's distinct errors printed as examples


@dataclass(slots=True)
class PromptAnswers:
    """One prompt and each model's answer to it."""

    id: str
    prompt: str
    reference: str | None
    task: str | None
    answers: dict[str, CollectedAnswer] = field(default_factory=dict)


def group_answers(answers: Sequence[CollectedAnswer], path: Path) -> tuple[list[PromptAnswers], tuple[str, ...]]:
    """The answers by prompt (in the file's order) and the models answering (in order of first appearance);
    ValueError naming the lines when an id has two prompts, or a model two answers to one prompt."""
    groups: dict[str, PromptAnswers] = {}
    first_line: dict[str, int] = {}
    for a in answers:
        group = groups.get(a.id)
        if group is None:
            group = groups[a.id] = PromptAnswers(a.id, a.prompt, a.reference, a.task)
            first_line[a.id] = a.line
        elif group.prompt != a.prompt:
            raise ValueError(f"{path}:{a.line}: id {a.id!r} has another prompt than on line {first_line[a.id]}")
        if a.model in group.answers:
            raise ValueError(f"{path}:{a.line}: a second answer of {a.model} to id {a.id!r} (the first is on line "
                             f"{group.answers[a.model].line})")
        group.answers[a.model] = a
    return list(groups.values()), tuple(dict.fromkeys(a.model for a in answers))


def answer_hash(answer: str) -> str:
    return hashlib.sha256(answer.encode("utf-8", "surrogatepass")).hexdigest()


def scores_path(out: Path) -> Path:
    """Where the judge's scores for `out` are cached."""
    return out.with_name(out.name + SCORES_SUFFIX)


def cached_scores(path: Path, judge_identity: str) -> dict[tuple[str, str, str], float]:
    """(prompt id, model, answer hash) -> the score this judge gave, from the cache file (a torn last line is
    cut off, so the next append starts on a line of its own)."""
    rows, note = read_log(path, repair=True)
    if note:
        print(note, file=sys.stderr)
    found = {}
    for lineno, row in rows:
        score = row.get("score")
        if not isinstance(score, (int, float)) or isinstance(score, bool) or not 0 <= score <= 1:
            raise ValueError(f"{path}:{lineno}: score must be a number in [0, 1], got {score!r} (remove the line, "
                             "or the file, to score again)")
        if row.get("judge") == judge_identity:
            found[(str(row.get("id")), str(row.get("model")), str(row.get("answer_sha256")))] = float(score)
    return found


async def judge_answers(judge: Judge, todo: Sequence[CollectedAnswer], log: AppendLog,
                        progress: ProgressLine) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], str]]:
    """The judge's score of each answer, appended to `log` as it comes, and the error of each it could not
    score, both keyed by (prompt id, model)."""
    scores: dict[tuple[str, str], float] = {}
    errors: dict[tuple[str, str], str] = {}
    workers_n = min(judge.config.max_concurrency, len(todo))
    queue: asyncio.Queue[CollectedAnswer | None] = asyncio.Queue(maxsize=2 * workers_n)

    async def worker() -> None:
        while (a := await queue.get()) is not None:
            for attempt in range(TRIES):
                try:
                    score = await judge.score(a.prompt, a.answer)
                except JudgeError as e:
                    if e.transient and attempt + 1 < TRIES:
                        await asyncio.sleep(RETRY_PAUSE_S * 2**attempt)
                        continue
                    errors[(a.id, a.model)] = str(e)
                else:
                    scores[(a.id, a.model)] = score
                    log.append({"id": a.id, "model": a.model, "answer_sha256": answer_hash(a.answer),
                                "judge": judge.identity, "score": score})
                break
            progress.update(len(scores) + len(errors), len(errors))

    async def feed() -> None:
        for a in todo:
            await queue.put(a)
        for _ in range(workers_n):
            await queue.put(None)

    tasks = [asyncio.create_task(feed()), *(asyncio.create_task(worker()) for _ in range(workers_n))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return scores, errors


@dataclass(slots=True)
class WorkloadSummary:
    written: int = 0
    censored: int = 0  # model labels whose answer was cut at max_tokens
    left_out: Counter[str] = field(default_factory=Counter)  # why -> prompts


def workload_records(groups: Sequence[PromptAnswers], models: Sequence[str],
                     scores: dict[tuple[str, str], tuple[float, str]], errors: dict[tuple[str, str], str],
                     count_tokens: Callable[[str], int], summary: WorkloadSummary) -> list[dict]:
    """One workload record per prompt with a score and a length for every model; the rest counted by why."""
    records = []
    for g in groups:
        labels: dict[str, dict] = {}
        why = None
        for model in models:
            a = g.answers.get(model)
            if a is None:
                why = f"no answer from {model} (collect failed or was stopped; rerun it)"
                break
            scored = scores.get((g.id, model))
            if scored is None:
                why = (f"no score for {model}: the judge failed" if (g.id, model) in errors
                       else f"no score for {model}")
                break
            labels[model] = {"score": scored[0], "output_length": a.output_length, "source": scored[1]}
            if a.cut:
                labels[model]["length_censored"] = True
        if why is not None:
            summary.left_out[why] += 1
            continue
        summary.written += 1
        summary.censored += sum(1 for label in labels.values() if label.get("length_censored"))
        record = {"id": g.id, "prompt": g.prompt, "input_len": count_tokens(g.prompt)}
        if g.task is not None:
            record["task"] = g.task
        records.append(record | {"models": labels})
    return records


def write_records(records: Sequence[dict], out: Path) -> None:
    """JSON Lines, replacing `out` at once (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def run(config, answers_path: Path, out: Path) -> int:
    """The `judge` command: 0 when a workload was written, 1 when no prompt could be written, 2 when the judge
    may not or cannot be used (no [judge] url, a judge outside the pool not allowed prompts, no API key), 130
    when interrupted."""
    answers, note = read_answers(answers_path, repair=False)
    if note:
        print(note, file=sys.stderr)
    if not answers:
        raise ValueError(f"{answers_path}: no answers (write them with `routebalance collect`)")
    groups, models = group_answers(answers, answers_path)
    pool = config.models()
    # The pool's order, not the order answers happened to arrive in: the same file gives the same workload.
    models = tuple(sorted(models, key=lambda m: pool.index(m) if m in pool else len(pool)))
    strangers = [m for m in models if m not in pool]
    if strangers:
        print(f"note: {', '.join(strangers)} {'is' if len(strangers) == 1 else 'are'} not in this config's pool "
              f"({', '.join(pool)}): `train` with this config will refuse the workload", file=sys.stderr)
    scores: dict[tuple[str, str], tuple[float, str]] = {
        (a.id, a.model): (reference_score(a.answer, a.reference), "reference")
        for a in answers if a.reference is not None}
    unreferenced = [a for a in answers if a.reference is None]
    print(f"{len(answers)} answers of {len(models)} models to {len(groups)} prompts: {len(scores)} checked against "
          f"a reference, {len(unreferenced)} for the judge")
    errors: dict[tuple[str, str], str] = {}
    if unreferenced:
        try:
            judged, errors = judge_scores(config, unreferenced, scores_path(out))
        except JudgeError as e:
            print(f"error: {e} ({len(unreferenced)} answers have no reference to check them by)", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"\ninterrupted: the scores so far are cached in {scores_path(out)}; run the same command again "
                  "to go on", file=sys.stderr)
            return 130
        scores |= {key: (score, "judge") for key, score in judged.items()}
    summary = WorkloadSummary()
    records = workload_records(groups, models, scores, errors, TokenCounter().count, summary)
    if records:
        write_records(records, out)
    _report(summary, records, models, errors, out)
    return 0 if records else 1


def judge_scores(config, answers: Sequence[CollectedAnswer], cache: Path):
    """The [judge]'s score of each answer, from the cache where it has one, else asked (and cached), and the
    error of each it could not score, both keyed by (prompt id, model). JudgeError when it may not be used."""
    judge = Judge(config.judge, [i.url for i in config.instances])
    cached = cached_scores(cache, judge.identity)
    scores: dict[tuple[str, str], float] = {}
    todo = []
    for a in answers:
        hit = cached.get((a.id, a.model, answer_hash(a.answer)))
        if hit is None:
            todo.append(a)
        else:
            scores[(a.id, a.model)] = hit
    print(f"judge {judge.model} at {config.judge.url}: {len(scores)} scores cached in {cache}, {len(todo)} to ask")
    if not todo:
        return scores, {}

    async def ask():
        async with judge:
            return await judge_answers(judge, todo, log, progress)

    log = AppendLog(cache)
    progress = ProgressLine("answers judged", len(todo))
    try:
        judged, errors = asyncio.run(ask())
    finally:
        log.close()
    progress.update(len(judged) + len(errors), len(errors), final=True)
    return scores | judged, errors


def _report(summary: WorkloadSummary, records: Sequence[dict], models: Sequence[str],
            errors: dict[tuple[str, str], str], out: Path) -> None:
    if errors:
        print(f"the judge could not score {len(errors)} answers (a rerun asks again), e.g.:")
        for message in list(dict.fromkeys(errors.values()))[:SHOWN_ERRORS]:
            print(f"  {message}")
    if records:
        print(f"wrote {summary.written} prompts labelled for {', '.join(models)} to {out}")
        if summary.censored:
            print(f'{summary.censored} labels are of answers cut at max_tokens: marked "length_censored": true')
    else:
        print(f"no prompt has a score and a length for every model: {out} not written")
    if summary.left_out:
        print(f"left out {summary.left_out.total()} prompts:")
        for why, n in summary.left_out.most_common():
            print(f"  {n:>7}  {why}")
