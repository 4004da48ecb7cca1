"""Offline collection: `routebalance collect` against the emulated pool and stub instances (every model asked,
a cost estimate first, --max-cost, an interrupted run resumed), `routebalance judge` with a stub judge and with
reference answers (the workload it writes is read back and accepted for `train`), the [judge] section, and the
judge's parsing and reference rule. An opt-in test uses a real llama.cpp server as the judge."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stubs import MODEL, LoopThread, Stub, StubJudge, stub_config, stub_instance

from conftest import dump_toml, free_port, pool_config, wait_for
from gateway.cli import main
from gateway.config.sections import DEFAULT_RUBRIC, JudgeConfig, parse_config
from gateway.config.store import default_config_path, load_config
from gateway.config_schema import ConfigError
from gateway.core.engine.profiles import arch_for
from gateway.lab.emulator.outputs import OutputLengths
from gateway.lab.emulator.server import EmulatedPool
from gateway.lab.labelling.answers import CollectedAnswer, read_answers
from gateway.lab.labelling.appendlog import read_log
from gateway.lab.labelling.judging import scores_path
from gateway.lab.training.build import checked_workload
from gateway.learning.judge import (
    CUT_MARK,
    Judge,
    JudgeError,
    fill_rubric,
    outside_pool_problem,
    parse_score,
    reference_score,
    reply_text,
)
from gateway.records import ModelLabel, Record, prompt_key, read_jsonl
from gateway.tokens import TokenCounter

MAX_TOKENS = 8  # answers stay short: the emulated 72B writes about 20 tokens a second
KNOWN = "What is six times seven?"  # the emulator knows this prompt: every model answers it in KNOWN_TOKENS
KNOWN_TOKENS = 3
PROMPTS = [{"id": "q1", "prompt": KNOWN, "reference": "42", "task": "math"},
           {"id": "q2", "prompt": "Name a colour.", "task": "chat"},
           {"prompt": "Say hello to the reader."}]


@pytest.fixture(scope="module")
def loop_thread():
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture
def judge_server(loop_thread):
    judge = StubJudge()
    loop_thread.call(judge.start())
    yield judge
    loop_thread.call(judge.stop())


@pytest.fixture(scope="module")
def emulated(loop_thread, tmp_path_factory):
    """The default 13-instance pool, emulated on free loopback ports; it knows KNOWN's answer lengths.
    Yields the config's path."""
    path = pool_config(tmp_path_factory.mktemp("collect-pool"))
    config = load_config(path)
    means = {i.model: arch_for(i.model).mean_output_tokens for i in config.instances}
    known = Record(prompt_key(KNOWN), KNOWN, "math", 10,
                   {m: ModelLabel(1.0, KNOWN_TOKENS) for m in config.models()})

    async def start():
        pool = EmulatedPool(config, lengths=OutputLengths.from_records(means, [known]))
        await pool.start()
        return pool

    pool = loop_thread.call(start())
    yield path
    loop_thread.call(pool.stop())


def served(config) -> int:
    """Completions the emulated instances have finished so far (from their vLLM metrics)."""
    total = 0.0
    for inst in config.instances:
        families = text_string_to_metric_families(httpx.get(inst.url + "/metrics", timeout=5).text)
        total += sum(s.value for f in families if f.name == "vllm:request_success"
                     for s in f.samples if s.name.endswith("_total"))
    return int(total)


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def collect(config: Path, prompts: Path, out: Path, *extra: str) -> int:
    return main(["collect", str(prompts), "--out", str(out), "--config", str(config), "--max-tokens",
                 str(MAX_TOKENS), *extra])


# --- collect -----------------------------------------------------------------------------------------------------


def test_collect_asks_every_model_once_and_a_rerun_asks_nothing(emulated, tmp_path, capsys):
    config = load_config(emulated)
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "answers.jsonl"
    before = served(config)

    # Without --yes: the estimate, and nothing sent.
    assert collect(emulated, prompts, out) == 0
    printed = capsys.readouterr().out
    counter = TokenCounter()
    expected = 0.0
    for row in PROMPTS:
        tokens = counter.count_chat([{"role": "user", "content": row["prompt"]}])
        for model in config.models():
            mine = [i for i in config.instances if i.model == model]
            expected += (tokens * max(i.price_input_per_mtok for i in mine)
                         + MAX_TOKENS * max(i.price_output_per_mtok for i in mine)) / 1e6
    assert f"at most {expected:.6f} USD" in printed and "run again with --yes" in printed
    assert not out.exists() and served(config) == before

    assert collect(emulated, prompts, out, "--yes") == 0
    answers, note = read_answers(out, repair=False)
    assert note is None
    ids = ["q1", "q2", prompt_key(PROMPTS[2]["prompt"])]
    assert sorted((a.id, a.model) for a in answers) == sorted((i, m) for i in ids for m in config.models())
    assert served(config) == before + len(answers) == before + 12
    by_name = {i.name: i for i in config.instances}
    for a in answers:
        inst = by_name[a.instance]
        assert inst.model == a.model and a.answer and a.length_from == "usage"
        assert 1 <= a.output_length <= MAX_TOKENS and a.finish_reason in ("stop", "length")
        assert a.cost_usd == pytest.approx((a.prompt_tokens * inst.price_input_per_mtok
                                            + a.output_length * inst.price_output_per_mtok) / 1e6)
        assert a.reference == PROMPTS[ids.index(a.id)].get("reference")
        if a.id == "q1":  # the emulator's known answer: its real length, ended by the model
            assert (a.output_length, a.finish_reason) == (KNOWN_TOKENS, "stop") and a.task == "math"
    # A model's requests take its instances in turn: the 7B's five instances served its three prompts.
    assert len({a.instance for a in answers if a.model == "Qwen/Qwen2.5-7B-Instruct"}) == 3

    written = out.read_bytes()
    assert collect(emulated, prompts, out, "--yes") == 0
    assert "12 answers already in" in capsys.readouterr().out
    assert out.read_bytes() == written and served(config) == before + 12


@pytest.fixture
def stub_pool(loop_thread, tmp_path):
    """Two stub instances of MODEL (each answer ends after 4 tokens, 0.3 s after the request), and their
    config; yields (stubs, config path)."""
    stubs = [Stub(mode={"stop": 4, "delay_s": 0.3}), Stub(mode={"stop": 4, "delay_s": 0.3})]
    for stub in stubs:
        loop_thread.call(stub.start())
    yield stubs, stub_config(tmp_path, stubs)
    for stub in stubs:
        loop_thread.call(stub.stop())


def test_an_interrupted_run_resumes_with_the_pairs_it_lacks(stub_pool, tmp_path, capsys):
    stubs, config = stub_pool
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"id": f"p{k}", "prompt": f"question {k}"} for k in range(8)])
    out = tmp_path / "answers.jsonl"
    # SIGINT handled as a terminal would: a runner started in the background (`cmd &`) ignores it, and its
    # children would inherit that, making Ctrl-C a no-op for them.
    run = subprocess.Popen([sys.executable, "-m", "gateway.cli", "collect", str(prompts), "--out", str(out),
                            "--config", str(config), "--concurrency", "1", "--max-tokens", "16", "--yes"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 2, 60, "two answers written")
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=30)
    finally:
        run.kill()
    assert run.returncode == 130 and "interrupted" in err and "Traceback" not in err
    kept, _ = read_answers(out, repair=False)
    assert 2 <= len(kept) < 8
    with out.open("a") as f:  # as if the stop had come in the middle of writing a line
        f.write('{"id": "p7", "model": "Qw')
    asked_before = sum(len(s.requests) for s in stubs)

    assert main(["collect", str(prompts), "--out", str(out), "--config", str(config), "--max-tokens", "16",
                 "--yes"]) == 0
    captured = capsys.readouterr()
    assert "cut short" in captured.err and f"{len(kept)} answers already in" in captured.out
    assert sum(len(s.requests) for s in stubs) - asked_before == 8 - len(kept)  # the missing pairs, no more
    answers, note = read_answers(out, repair=False)
    assert note is None and sorted(a.id for a in answers) == [f"p{k}" for k in range(8)]
    assert answers[:len(kept)] == kept  # what the first run stored stays as it was
    assert all((a.output_length, a.finish_reason) == (4, "stop") for a in answers)


def test_max_cost_refuses_before_sending_anything(stub_pool, tmp_path, capsys):
    stubs, config = stub_pool
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "a question"}])
    out = tmp_path / "answers.jsonl"
    assert main(["collect", str(prompts), "--out", str(out), "--config", str(config), "--max-cost", "1e-9",
                 "--yes"]) == 2
    assert "above --max-cost" in capsys.readouterr().err
    assert not out.exists() and all(not s.requests for s in stubs)


def test_failed_requests_are_retried_then_counted_and_left_for_a_rerun(loop_thread, tmp_path, capsys):
    broken = Stub(mode={"status": 500})
    loop_thread.call(broken.start())
    try:
        config = stub_config(tmp_path, [broken])
        prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "a question"}])
        out = tmp_path / "answers.jsonl"
        assert main(["collect", str(prompts), "--out", str(out), "--config", str(config), "--retries", "1",
                     "--yes"]) == 1
        printed = capsys.readouterr().out
        assert len(broken.requests) == 2  # one try and one retry
        assert f"failed, 1: {MODEL}: HTTP 500: stub failure" in printed and "run the same command again" in printed
        assert read_answers(out, repair=False)[0] == []
    finally:
        loop_thread.call(broken.stop())


def test_a_prompt_too_long_for_the_model_is_not_sent(loop_thread, tmp_path, capsys):
    small = Stub()
    loop_thread.call(small.start())
    try:
        config = stub_config(tmp_path, [small], instances=[stub_instance(small, "small", max_model_len=64)])
        prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "word " * 200}])
        assert main(["collect", str(prompts), "--out", str(tmp_path / "a.jsonl"), "--config", str(config),
                     "--max-tokens", "16", "--yes"]) == 1
        assert f"not asked, 1: {MODEL}: prompt + --max-tokens above max_model_len 64" in capsys.readouterr().out
        assert small.requests == []
    finally:
        loop_thread.call(small.stop())


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ""}', "prompts.jsonl:2: prompt: missing"),
    ('{"prompt": "x", "id": true}', "prompts.jsonl:2: id: must be a non-empty string or an integer"),
    ('{"prompt": "x", "reference": {"a": 1}}', "prompts.jsonl:2: reference: must be a string or a number"),
    ('{"prompt": "x", "id": "a"}', "prompts.jsonl:2: id 'a' is also the id of line 1"),
    ('{"prompt": "x", "task": 3}', "prompts.jsonl:2: task: must be a non-empty string"),
    ("not json", "prompts.jsonl:2: not valid JSON"),
])
def test_a_bad_prompts_line_is_named(tmp_path, capsys, line, message):
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "fine"}, line])
    assert main(["collect", str(prompts), "--out", str(tmp_path / "a.jsonl"), "--config",
                 str(default_config_path())]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_collect_refuses_a_model_outside_the_pool_and_a_json_array(tmp_path, capsys):
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "fine"}])
    config = str(default_config_path())
    assert main(["collect", str(prompts), "--out", str(tmp_path / "a.jsonl"), "--models", "gpt-x",
                 "--config", config]) == 2
    assert "'gpt-x' is not a model of the pool" in capsys.readouterr().err
    array = tmp_path / "array.jsonl"
    array.write_text('[{"prompt": "a"}]\n')
    assert main(["collect", str(array), "--out", str(tmp_path / "a.jsonl"), "--config", config]) == 2
    assert "a JSON array; the prompts file is JSON Lines" in capsys.readouterr().err


def test_a_torn_last_line_is_cut_and_a_whole_one_kept(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"a": 1}\n{"a": 2')
    rows, note = read_log(log, repair=False)
    assert [r for _, r in rows] == [{"a": 1}] and "ignored" in note and log.read_text().endswith("2")
    rows, note = read_log(log, repair=True)
    assert [r for _, r in rows] == [{"a": 1}] and "removed" in note and log.read_text() == '{"a": 1}\n'
    log.write_text('{"a": 1}\n{"a": 2}')
    rows, note = read_log(log, repair=True)
    assert [r for _, r in rows] == [{"a": 1}, {"a": 2}] and log.read_text() == '{"a": 1}\n{"a": 2}\n'
    log.write_text('{"a": 1}\nnope\n{"a": 3}\n')
    with pytest.raises(ValueError, match="log.jsonl:2: not a JSON object"):
        read_log(log, repair=False)


# --- judge -------------------------------------------------------------------------------------------------------


def judged_config(tmp_path: Path, judge_url: str, **judge) -> Path:
    """The default pool's config with [judge] at `judge_url`."""
    return pool_config(tmp_path, judge={"url": judge_url, "model": "judge-model", **judge})


def answers_file(path: Path, models, prompts) -> Path:
    """An answers file as `collect` writes it: each model's answer "The answer is 42." to each prompt (a
    prompt: (id, text, reference or None)); the 3B's answers are cut at max_tokens."""
    rows = [CollectedAnswer(id=i, model=m, prompt=text, answer="The answer is 42.", output_length=7 + k,
                            finish_reason="length" if "3B" in m else "stop", length_from="usage", prompt_tokens=20,
                            instance="x", cost_usd=1e-6, reference=ref, task="math").to_json()
            for i, text, ref in prompts for k, m in enumerate(models)]
    return write_lines(path, rows)


def test_judge_scores_by_reference_and_by_the_judge_and_writes_a_workload_train_accepts(judge_server, tmp_path,
                                                                                        capsys):
    config_path = judged_config(tmp_path, judge_server.url, outside_pool_may_see_prompts=True)
    config = load_config(config_path)
    models = config.models()
    answers = answers_file(tmp_path / "answers.jsonl", models,
                           [("r1", "What is 6 x 7?", "42"), ("r2", "What is 6 x 8?", "48"),
                            ("j1", "Is 42 the answer?", None)])
    out = tmp_path / "workload.jsonl"
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 0
    printed = capsys.readouterr().out
    assert "8 checked against a reference, 4 for the judge" in printed
    assert len(judge_server.requests) == len(models)  # only the answers without a reference
    sent = judge_server.requests[0][1]
    assert sent["model"] == "judge-model" and sent["max_tokens"] > 0 and sent["temperature"] == 0
    assert sent["messages"][0]["content"] == fill_rubric(DEFAULT_RUBRIC, "Is 42 the answer?", "The answer is 42.")

    records = read_jsonl(out)
    assert checked_workload(records, config, str(out)) == models
    scores = {r.id: {m: label.score for m, label in r.models.items()} for r in records}
    assert scores == {"r1": dict.fromkeys(models, 1.0), "r2": dict.fromkeys(models, 0.0),
                      "j1": dict.fromkeys(models, 0.8)}
    assert {r.kind for r in records} == {"math"}
    assert [r.models[m].output_length for m in models for r in records[:1]] == [7, 8, 9, 10]
    raw = [json.loads(line) for line in out.read_text().splitlines()]
    assert raw[0]["models"]["Qwen/Qwen2.5-3B-Instruct"]["length_censored"] is True
    assert raw[2]["models"]["Qwen/Qwen2.5-7B-Instruct"]["source"] == "judge"
    assert "3 labels are of answers cut at max_tokens" in printed  # the 3B's, one a prompt
    assert raw[0]["input_len"] == TokenCounter().count("What is 6 x 7?")

    # A rerun takes the judge's scores from the cache beside the output: nothing is asked again.
    assert scores_path(out).exists()
    first = out.read_text()
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 0
    assert "4 scores cached" in capsys.readouterr().out
    assert len(judge_server.requests) == len(models) and out.read_text() == first


def test_a_judge_outside_the_pool_is_refused_prompts_unless_allowed(judge_server, tmp_path, capsys):
    config_path = judged_config(tmp_path, judge_server.url)
    answers = answers_file(tmp_path / "answers.jsonl", load_config(config_path).models(), [("j1", "Why?", None)])
    out = tmp_path / "workload.jsonl"
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 2
    assert "outside_pool_may_see_prompts = true" in capsys.readouterr().err
    assert judge_server.requests == [] and not out.exists()


def test_without_a_judge_answers_without_reference_are_refused(tmp_path, capsys):
    config_path = pool_config(tmp_path)
    answers = answers_file(tmp_path / "answers.jsonl", load_config(config_path).models(), [("j1", "Why?", None)])
    assert main(["judge", str(answers), "--out", str(tmp_path / "w.jsonl"), "--config", str(config_path)]) == 2
    assert "no judge: set [judge] url and model" in capsys.readouterr().err


def test_unusable_judge_replies_leave_prompts_out_and_are_asked_again(judge_server, tmp_path, capsys):
    judge_server.reply = "What a lovely answer!"
    config_path = judged_config(tmp_path, judge_server.url, outside_pool_may_see_prompts=True)
    models = load_config(config_path).models()
    answers = answers_file(tmp_path / "answers.jsonl", models, [("r1", "6 x 7?", "42"), ("j1", "Why?", None)])
    out = tmp_path / "workload.jsonl"
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 0
    printed = capsys.readouterr().out
    assert "the judge could not score 4 answers" in printed and "no number in the judge's reply" in printed
    assert f"1  no score for {models[0]}: the judge failed" in printed
    assert [r.id for r in read_jsonl(out)] == ["r1"]
    assert len(judge_server.requests) == 4  # a reply without a score is not asked again in the same run
    judge_server.reply = "Score: 0.25"
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 0
    assert len(judge_server.requests) == 8 and [r.id for r in read_jsonl(out)] == ["r1", "j1"]


def test_judge_names_a_bad_answers_line(tmp_path, capsys):
    answers = write_lines(tmp_path / "answers.jsonl", [{"id": "a", "model": "m", "prompt": "p", "answer": "x",
                                                        "output_length": -1}])
    assert main(["judge", str(answers), "--out", str(tmp_path / "w.jsonl"), "--config",
                 str(default_config_path())]) == 2
    err = capsys.readouterr().err
    assert "answers.jsonl:1: output_length: must be >= 0" in err and "Traceback" not in err


def test_every_collected_answer_goes_to_the_workload(emulated, judge_server, tmp_path, capsys):
    """collect from the emulated pool, then judge: every prompt comes out labelled for every pool model."""
    models = load_config(emulated).models()
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPTS)
    answers = tmp_path / "answers.jsonl"
    assert collect(emulated, prompts, answers, "--yes") == 0
    data = tomllib.loads(emulated.read_text())
    data["judge"] = {"url": judge_server.url, "model": "judge-model", "outside_pool_may_see_prompts": True}
    config_path = tmp_path / "judged.toml"
    config_path.write_text(dump_toml(data))
    out = tmp_path / "workload.jsonl"
    assert main(["judge", str(answers), "--out", str(out), "--config", str(config_path)]) == 0
    records = read_jsonl(out)
    assert checked_workload(records, load_config(config_path), str(out)) == models
    assert len(records) == 3 and len(judge_server.requests) == 2 * len(models)  # q1 has a reference
    collected, _ = read_answers(answers, repair=False)
    lengths = {(a.id, a.model): a.output_length for a in collected}
    assert all(label.output_length == lengths[(r.id, m)] for r in records for m, label in r.models.items())


# --- the Judge over HTTP -----------------------------------------------------------------------------------------


def judge_of(server: StubJudge, **options) -> Judge:
    """A Judge of the stub, which stands as a pool instance (no switch needed)."""
    config = JudgeConfig(url=server.url, model="judge-model", **options)
    return Judge(config, [server.url.removesuffix("/v1")], environ={})


def score(loop_thread, judge: Judge, prompt: str = "Why?", answer: str = "Because."):
    async def ask():
        async with judge:
            return await judge.score(prompt, answer)
    return loop_thread.call(ask())


def test_judge_errors_say_what_went_wrong(loop_thread, judge_server):
    judge_server.status = 503
    with pytest.raises(JudgeError, match="the judge answered HTTP 503: .*judge down") as info:
        score(loop_thread, judge_of(judge_server))
    assert info.value.transient
    judge_server.status = 400
    with pytest.raises(JudgeError, match="HTTP 400") as info:
        score(loop_thread, judge_of(judge_server))
    assert not info.value.transient
    judge_server.status, judge_server.delay_s = 200, 2.0
    started = time.monotonic()
    with pytest.raises(JudgeError, match="within 0.3 s") as info:
        score(loop_thread, judge_of(judge_server, timeout_s=0.3))
    assert info.value.transient and time.monotonic() - started < 1.5
    judge_server.delay_s, judge_server.reply = 0.0, "Score: 1.5"
    with pytest.raises(JudgeError, match="outside"):
        score(loop_thread, judge_of(judge_server))
    refused = JudgeConfig(url=f"http://127.0.0.1:{free_port()}/v1", model="m")
    with pytest.raises(JudgeError, match="could not reach the judge") as info:
        score(loop_thread, Judge(refused, [refused.url.removesuffix("/v1")]))
    assert info.value.transient


def test_judge_sends_the_key_from_the_environment_and_cuts_long_answers(loop_thread, judge_server):
    config = JudgeConfig(url=judge_server.url, model="judge-model", api_key_env="MY_JUDGE_KEY", max_answer_chars=100)
    pool = [judge_server.url.removesuffix("/v1")]
    with pytest.raises(JudgeError, match="MY_JUDGE_KEY, which is not set"):
        Judge(config, pool, environ={})
    assert score(loop_thread, Judge(config, pool, environ={"MY_JUDGE_KEY": "sk-secret"}), answer="y" * 500) == 0.8
    headers, body = judge_server.requests[-1]
    assert headers["Authorization"] == "Bearer sk-secret"
    content = body["messages"][0]["content"]
    assert "y" * 100 + CUT_MARK.format(n=100) in content and "y" * 101 not in content


def test_only_a_pool_instance_judges_without_the_switch():
    pool = ["http://127.0.0.1:8101", "http://10.0.0.5:8000"]
    inside = JudgeConfig(url="http://127.0.0.1:8101/v1", model="m")
    assert outside_pool_problem(inside, pool) is None
    assert outside_pool_problem(JudgeConfig(url="http://10.0.0.5:8000/v1/", model="m"), pool) is None
    hosted = JudgeConfig(url="https://api.example.com/v1", model="m")
    assert "outside_pool_may_see_prompts" in outside_pool_problem(hosted, pool)
    assert outside_pool_problem(dataclasses.replace(hosted, outside_pool_may_see_prompts=True), pool) is None
    assert outside_pool_problem(JudgeConfig(url="http://127.0.0.1:8102/v1", model="m"), pool) is not None


# --- the [judge] section -----------------------------------------------------------------------------------------


def test_the_default_file_spells_out_the_judge_defaults():
    assert load_config(default_config_path()).judge == JudgeConfig()


@pytest.mark.parametrize("judge, key, message", [
    ({"url": "http://127.0.0.1:8101", "model": "m"}, "judge.url", "ending in /v1"),
    ({"url": "ftp://host/v1", "model": "m"}, "judge.url", "http:// or https://"),
    ({"url": "http://127.0.0.1:8101/v1"}, "judge.model", "required when url is set"),
    ({"api_key_env": "sk-abc123"}, "judge.api_key_env", "never the key itself"),
    ({"rubric": "Rate {answer}"}, "judge.rubric", "{prompt}"),
    ({"timeout_s": 0}, "judge.timeout_s", "must be > 0"),
    ({"max_concurrency": 0}, "judge.max_concurrency", "must be >= 1"),
    ({"max_answer_chars": 10}, "judge.max_answer_chars", "must be >= 100"),
])
def test_a_bad_judge_section_names_its_key(judge, key, message):
    instance = {"name": "a", "url": "http://127.0.0.1:9001", "model": "m", "gpu": "A30-24GB",
                "price_input_per_mtok": 0.1, "price_output_per_mtok": 0.2, "tpot_prior_ms": 10.0}
    with pytest.raises(ConfigError) as info:
        parse_config({"instances": [instance], "judge": judge}, "test.toml")
    assert info.value.key == key and message in info.value.reason


# --- parsing and the reference rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, expected", [
    ("Score: 0.8", 0.8), ("0.75", 0.75), ("The answer is right. Score: 1", 1.0), ("**Score:** 0.9", 0.9),
    ("score = .5", 0.5), ("Qwen2.5 thinks so. Score: 0", 0.0), ("Score: 0.2\nScore: 0.6", 0.6), ("1\n", 1.0),
])
def test_parse_score_reads_the_one_score(reply, expected):
    assert parse_score(reply) == expected


@pytest.mark.parametrize("reply, message", [
    ("A fine answer.", "no number"), ("Score: 7", "outside [0, 1]"), ("80%", "outside [0, 1]"),
    ("between 0.2 and 0.4", "several numbers and none marked"), ("", "no number"),
])
def test_parse_score_refuses_what_is_not_one_score(reply, message):
    with pytest.raises(JudgeError, match=re.escape(message)):
        parse_score(reply)


def test_reply_text_needs_a_chat_completion():
    assert reply_text({"choices": [{"message": {"content": "Score: 1"}}]}) == "Score: 1"
    for body in ({}, {"choices": []}, {"choices": [{"message": {"content": None}}]}, ["x"]):
        with pytest.raises(JudgeError, match="choices"):
            reply_text(body)


def test_fill_rubric_replaces_only_its_placeholders():
    assert fill_rubric("Q: {prompt} A: {answer} {other}", "say {answer}", "ok") == "Q: say {answer} A: ok {other}"


@pytest.mark.parametrize("answer, reference, expected", [
    ("The answer is 42.", "42", 1.0),
    ("So the total is 41", "42", 0.0),
    ("We get \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("x = 3/4", "\\frac{3}{4}", 1.0),
    ("In all: 1,000 apples", "1000", 1.0),
    ("Answer: $-2.5$", "-2.5", 1.0),
    ("step 1\nstep 2\nThe answer is 7", "7", 1.0),
    ("42 is not it; the answer is 43", "42", 0.0),
    ("Paris.", "paris", 1.0),
    ("'abc'", "abc", 1.0),
    ("answer: [1, 2]", "[1, 2]", 1.0),
    ("answer: [1, 3]", "[1, 2]", 0.0),
    ("The capital is Paris", "Paris", 0.0),  # an exact match, not a search
    ("", "42", 0.0),
])
def test_reference_rule(answer, reference, expected):
    assert reference_score(answer, reference) == expected


# --- opt-in: a real llama.cpp server as the judge -------------------------------------------------------------------


def _llamacpp():
    from test_llamacpp import INSTALL, MISSING, POOL_MODEL, LlamaServer

    return INSTALL, MISSING, POOL_MODEL, LlamaServer


LLAMA_INSTALL, LLAMA_MISSING, LLAMA_MODEL, LlamaServer = _llamacpp()


@pytest.mark.skipif(bool(LLAMA_MISSING), reason=f"opt-in: needs {', '.join(LLAMA_MISSING)} ({LLAMA_INSTALL})")
def test_a_real_llamacpp_server_judges(loop_thread, tmp_path):
    """SmolLM2-135M is too small to grade well: what is checked is the exchange with a real server (the request
    it accepts, the reply read), so its reply must give a score or be refused for what it says, never fail."""
    server = LlamaServer(tmp_path / "llama.log")
    try:
        server.wait_ready()
        rubric = DEFAULT_RUBRIC + "\nScore:"
        config = JudgeConfig(url=server.url + "/v1", model=LLAMA_MODEL, rubric=rubric, timeout_s=120)
        judge = Judge(config, [server.url])  # a pool instance: no switch needed
        try:
            value = score(loop_thread, judge, "What is 2 + 2?", "4")
        except JudgeError as e:  # the model answered, but not with one score in [0, 1]
            assert not e.transient and any(w in str(e) for w in ("no number", "several numbers", "outside")), e
        else:
            assert 0.0 <= value <= 1.0
    finally:
        server.kill()
