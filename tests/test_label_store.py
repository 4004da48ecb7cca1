"""The label store, the completion log, the length writer and the export, on their own (gateway/learning/)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections import Counter

import pytest

from conftest import dump_toml
from gateway.config.sections import LearningConfig
from gateway.config_schema import ConfigError
from gateway.learning.completions import MAX_ID_CHARS, CompletionLog, LoggedCompletion, Principal
from gateway.learning.labels import Label, prompt_hash
from gateway.learning.store import DAY_S, LabelStore
from gateway.learning.writer import LabelWriter
from gateway.records import read_jsonl

A, B = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-72B-Instruct"
WEIGHTS = {"file": 1.0, "judge": 0.7, "feedback": 0.5}
T0 = 1_800_000_000.0  # an epoch time in 2027: the store reads no clock


def score(prompt: str, model: str, value: float, source: str = "feedback", created: float = T0,
          text: bool = True) -> Label:
    return Label(prompt_hash(prompt), model, source, value, created, prompt if text else None)


def length(prompt: str, model: str, tokens: int, censored: bool = False, created: float = T0) -> Label:
    return Label(prompt_hash(prompt), model, "length", tokens, created, prompt, censored)


def rows(store: LabelStore) -> list[tuple]:
    return [(lb.model, lb.source, lb.value, lb.censored) for lb in store.labels()]


# ---- the store -------------------------------------------------------------------------------

def test_the_first_label_of_a_prompt_model_and_source_stays():
    store = LabelStore.in_memory()
    assert store.add(score("p", A, 0.2)) == "stored"
    assert store.add(score("p", A, 0.9)) == "exists"  # a second feedback for the prompt on that model
    assert store.add(score("p", B, 0.9)) == "stored"  # another model
    assert store.add(score("p", A, 1.0, source="judge")) == "stored"  # another source, kept apart
    # A censored length and a full one are both kept: the bound never hides the length.
    assert store.add_many([length("p", A, 100, censored=True), length("p", A, 80),
                           length("p", A, 90)]) == Counter({"stored": 2, "exists": 1})
    assert sorted(rows(store)) == sorted([(A, "feedback", 0.2, False), (A, "judge", 1.0, False),
                                          (A, "length", 80, False), (A, "length", 100, True),
                                          (B, "feedback", 0.9, False)])
    assert store.rows == 5


def test_the_store_survives_a_restart(tmp_path):
    path = tmp_path / "nested" / "labels.db"  # its folder is made
    store = LabelStore(path, max_labels=10)
    store.add_many([score("p", A, 0.5), length("p", A, 40)])
    store.close()
    again = LabelStore(path, max_labels=10)
    assert again.rows == 2 and sorted(rows(again)) == [(A, "feedback", 0.5, False), (A, "length", 40, False)]
    assert again.add(score("p", A, 1.0)) == "exists"  # deduplication holds across the restart
    again.close()


def test_past_max_labels_new_rows_are_refused_and_none_pushed_out():
    store = LabelStore.in_memory(max_labels=2)
    assert store.add_many([score("p", A, 0.5), score("q", A, 0.5), score("r", A, 0.5)]) == \
        Counter({"stored": 2, "full": 1})
    assert store.add(length("s", A, 3)) == "full"
    assert {lb.prompt for lb in store.labels()} == {"p", "q"}  # the first two stay
    store.max_labels = 3  # a reload raised it
    assert store.add(length("s", A, 3)) == "stored"


def test_max_labels_bounds_what_every_process_writing_the_file_stored(tmp_path):
    """`serve --workers`: two workers, each its own connection to one file, take turns writing; the bound is
    the file's, and a restart finds the count the triggers kept (a prune included)."""
    path = tmp_path / "labels.db"
    first, second = LabelStore(path, max_labels=5), LabelStore(path, max_labels=5)
    outcomes = Counter()
    for k in range(4):
        outcomes += first.add_many([score(f"a{k}", A, 0.5)])
        outcomes += second.add_many([score(f"b{k}", A, 0.5)])
    assert outcomes == Counter({"stored": 5, "full": 3})
    assert first.rows == second.rows == 5
    assert second.prune(T0 + 31 * DAY_S, retention_days=30) == 5  # one worker's prune frees room for both
    assert first.rows == 0 and first.add(score("c", A, 0.5)) == "stored"
    first.close()
    second.close()
    again = LabelStore(path, max_labels=5)
    assert again.rows == 1
    again.close()


def test_prune_deletes_traffic_labels_past_their_retention_and_keeps_file_labels():
    store = LabelStore.in_memory()
    old, new = T0 - 10 * DAY_S, T0 - DAY_S
    store.add_many([score("a", A, 1.0, created=old), length("a", A, 5, created=old),
                    score("a", A, 1.0, source="file", created=old), score("b", A, 0.0, created=new)])
    assert store.prune(T0, retention_days=5) == 2
    assert sorted((lb.prompt, lb.source) for lb in store.labels()) == [("a", "file"), ("b", "feedback")]
    assert store.rows == 2
    assert store.add(score("c", A, 1.0)) == "stored"  # the count was kept right


def test_stats_count_by_source_and_model():
    store = LabelStore.in_memory()
    store.add_many([score("p", A, 1.0, created=T0), score("q", B, 0.0, created=T0 + 5, text=False),
                    length("p", A, 10), length("p", A, 12, censored=True), length("q", B, 7)])
    stats = store.stats()
    assert stats.total == 5 and stats.by_source == {"feedback": 2, "length": 3}
    assert stats.by_model == {A: {"feedback": 1, "length": 2}, B: {"feedback": 1, "length": 1}}
    assert stats.lengths == 3 and stats.censored_lengths == 1 and stats.censored_share == pytest.approx(1 / 3)
    assert (stats.oldest, stats.newest) == (T0, T0 + 5)
    assert (stats.prompts, stats.prompts_with_text) == (2, 2)  # q's length row carries its text


def test_a_label_is_checked():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        score("p", A, 1.5)
    with pytest.raises(ValueError, match="unknown label source"):
        Label(prompt_hash("p"), A, "thumbs", 1.0, T0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only a length"):
        Label(prompt_hash("p"), A, "feedback", 1.0, T0, censored=True)
    with pytest.raises(ValueError, match="whole number"):
        Label(prompt_hash("p"), A, "length", 2.5, T0)


# ---- the completion log ----------------------------------------------------------------------

KEY_A = Principal("a")


def logged(cid: str, at: float, prompt: str | None = "a prompt", owner: Principal = KEY_A) -> LoggedCompletion:
    return LoggedCompletion(cid, owner, A, prompt_hash(prompt or ""), prompt, at)


def test_the_completion_log_forgets_the_oldest_past_its_bound():
    log = CompletionLog(max_completions=3, ttl_s=100, max_text_chars=10_000)
    for i in range(5):
        assert log.put(logged(f"c{i}", at=i))
    assert len(log) == 3
    assert [log.get(f"c{i}", now=5) is not None for i in range(5)] == [False, False, True, True, True]


def test_the_completion_log_forgets_ids_past_their_ttl():
    log = CompletionLog(max_completions=10, ttl_s=60, max_text_chars=10_000)
    log.put(logged("old", at=0.0))
    log.put(logged("new", at=30.0))
    assert log.get("old", now=59.9) is not None
    assert log.get("old", now=60.0) is None and len(log) == 1  # expired at exactly its ttl
    assert log.get("new", now=89.0) is not None
    assert log.get("new", now=90.0) is None and len(log) == 0


def test_the_completion_log_bounds_the_prompt_text_it_holds():
    log = CompletionLog(max_completions=10, ttl_s=60, max_text_chars=25)
    log.put(logged("a", at=0, prompt="x" * 10))
    log.put(logged("b", at=1, prompt="y" * 10))
    assert log.text_chars == 20
    log.put(logged("c", at=2, prompt="z" * 10))  # 30 characters: the oldest goes
    assert log.get("a", 3) is None and log.text_chars == 20
    log.put(logged("d", at=3, prompt="w" * 26))  # longer than the whole budget: kept by its hash alone
    entry = log.get("d", 4)
    assert entry is not None and entry.prompt is None and entry.prompt_hash == prompt_hash("w" * 26)


def test_an_id_seen_on_two_answers_cannot_be_rated():
    log = CompletionLog(max_completions=10, ttl_s=60, max_text_chars=100)
    assert log.put(logged("same", at=0, owner=Principal("a")))
    assert not log.put(logged("same", at=1, owner=Principal("b")))
    assert log.get("same", 2) is None  # neither a nor b may rate the other's answer
    assert not log.put(logged("same", at=2))  # until the ambiguous id expires
    assert not log.put(logged("", at=3)) and not log.put(logged("x" * (MAX_ID_CHARS + 1), at=3))
    assert log.get("same", 61) is None and log.put(logged("same", at=61))


# ---- the writer --------------------------------------------------------------------------------

def test_the_writer_drops_and_counts_past_its_queue_and_writes_the_rest():
    counts: Counter[str] = Counter()
    store = LabelStore.in_memory(max_labels=3)

    async def scenario():
        writer = LabelWriter(store, capacity=4, count=lambda outcome, n: counts.update({outcome: n}))
        offered = [writer.offer(length(f"p{i}", A, i)) for i in range(5)] + [writer.offer(length("p0", A, 0))]
        task = asyncio.create_task(writer.run())
        await writer.close(timeout_s=5)
        task.cancel()
        return offered

    assert asyncio.run(scenario()) == [True, True, True, True, False, False]
    # Of the four queued: three stored, one refused by max_labels; one dropped at the full queue, and
    # one offered once the queue was full again is dropped too.
    assert counts == Counter({"stored": 3, "full": 1, "queue_full": 2})
    assert store.rows == 3


def test_the_writer_gathers_labels_offered_close_together_into_one_transaction_and_flush_waits_for_them():
    """Answers arriving one by one share a commit (each its own transaction cost a fifth of passthrough
    throughput); a flush returns once what was offered before it is stored, whatever comes after."""
    store = LabelStore.in_memory()
    transactions: list[int] = []
    add_many = store.add_many

    def counted(labels):
        transactions.append(len(labels))
        return add_many(labels)

    store.add_many = counted  # type: ignore[method-assign]

    async def scenario():
        writer = LabelWriter(store, capacity=100, count=lambda outcome, n: None)
        task = asyncio.create_task(writer.run())
        for i in range(40):  # one answer every 2 ms, well within one gathering
            writer.offer(length(f"p{i}", A, i))
            await asyncio.sleep(0.002)
        flushed = await writer.flush(timeout_s=5)
        stored_at_flush = store.rows
        writer.offer(length("late", A, 1))
        task.cancel()
        return flushed, stored_at_flush

    flushed, stored_at_flush = asyncio.run(scenario())
    assert flushed and stored_at_flush == 40
    assert len(transactions) <= 2 and sum(transactions) == 40


def test_a_flush_gives_up_at_its_timeout_when_the_writer_is_stuck():
    """A refresh must not hang on a disk that does not answer: flush returns False at its bound."""
    store = LabelStore.in_memory()
    gate = threading.Event()
    add_many = store.add_many

    def stuck(labels):
        gate.wait(10)
        return add_many(labels)

    store.add_many = stuck  # type: ignore[method-assign]

    async def scenario():
        writer = LabelWriter(store, capacity=10, count=lambda outcome, n: None)
        task = asyncio.create_task(writer.run())
        writer.offer(length("p", A, 1))
        loop = asyncio.get_running_loop()
        started = loop.time()
        flushed = await writer.flush(timeout_s=0.5)
        waited = loop.time() - started
        gate.set()
        again = await writer.flush(timeout_s=5)  # once the disk answers, the same label is waited for
        task.cancel()
        return flushed, waited, again

    flushed, waited, again = asyncio.run(scenario())
    assert not flushed and 0.5 <= waited < 3
    assert again and store.rows == 1

# ---- the export ---------------------------------------------------------------------------------

def filled_store(path=None) -> LabelStore:
    store = LabelStore(path, 1000) if path else LabelStore.in_memory()
    store.add_many([
        # complete for A and B, two quality sources on A; a second full length of A is a duplicate
        score("complete", A, 1.0, source="file"), score("complete", A, 0.0), length("complete", A, 60),
        length("complete", A, 70, censored=True), length("complete", A, 50),
        score("complete", B, 0.5, source="judge"), length("complete", B, 30),
        # every answer of B was cut: its censored length, marked
        score("cut", A, 1.0), length("cut", A, 5), score("cut", B, 0.0), length("cut", B, 64, censored=True),
        # no quality label for B
        score("half", A, 1.0), length("half", A, 9), length("half", B, 9),
        # no length for A
        score("unmeasured", A, 1.0), score("unmeasured", B, 1.0), length("unmeasured", B, 3),
        # its text was never kept
        score("secret", A, 1.0, text=False), score("secret", B, 1.0, text=False),
        Label(prompt_hash("secret"), A, "length", 4, T0), Label(prompt_hash("secret"), B, "length", 4, T0),
    ])
    return store


def test_export_round_trips_through_the_workload_reader(tmp_path):
    out = tmp_path / "traffic.jsonl"
    summary = filled_store().export(out, WEIGHTS, count_tokens=len, models=[A, B])
    assert summary.exported == 2 and summary.censored_lengths == 1
    assert summary.left_out == {f"no quality label for {B}": 1, f"no answer length for {A}": 1,
                                "no prompt text (kept as a hash only)": 1}
    records = {r.prompt: r for r in read_jsonl(out)}
    assert set(records) == {"complete", "cut"}
    complete = records["complete"]
    assert complete.id == prompt_hash("complete") and complete.input_len == len("complete")
    # file 1.0 weighted 1.0 and feedback 0.0 weighted 0.5: (1.0 * 1 + 0.0 * 0.5) / 1.5
    assert complete.models[A].score == pytest.approx(2 / 3)
    assert complete.models[A].output_length == 60  # the uncensored length, not the longer censored 70
    assert (complete.models[B].score, complete.models[B].output_length) == (0.5, 30)
    assert records["cut"].models[B].output_length == 64
    raw = {json.loads(line)["prompt"]: json.loads(line) for line in out.read_text().splitlines()}
    assert raw["cut"]["models"][B]["length_censored"] is True
    assert "length_censored" not in raw["complete"]["models"][A]
    assert raw["complete"]["models"][A]["sources"] == ["feedback", "file"]


def test_a_source_weighted_zero_is_left_out_and_nothing_exported_writes_no_file(tmp_path):
    out = tmp_path / "traffic.jsonl"
    only_file = {"file": 1.0, "judge": 0.0, "feedback": 0.0}
    summary = filled_store().export(out, only_file, count_tokens=len, models=[A])
    records = read_jsonl(out)
    assert [r.prompt for r in records] == ["complete"] and records[0].models[A].score == 1.0
    assert summary.left_out[f"no quality label for {A}"] == 3
    empty = tmp_path / "none.jsonl"
    assert filled_store().export(empty, WEIGHTS, len, models=["no-such-model"]).exported == 0
    assert not empty.exists() and not (tmp_path / "none.jsonl.tmp").exists()


def test_labels_stats_and_export_on_the_command_line(tmp_path):
    store = filled_store(tmp_path / "labels.db")
    store.close()
    config = tmp_path / "config.toml"
    config.write_text(dump_toml({
        "learning": {"path": str(tmp_path / "labels.db"), "source_weights": {"feedback": 1.0}},
        "instances": [{"name": "a", "url": "http://127.0.0.1:9", "model": A, "gpu": "A30-24GB",
                       "price_input_per_mtok": 0.1, "price_output_per_mtok": 0.2, "tpot_prior_ms": 20.0}]}))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gateway.cli", "labels", *args, "--config", str(config)],
                              capture_output=True, text=True, timeout=60)

    stats = cli("stats")
    assert stats.returncode == 0, stats.stderr
    assert "20 labels" in stats.stdout and "for 5 prompts (4 with their text)" in stats.stdout
    assert "of which 2 censored" in stats.stdout
    out = tmp_path / "traffic.jsonl"
    export = cli("export", "--out", str(out))  # every model with a quality label: A and B
    assert export.returncode == 0, export.stderr
    assert "exported 2 prompts" in export.stdout and "left out 3 prompts" in export.stdout
    records = {r.prompt: r for r in read_jsonl(out)}
    assert records["complete"].models[A].score == pytest.approx(0.5)  # feedback weighted as the config says
    missing = cli("export", "--out", str(tmp_path / "x.jsonl"), "--models", "no-such-model")
    assert missing.returncode == 1 and "no file written" in missing.stdout


# ---- the config ------------------------------------------------------------------------------

def test_source_weights_merge_over_the_defaults_and_are_checked():
    assert dict(LearningConfig(source_weights={"feedback": 1.0}).source_weights) == \
        {"file": 1.0, "judge": 0.7, "feedback": 1.0}
    with pytest.raises(ConfigError, match="unknown source 'length'"):
        LearningConfig(source_weights={"length": 1.0})
    with pytest.raises(ConfigError, match=">= 0"):
        LearningConfig(source_weights={"judge": -1.0})
    with pytest.raises(ConfigError, match="max_completions"):
        LearningConfig(max_completions=0)
